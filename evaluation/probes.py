"""Frozen-feature probes: linear, k-NN, dense (per patch), multi-label and attentive.

Every probe picks its hyper-parameters on a validation split (a held-out part of the training images), then
scores the test split once (with class folders: `--val`).

- linear: logistic regression (softmax) on standardised pooled features, fitted to convergence by L-BFGS
  (`evaluation.logistic`); its L2 penalty is swept on validation accuracy (then loss), the grid extended past an
  end that wins, and the chosen penalty refitted on train + validation.
- k-NN: DINO's weighted vote: the k = 20 nearest train + validation images by cosine similarity each vote for
  their class with weight exp(cos / T), T = 0.07.
- dense: the linear probe per patch on patch features (mIoU and patch accuracy).
- multilabel: which of a set of labels an image has: one logistic regression per label on standardised pooled
  features, fitted and swept as the linear probe (binary cross-entropy summed over labels) on validation mean
  average precision; test mAP.
- attentive: one learnable query cross-attending to the patch tokens, then an MLP and a linear head, trained
  with AdamW; the learning rate with the best validation accuracy is kept, the grid extended past an end that
  wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from evaluation.logistic import LogisticFit, Standardise, accuracy_and_loss, data_loss, fit_logistic, sweep_l2
from evaluation.protocol import (
    ATTENTIVE_BATCH,
    ATTENTIVE_EPOCHS,
    ATTENTIVE_LIMITS,
    ATTENTIVE_LRS,
    ATTENTIVE_MIN_STEPS,
    DENSE_MAX_PATCHES,
    KNN_K,
    KNN_T,
)
from train.vit import LN_EPS, MLP

_SPLIT_STREAM = 7
_CPU = torch.device("cpu")


@dataclass
class Split:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}


def random_split(n: int, test_fraction: float, val_fraction: float, seed: int) -> Split:
    """A seeded split of n rows: `test_fraction` for test, then `val_fraction` of the rest for validation."""
    if not (0 < test_fraction < 1 and 0 < val_fraction < 1):
        raise ValueError("test and validation fractions must lie strictly between 0 and 1")
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n)
    n_test = max(1, round(n * test_fraction))
    n_val = max(1, round((n - n_test) * val_fraction))
    if n - n_test - n_val < 2:
        raise ValueError(f"{n} labelled images are too few to split into train, validation and test")
    return Split(np.sort(order[n_test + n_val :]), np.sort(order[n_test : n_test + n_val]), np.sort(order[:n_test]))


@dataclass
class ProbeResult:
    probe: str
    metrics: dict[str, float]  # on the test split
    split: dict[str, int]
    chosen: dict[str, Any] = field(default_factory=dict)  # the hyper-parameters picked on validation
    validation: dict[str, float] = field(default_factory=dict)  # validation accuracy of each candidate

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "metrics": self.metrics,
            "split": self.split,
            "chosen": self.chosen,
            "validation": self.validation,
        }


def _cosine(steps: int) -> Any:
    return lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))


def _top(scores: torch.Tensor, y: torch.Tensor, classes: int) -> dict[str, float]:
    """Top-1 accuracy, and top-5 when there are more than 5 classes."""
    ranked = scores.topk(min(5, classes), dim=1).indices
    hit = ranked == y[:, None]
    out = {"top1": float(hit[:, 0].float().mean())}
    if classes > 5:
        out["top5"] = float(hit.any(1).float().mean())
    return out


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _classes(y: np.ndarray) -> int:
    return int(y.max()) + 1


def _logistic(
    x: torch.Tensor,
    y: torch.Tensor,
    outputs: int,
    split: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    score: Callable[[LogisticFit, torch.Tensor, torch.Tensor], tuple[float, float]],
) -> tuple[LogisticFit, dict[str, Any], dict[str, float]]:
    """Sweep the L2 penalty on (train, validation) by `score`, refit the chosen one on train + validation: the fit,
    what was chosen (penalty, at an edge, converged, iterations) and every penalty's validation score."""
    train, val, _ = split
    stats = Standardise.of(x[train])
    sweep = sweep_l2(
        lambda l2, start: fit_logistic(x[train], y[train], outputs, l2, stats, start),
        lambda fit: score(fit, x[val], y[val]),
    )
    trainval = torch.cat([train, val])
    final = fit_logistic(x[trainval], y[trainval], outputs, sweep.chosen.l2, start=sweep.chosen)
    chosen = {**sweep.describe(), "converged": sweep.converged and final.converged, "iterations": final.iterations}
    return final, chosen, sweep.scores


