"""Logistic regression fitted to convergence, and the sweep of its L2 penalty: what every linear probe stands on.

A probe on frozen features is a convex problem, so it has one answer for each penalty, and a number read off an
optimiser stopped early (SGD for a fixed number of epochs) is the optimiser's, not the features'. Here each fit
minimises, on features standardised by the training rows' mean and deviation,

    mean over rows of the loss  +  l2 / 2 · ‖W‖²          (the bias is not penalised)

with full-batch L-BFGS (strong-Wolfe line search) in float64, aiming a decade below `GRAD_TOLERANCE` for the
largest gradient entry, and counted as converged at `GRAD_TOLERANCE` (float32 arithmetic stalls near 1e-5 on such
losses).
The loss is softmax cross-entropy for one class per row, or binary cross-entropy summed over labels for a 0/1
target per label (one logistic regression per label). This is scikit-learn's `LogisticRegression(C=1 / (l2 · n))`,
fitted by the same method; `benchmarks.probe_check` compares the two on a report's own features.

The penalty is swept on a validation split: the grid of `L2_GRID`, strongest first, each fit starting from the
previous one's weights. When the best penalty is an end of the grid, the grid is extended past it a decade at a
time (within `L2_LIMITS`, and past the lower one to no penalty at all, the end of the range), so that the chosen
value is never an edge of what was tried, or the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evaluation.protocol import GRAD_TOLERANCE, L2_GRID, L2_LIMITS, LBFGS_MAX_ITER

ROWS_PER_CHUNK = 65_536  # rows per forward in a closure: bounded memory on ImageNet-sized sets


@dataclass
class Standardise:
    """The training rows' per-feature mean and deviation (a constant feature divides by 1e-6, not 0)."""

    mean: torch.Tensor
    std: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor) -> Standardise:
        return cls(x.mean(0), x.std(0, correction=0).clamp_min(1e-6))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


@dataclass
class LogisticFit:
    """A fitted linear map of standardised features: logits = standardise(x) Wᵀ + b."""

    weight: torch.Tensor  # [outputs, D]
    bias: torch.Tensor  # [outputs]
    standardise: Standardise
    l2: float
    iterations: int
    gradient: float  # the largest gradient entry at the end
    loss: float  # the penalised objective at the end

    @property
    def converged(self) -> bool:
        return self.gradient <= GRAD_TOLERANCE

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float64 logits `[n, outputs]` of `x` `[n, D]`."""
        with torch.no_grad():
            return torch.cat(
                [
                    F.linear(self.standardise(x[lo : lo + ROWS_PER_CHUNK]).double(), self.weight, self.bias)
                    for lo in range(0, len(x), ROWS_PER_CHUNK)
                ]
            )


def data_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Softmax cross-entropy for classes `y` int `[n]`; binary cross-entropy summed over labels for `y` float
    `[n, labels]`."""
    if y.ndim == 1:
        return F.cross_entropy(logits, y, reduction=reduction)
    per_row = F.binary_cross_entropy_with_logits(logits, y, reduction="none").sum(-1)
    return per_row.sum() if reduction == "sum" else per_row


def fit_logistic(
    x: torch.Tensor,
    y: torch.Tensor,
    outputs: int,
    l2: float,
    standardise: Standardise | None = None,
    start: LogisticFit | None = None,
    max_iter: int = LBFGS_MAX_ITER,
) -> LogisticFit:
    """The penalised logistic regression of (`x` `[n, D]`, `y`) with `outputs` classes or labels, by L-BFGS from
    `start`'s weights (or zero), on `x`'s device."""
    standardise = standardise or Standardise.of(x)
    z = standardise(x).double()
    y = y.double() if y.is_floating_point() else y
    n = len(z)
    weight = torch.zeros(outputs, z.shape[1], device=z.device, dtype=z.dtype) if start is None else start.weight
    bias = torch.zeros(outputs, device=z.device, dtype=z.dtype) if start is None else start.bias
    weight, bias = weight.clone(), bias.clone()
    grad_w, grad_b = torch.zeros_like(weight), torch.zeros_like(bias)
    weight.grad, bias.grad = grad_w, grad_b
    opt = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=max_iter,
        max_eval=max_iter * 2,
        tolerance_grad=GRAD_TOLERANCE / 10,  # aimed a decade below what counts as converged
        tolerance_change=1e-14,
        history_size=10,
        line_search_fn="strong_wolfe",
    )

    @torch.no_grad()
    def objective() -> torch.Tensor:
        """The objective and, in the parameters' `.grad`, its gradient in closed form (softmax or sigmoid minus the
        target, times the rows): no autograd graph per evaluation, which on small probes costs more than the maths."""
        total = torch.zeros((), device=z.device, dtype=z.dtype)
        grad_w.zero_()
        grad_b.zero_()
        for lo in range(0, n, ROWS_PER_CHUNK):
            rows, target = z[lo : lo + ROWS_PER_CHUNK], y[lo : lo + ROWS_PER_CHUNK]
            logits = F.linear(rows, weight, bias)
            if target.ndim == 1:
                # cross-entropy and softmax from one exponential: with few classes torch's softmax and
                # cross_entropy kernels cost ~3.5x this on the CPU (~0.47 ms against ~0.13 ms a call on 1664 x 8)
                shifted = logits - logits.amax(dim=1, keepdim=True)
                picked = shifted.gather(1, target[:, None]).sum()
                residual = shifted.exp_()
                norm = residual.sum(dim=1, keepdim=True)
                total += (norm.log().sum() - picked) / n
                residual.div_(norm)
                residual[torch.arange(len(target), device=z.device), target] -= 1
            else:
                total += data_loss(logits, target) / n
                residual = logits.sigmoid() - target
            grad_w.addmm_(residual.T, rows, alpha=1 / n)
            grad_b.add_(residual.sum(dim=0), alpha=1 / n)
        grad_w.add_(weight, alpha=l2)
        return total + l2 / 2 * weight.square().sum()

    opt.step(objective)
    loss = float(objective())
    gradient = max(float(grad_w.abs().max()), float(grad_b.abs().max()))
    iterations = int(opt.state[opt._params[0]].get("n_iter", 0))
    return LogisticFit(weight.detach(), bias.detach(), standardise, l2, iterations, gradient, loss)