def linear_probe(x: np.ndarray, y: np.ndarray, split: Split, device: torch.device = _CPU) -> ProbeResult:
    """The linear probe on pooled features `x` `[n, D]`: the L2 penalty swept on validation, refitted on train +
    validation; test top-1 (and top-5)."""
    classes = _classes(y)
    xs, ys = _tensor(np.asarray(x, dtype=np.float32), device), _tensor(y.astype(np.int64), device)
    rows = tuple(_tensor(r, device) for r in (split.train, split.val, split.test))
    fit, chosen, scores = _logistic(xs, ys, classes, rows, accuracy_and_loss)  # type: ignore[arg-type]
    metrics = _top(fit.logits(xs[rows[2]]), ys[rows[2]], classes)
    return ProbeResult("linear", metrics, split.sizes(), chosen, scores)


def knn_scores(
    bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, classes: int, k: int, t: float
) -> torch.Tensor:
    """`[q, classes]` DINO's weighted k-NN votes: with L2-normalised features, each of a query's k most similar
    bank rows adds exp(cosine / t) to its class."""
    bank = F.normalize(bank, dim=1)
    out = torch.zeros(len(queries), classes, device=queries.device)
    for lo in range(0, len(queries), 256):  # a chunk's similarities to ImageNet's 1.28 M images: 1.3 GB
        sims, idx = (F.normalize(queries[lo : lo + 256], dim=1) @ bank.T).topk(k, dim=1)
        out[lo : lo + 256].scatter_add_(1, bank_labels[idx], (sims / t).exp())
    return out


def knn_probe(
    x: np.ndarray, y: np.ndarray, split: Split, k: int = KNN_K, t: float = KNN_T, device: torch.device = _CPU
) -> ProbeResult:
    """DINO's weighted k-NN on pooled features over the train + validation images; test top-1 (and top-5)."""
    bank = np.concatenate([split.train, split.val])
    k = min(k, len(bank))
    classes = _classes(y)
    xs, ys = _tensor(np.asarray(x, dtype=np.float32), device), _tensor(y.astype(np.int64), device)
    rows, test = _tensor(bank, device), _tensor(split.test, device)
    scores = knn_scores(xs[rows], ys[rows], xs[test], classes, k, t)
    return ProbeResult("knn", _top(scores, ys[test], classes), split.sizes(), {"k": k, "T": t})


def mean_iou(pred: np.ndarray, truth: np.ndarray, classes: int) -> float:
    """Mean over classes that occur in `truth` or `pred` of |pred ∩ truth| / |pred ∪ truth|."""
    confusion = np.bincount(truth * classes + pred, minlength=classes * classes).reshape(classes, classes)
    inter = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - inter
    present = union > 0
    return float((inter[present] / union[present]).mean())


def _patch_rows(
    patches: np.ndarray, labels: np.ndarray, images: np.ndarray, limit: int | None, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(features, classes) of the labelled patches of `images`, at most `limit` of them drawn at random."""
    img, pos = np.nonzero(labels[images] >= 0)
    if limit is not None and len(img) > limit:
        keep = np.sort(rng.choice(len(img), limit, replace=False))
        img, pos = img[keep], pos[keep]
    rows = images[img]
    return np.asarray(patches[rows, pos], dtype=np.float32), labels[rows, pos]


def patch_split(
    patches: np.ndarray, labels: np.ndarray, split: Split, seed: int, max_patches: int = DENSE_MAX_PATCHES
) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The dense probe's rows: float32 features `[r, D]` and classes `[r]` of the labelled patches, train and
    validation images' at most `max_patches` each (drawn with `seed`), then every test image's; and the row ranges
    of train, validation and test."""
    rng = np.random.default_rng([seed, _SPLIT_STREAM, 1])
    x_train, y_train = _patch_rows(patches, labels, split.train, max_patches, rng)
    x_val, y_val = _patch_rows(patches, labels, split.val, max_patches, rng)
    if len(np.unique(y_train)) < 2:
        raise ValueError("the dense probe needs at least two patch classes among the training images")
    if len(y_val) == 0:
        raise ValueError("the dense probe needs labelled patches among the validation images")
    x_test, y_test = _patch_rows(patches, labels, split.test, None, rng)
    ends = np.cumsum([0, len(y_train), len(y_val), len(y_test)])
    rows = tuple(np.arange(lo, hi) for lo, hi in zip(ends[:-1], ends[1:]))
    return np.concatenate([x_train, x_val, x_test]), np.concatenate([y_train, y_val, y_test]), rows  # type: ignore


def dense_probe(
    patches: np.ndarray,
    labels: np.ndarray,
    split: Split,
    seed: int,
    device: torch.device = _CPU,
    max_patches: int = DENSE_MAX_PATCHES,
    name: str = "dense",
) -> ProbeResult:
    """The linear probe per patch (`patches` `[m, L, D]`, `labels` `[m, L]`, -1 = unlabelled): the L2 penalty swept
    on the validation images' patches, refitted on train + validation; test patch accuracy and mIoU. `name` is the
    report's name of the probe (which per-cell map it reads)."""
    x, y, (train, val, test) = patch_split(patches, labels, split, seed, max_patches)
    classes = _classes(labels)
    xs, ys = _tensor(x, device), _tensor(y.astype(np.int64), device)
    rows = tuple(_tensor(r, device) for r in (train, val, test))
    fit, chosen, scores = _logistic(xs, ys, classes, rows, accuracy_and_loss)  # type: ignore[arg-type]
    pred = fit.logits(xs[rows[2]]).argmax(1).cpu().numpy()
    metrics = {"patch_accuracy": float((pred == y[test]).mean()), "miou": mean_iou(pred, y[test], classes)}
    sizes = {**split.sizes(), "train_patches": len(train), "val_patches": len(val), "test_patches": len(test)}
    return ProbeResult(name, metrics, sizes, chosen, scores)


def average_precision(scores: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """float64 `[labels]`: each column's average precision, NaN where the column has no positive.

    AP = Σ_k (R_k − R_{k−1}) P_k over the distinct scores as thresholds, high to low (no interpolation; rows with
    tied scores pass a threshold together), as scikit-learn's `average_precision_score` defines it: each positive
    adds the precision at its score's threshold, and the sum is divided by the number of positives.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    truth = np.asarray(truth, dtype=bool).reshape(len(scores), -1)
    n = len(scores)
    order = np.argsort(-scores, axis=0, kind="stable")
    ranked = np.take_along_axis(scores, order, 0)
    hits = np.take_along_axis(truth, order, 0).astype(np.float64)
    true_positives = hits.cumsum(0)
    # the last row of each run of tied scores, for every row of the run: precision is taken there
    last = np.ones_like(ranked, dtype=bool)
    last[:-1] = ranked[:-1] != ranked[1:]
    ends = np.where(last, np.arange(n)[:, None], n)
    ends = np.minimum.accumulate(ends[::-1], axis=0)[::-1]
    precision = np.take_along_axis(true_positives, ends, 0) / (ends + 1)
    positives = hits.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(positives > 0, (hits * precision).sum(0) / positives, np.nan)


def mean_average_precision(scores: np.ndarray, truth: np.ndarray) -> tuple[float, int]:
    """(mean AP over the labels with a positive among the rows, how many such labels); NaN when none has one."""
    ap = average_precision(scores, truth)
    scored = ~np.isnan(ap)
    return (float(ap[scored].mean()) if scored.any() else math.nan), int(scored.sum())


def _map_and_loss(fit: LogisticFit, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean AP, mean binary cross-entropy summed over labels) of `fit` on (`x`, `y` float `[n, labels]`): the
    multi-label probe's selection (a validation set without any positive scores -1)."""
    logits = fit.logits(x)
    score, _ = mean_average_precision(logits.cpu().numpy(), y.cpu().numpy() > 0.5)
    loss = float(data_loss(logits, y)) / max(len(y), 1)
    return (-1.0 if math.isnan(score) else score), (loss if math.isfinite(loss) else math.inf)


def multilabel_probe(x: np.ndarray, y: np.ndarray, split: Split, device: torch.device = _CPU) -> ProbeResult:
    """Which labels each image has (`y` bool `[n, labels]`) from pooled features `x` `[n, D]`: one logistic
    regression per label, the L2 penalty swept on validation mAP (ties: lowest loss), refitted on train +
    validation; test mean average precision over the labels that have a positive among the test images."""
    if y.shape[1] == 0:
        raise ValueError("the multi-label probe needs at least one tag")
    labels = y.shape[1]
    xs, ys = _tensor(np.asarray(x, dtype=np.float32), device), _tensor(y.astype(np.float32), device)
    rows = tuple(_tensor(r, device) for r in (split.train, split.val, split.test))
    fit, chosen, scores = _logistic(xs, ys, labels, rows, _map_and_loss)  # type: ignore[arg-type]
    score, scored = mean_average_precision(fit.logits(xs[rows[2]]).cpu().numpy(), y[split.test])
    if math.isnan(score):
        raise ValueError("the multi-label probe needs test images with at least one tag")
    sizes = {**split.sizes(), "labels": labels, "scored_labels": scored}
    return ProbeResult("multilabel", {"map": score}, sizes, chosen, scores)


class AttentiveProbe(nn.Module):
    """One learnable query cross-attends to the (frozen) patch tokens, then MLP, LayerNorm and a linear head.

    The attention is `nn.MultiheadAttention`'s function, computed query first. With one query, shared by every image,
    each head's logits are `x_l · (W_k_hᵀ q_h) / √d_h` plus a term that is the same for every token (softmax drops
    it), and its output is `W_v_h (Σ_l a_l x_l) + b_v_h` because the weights sum to 1. So the keys and values of the
    L tokens are never projected: O(L·D) per image and head instead of O(L·D²), which is most of the probe's cost.
    The token LayerNorm's scale γ and shift β fold in alike (logits `x̂_l · (γ ⊙ r_h)`, pooled `γ ⊙ Σ_l a_l x̂_l + β`):
    only its parameter-free standardisation x̂ touches the tokens, so nothing is backpropagated through them.
    """

    def __init__(self, dim: int, heads: int, classes: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.query, std=0.02)
        self.norm_tokens = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm_mlp = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = MLP(dim, 4 * dim)
        self.norm_out = nn.LayerNorm(dim, eps=LN_EPS)
        self.head = nn.Linear(dim, classes)

    def attend(self, tokens: torch.Tensor) -> torch.Tensor:
        """`self.attn(query, kv, kv)` with `kv = self.norm_tokens(tokens)`, `tokens` `[B, L, D]`, query first (see the
        class): `[B, 1, D]`."""
        dim, heads = self.query.shape[-1], self.attn.num_heads
        norm = self.norm_tokens
        standard = F.layer_norm(tokens, norm.normalized_shape, eps=norm.eps)
        w_q, w_k, w_v = self.attn.in_proj_weight.chunk(3)
        b_q, _, b_v = self.attn.in_proj_bias.chunk(3)
        q = (self.query[0, 0] @ w_q.T + b_q).view(heads, dim // heads)
        reads = torch.einsum("he,hed->hd", q, w_k.view(heads, dim // heads, dim)) / math.sqrt(dim // heads)
        weights = torch.einsum("bld,hd->bhl", standard, reads * norm.weight).softmax(-1)
        pooled = torch.einsum("bhl,bld->bhd", weights, standard) * norm.weight + norm.bias
        values = torch.einsum("bhd,hed->bhe", pooled, w_v.view(heads, dim // heads, dim)).flatten(1) + b_v
        return self.attn.out_proj(values)[:, None]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.query + self.attend(tokens)
        x = x + self.mlp(self.norm_mlp(x))
        return self.head(self.norm_out(x[:, 0]))


def _heads(dim: int) -> int:
    return next(h for h in (8, 6, 4, 3, 2, 1) if dim % h == 0)


def _accuracy(
    model: AttentiveProbe, patches: np.ndarray, y: np.ndarray, rows: np.ndarray, device: torch.device
) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for lo in range(0, len(rows), 512):
            batch = torch.from_numpy(np.asarray(patches[rows[lo : lo + 512]], dtype=np.float32)).to(device)
            correct += int((model(batch).argmax(1).cpu().numpy() == y[rows[lo : lo + 512]]).sum())
    return correct / max(len(rows), 1)


def _train_attentive(
    patches: np.ndarray,
    y: np.ndarray,
    rows: np.ndarray,
    classes: int,
    lr: float,
    epochs: int,
    seed: int,
    device: torch.device,
) -> AttentiveProbe:
    """AdamW with a cosine schedule for `epochs` passes, and at least ATTENTIVE_MIN_STEPS steps on small sets. AdamW's
    fused update, one pass over each tensor: on the CPU the default updates one tensor at a time and the multi-tensor
    one makes a pass per operation, 4.5x slower on the pixels' 7M-parameter probe (parameters within 1e-6 after 300
    steps)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AttentiveProbe(patches.shape[-1], _heads(patches.shape[-1]), classes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05, fused=True)
    steps = max(ATTENTIVE_MIN_STEPS, epochs * math.ceil(len(rows) / ATTENTIVE_BATCH))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(steps))
    targets = torch.from_numpy(y)
    model.train()
    order: np.ndarray = np.zeros(0, dtype=np.int64)
    for _ in range(steps):
        if len(order) < min(ATTENTIVE_BATCH, len(rows)):
            order = np.concatenate([order, rows[torch.randperm(len(rows), generator=gen).numpy()]])
        batch, order = np.sort(order[:ATTENTIVE_BATCH]), order[ATTENTIVE_BATCH:]
        tokens = torch.from_numpy(np.asarray(patches[batch], dtype=np.float32)).to(device)
        loss = F.cross_entropy(model(tokens), targets[batch].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model


def attentive_probe(
    patches: np.ndarray, y: np.ndarray, split: Split, seed: int, device: torch.device, epochs: int = ATTENTIVE_EPOCHS
) -> ProbeResult:
    """Attentive probe on patch tokens `[m, L, D]`; the learning rate is picked on validation, the grid extended past
    an end that wins (a half-decade at a time, within `ATTENTIVE_LIMITS`); test top-1 accuracy."""
    classes = int(y.max()) + 1
    lrs = sorted(ATTENTIVE_LRS)
    step = (lrs[-1] / lrs[0]) ** (1 / max(len(lrs) - 1, 1))
    tried: dict[float, tuple[float, AttentiveProbe]] = {}

    def score(lr: float) -> None:
        model = _train_attentive(patches, y, split.train, classes, lr, epochs, seed, device)
        tried[lr] = (_accuracy(model, patches, y, split.val, device), model)

    for lr in lrs:
        score(lr)
    while True:
        order = sorted(tried)
        accuracy = [tried[lr][0] for lr in order]
        tied = [i for i, a in enumerate(accuracy) if a == max(accuracy)]
        i = tied[len(tied) // 2]  # on a plateau, its middle
        # An end is past the optimum only when it beats its neighbour; a plateau that reaches it is not.
        rising = len(order) > 1 and (
            (i == len(order) - 1 and accuracy[i] > accuracy[i - 1]) or (i == 0 and accuracy[0] > accuracy[1])
        )
        if rising and i == len(order) - 1 and order[i] * step <= ATTENTIVE_LIMITS[1] * (1 + 1e-9):
            score(order[i] * step)
        elif rising and i == 0 and order[0] / step >= ATTENTIVE_LIMITS[0] * (1 - 1e-9):
            score(order[0] / step)
        else:
            break
    best = order[i]
    top1 = _accuracy(tried[best][1], patches, y, split.test, device)
    chosen = {"lr": best, "epochs": epochs, "at_edge": rising}
    sweep = {f"lr={lr:.3g}": tried[lr][0] for lr in order}
    return ProbeResult("attentive", {"top1": top1}, split.sizes(), chosen, sweep)