def _label(l2: float) -> str:
    return f"l2={l2:.0e}"


@dataclass
class Sweep:
    """The penalties tried on validation, the chosen one, and whether it is an end of what was tried."""

    chosen: LogisticFit
    scores: dict[str, float]  # validation score of each penalty tried, strongest first
    at_edge: bool  # the best penalty is an end of the grid even after extending it to L2_LIMITS
    converged: bool  # every fit of the sweep reached the gradient tolerance

    def describe(self) -> dict[str, object]:
        return {"l2": self.chosen.l2, "at_edge": self.at_edge, "converged": self.converged}


def sweep_l2(
    fit: Callable[[float, LogisticFit | None], LogisticFit],
    score: Callable[[LogisticFit], tuple[float, float]],
) -> Sweep:
    """Fit every penalty of `L2_GRID` (strongest first, each from the previous weights) and keep the best by
    `score` (a validation metric, higher is better, then a validation loss, lower is better); extend the grid a
    decade at a time past whichever end is best, up to `L2_LIMITS`."""
    grid = sorted(L2_GRID, reverse=True)
    fits: list[LogisticFit] = []
    for l2 in grid:
        fits.append(fit(l2, fits[-1] if fits else None))
    ranked = {id(f): score(f) for f in fits}

    def best() -> int:
        """The best fit; on an exact tie (a plateau of the metric and the loss), the middle of the plateau."""
        keys = [(ranked[id(f)][0], -ranked[id(f)][1]) for f in fits]
        tied = [i for i, key in enumerate(keys) if key == max(keys)]
        return tied[len(tied) // 2]

    while True:
        i = best()
        weakest = fits[-1].l2
        if i == len(fits) - 1 and weakest > 0:
            # a decade weaker, or past the lower limit no penalty at all: the end of the range, not of the sweep
            weaker = weakest / 10 if weakest / 10 >= L2_LIMITS[0] * (1 - 1e-9) else 0.0
            fits.append(fit(weaker, fits[-1]))
            ranked[id(fits[-1])] = score(fits[-1])
        elif i == 0 and fits[0].l2 * 10 <= L2_LIMITS[1] * (1 + 1e-9):
            fits.insert(0, fit(fits[0].l2 * 10, fits[0]))
            ranked[id(fits[0])] = score(fits[0])
        else:
            break
    i = best()
    return Sweep(
        chosen=fits[i],
        scores={_label(f.l2): ranked[id(f)][0] for f in fits},
        # no penalty (l2 = 0) is the end of the range itself; the strongest penalty tried is an edge past which the
        # range goes on (up to a constant predictor), so a winner there is reported as at the edge
        at_edge=i == 0 or (i == len(fits) - 1 and fits[i].l2 > 0),
        converged=all(f.converged for f in fits),
    )


def accuracy_and_loss(fit: LogisticFit, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `fit` on (`x`, `y` int `[n]`): the linear and dense probes' selection."""
    logits = fit.logits(x)
    loss = float(data_loss(logits, y)) / max(len(y), 1)
    return float((logits.argmax(1) == y).float().mean()), (loss if math.isfinite(loss) else math.inf)
