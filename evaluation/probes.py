"""Frozen-feature probes: linear, k-NN, dense (per patch), multi-label and attentive.

Every probe picks its hyper-parameters on a validation split (a held-out part of the training images), then
scores the test split once (with class folders: `--val`).

- linear: a linear layer on standardised pooled features, trained with SGD (momentum 0.9, cosine schedule,
  cross-entropy) on the device; every learning rate × weight decay of the sweep is trained side by side, the
  pair with the best validation accuracy (then lowest validation loss) is refitted on train + validation.
- k-NN: DINO's weighted vote: the k = 20 nearest train + validation images by cosine similarity each vote for
  their class with weight exp(cos / T), T = 0.07.
- dense: the linear probe per patch on patch features (mIoU and patch accuracy).
- multilabel: which of a set of labels an image has: one logistic regression per label on standardised pooled
  features, trained and swept as the linear probe (binary cross-entropy summed over labels); the candidate with
  the best validation mean average precision is refitted on train + validation; test mAP.
- attentive: one learnable query cross-attending to the patch tokens, then an MLP and a linear head, trained
  with AdamW; the learning rate with the best validation accuracy is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from evaluation.protocol import (
    ATTENTIVE_BATCH,
    ATTENTIVE_EPOCHS,
    ATTENTIVE_LRS,
    ATTENTIVE_MIN_STEPS,
    DENSE_MAX_PATCHES,
    KNN_K,
    KNN_T,
    LINEAR_BATCH,
    LINEAR_EPOCHS,
    LINEAR_LRS,
    LINEAR_MIN_STEPS,
    LINEAR_WDS,
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


def _linear_steps(n: int) -> int:
    return max(LINEAR_MIN_STEPS, LINEAR_EPOCHS * math.ceil(n / LINEAR_BATCH))


class LinearHeads(nn.Module):
    """One linear classifier per (learning rate, weight decay) candidate on standardised features, trained side
    by side on the same batches, held as one weight `[heads, classes, D]` and one bias `[heads, classes]`;
    `forward` gives logits `[n, heads, classes]`."""

    def __init__(self, x: torch.Tensor, classes: int, heads: int) -> None:
        super().__init__()
        self.mean = x.mean(0)
        self.std = x.std(0, correction=0).clamp_min(1e-6)
        self.heads, self.classes = heads, classes
        # zero start: the fit is convex, and no seed is needed
        self.weight = nn.Parameter(torch.zeros(heads, classes, x.shape[1], device=x.device))
        self.bias = nn.Parameter(torch.zeros(heads, classes, device=x.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear((x - self.mean) / self.std, self.weight.flatten(0, 1), self.bias.flatten())
        return logits.view(len(x), self.heads, self.classes)


def fit_linear(
    x: torch.Tensor, y: torch.Tensor, classes: int, candidates: list[tuple[float, float]], seed: int
) -> LinearHeads:
    """Train one linear head per (lr, weight decay) on (`x`, `y`) (on their device): SGD with momentum 0.9 and
    a cosine schedule, `LINEAR_EPOCHS` passes in batches of `LINEAR_BATCH` (at least `LINEAR_MIN_STEPS` steps);
    weight decay is the L2 penalty of the weights (not the biases).

    `y` int `[n]`: one class per row (softmax cross-entropy); float `[n, classes]`: a 0/1 target per label
    (multi-label: binary cross-entropy, summed over labels, one logistic regression per label).

    One SGD of learning rate 1 steps every head: each head's loss (its mean over the batch, plus wd/2 · |W|²) is
    weighted by its learning rate. Momentum is linear in the gradients, so this is SGD with one parameter group
    per head (lr, weight_decay), with the same results, and two parameters to step instead of two per head.
    """
    model = LinearHeads(x, classes, len(candidates))
    lrs = torch.tensor([lr for lr, _ in candidates], device=x.device)
    wds = torch.tensor([wd for _, wd in candidates], device=x.device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    steps = _linear_steps(len(x))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(steps))
    gen = torch.Generator().manual_seed(seed)
    batch = min(LINEAR_BATCH, len(x))
    order = torch.zeros(0, dtype=torch.int64)
    for _ in range(steps):
        if len(order) < batch:
            order = torch.cat([order, torch.randperm(len(x), generator=gen)])
        rows, order = order[:batch].to(x.device), order[batch:]
        logits = model(x[rows])  # [batch, heads, classes]
        target = y[rows]
        if target.ndim == 1:
            flat = target.repeat_interleave(model.heads)
            per_head = F.cross_entropy(logits.flatten(0, 1), flat, reduction="none").view(len(rows), model.heads)
        else:
            per_head = F.binary_cross_entropy_with_logits(
                logits, target[:, None].expand_as(logits), reduction="none"
            ).sum(-1)
        penalty = model.weight.square().sum((1, 2)) * wds / 2
        loss = (lrs * (per_head.mean(0) + penalty)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.requires_grad_(False)


def _scores(model: LinearHeads, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accuracy, mean cross-entropy) of each head on (`x`, `y`), in chunks."""
    correct = torch.zeros(model.heads, device=x.device)
    loss = torch.zeros(model.heads, device=x.device)
    with torch.no_grad():
        for lo in range(0, len(x), 8192):
            logits = model(x[lo : lo + 8192])
            target = y[lo : lo + 8192, None].expand(-1, model.heads)
            correct += (logits.argmax(-1) == target).sum(0)
            loss += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view_as(target).sum(0)
    return (correct / len(x)).cpu(), (loss / len(x)).nan_to_num(nan=math.inf).cpu()


def predict_linear(model: LinearHeads, x: torch.Tensor, head: int = 0) -> torch.Tensor:
    """Class scores `[n, classes]` of one head."""
    with torch.no_grad():
        return torch.cat([model(x[lo : lo + 8192])[:, head] for lo in range(0, len(x), 8192)])


def sweep_linear(
    x_train: torch.Tensor, y_train: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor, classes: int, seed: int
) -> tuple[tuple[float, float], dict[str, float]]:
    """The (lr, weight decay) of `LINEAR_LRS` × `LINEAR_WDS` with the best validation accuracy (ties: the lowest
    validation loss), and every candidate's validation accuracy."""
    candidates = [(lr, wd) for lr in LINEAR_LRS for wd in LINEAR_WDS]
    accuracy, loss = _scores(fit_linear(x_train, y_train, classes, candidates, seed), x_val, y_val)
    best = max(range(len(candidates)), key=lambda i: (float(accuracy[i]), -float(loss[i])))
    return candidates[best], {f"lr={lr:g},wd={wd:g}": float(a) for (lr, wd), a in zip(candidates, accuracy)}


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


def linear_probe(x: np.ndarray, y: np.ndarray, split: Split, seed: int, device: torch.device = _CPU) -> ProbeResult:
    """The linear probe on pooled features `x` `[n, D]`: sweep on validation, refit on train + validation,
    test top-1 (and top-5)."""
    classes = _classes(y)
    xs, ys = _tensor(np.asarray(x, dtype=np.float32), device), _tensor(y.astype(np.int64), device)
    train, val, test = (_tensor(rows, device) for rows in (split.train, split.val, split.test))
    (lr, wd), sweep = sweep_linear(xs[train], ys[train], xs[val], ys[val], classes, seed)
    trainval = torch.cat([train, val])
    model = fit_linear(xs[trainval], ys[trainval], classes, [(lr, wd)], seed)
    metrics = _top(predict_linear(model, xs[test]), ys[test], classes)
    return ProbeResult("linear", metrics, split.sizes(), {"lr": lr, "weight_decay": wd}, sweep)


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


def dense_probe(
    patches: np.ndarray,
    labels: np.ndarray,
    split: Split,
    seed: int,
    device: torch.device = _CPU,
    max_patches: int = DENSE_MAX_PATCHES,
    name: str = "dense",
) -> ProbeResult:
    """The linear probe per patch (`patches` `[m, L, D]`, `labels` `[m, L]`, -1 = unlabelled): sweep on the
    validation images' patches, refit on train + validation; test patch accuracy and mIoU. `name` is the
    report's name of the probe (which per-cell map it reads)."""
    rng = np.random.default_rng([seed, _SPLIT_STREAM, 1])
    x_train, y_train = _patch_rows(patches, labels, split.train, max_patches, rng)
    x_val, y_val = _patch_rows(patches, labels, split.val, max_patches, rng)
    if len(np.unique(y_train)) < 2:
        raise ValueError("the dense probe needs at least two patch classes among the training images")
    if len(y_val) == 0:
        raise ValueError("the dense probe needs labelled patches among the validation images")
    classes = _classes(labels)
    xt, yt, xv, yv = (_tensor(a, device) for a in (x_train, y_train, x_val, y_val))
    (lr, wd), sweep = sweep_linear(xt, yt, xv, yv, classes, seed)
    model = fit_linear(torch.cat([xt, xv]), torch.cat([yt, yv]), classes, [(lr, wd)], seed)
    x_test, y_test = _patch_rows(patches, labels, split.test, None, rng)
    pred = predict_linear(model, _tensor(x_test, device)).argmax(1).cpu().numpy()
    metrics = {"patch_accuracy": float((pred == y_test).mean()), "miou": mean_iou(pred, y_test, classes)}
    sizes = {**split.sizes(), "train_patches": len(y_train), "val_patches": len(y_val), "test_patches": len(y_test)}
    return ProbeResult(name, metrics, sizes, {"lr": lr, "weight_decay": wd}, sweep)


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


def _multilabel_scores(model: LinearHeads, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[float]]:
    """(mean AP, mean binary cross-entropy summed over labels) of each head on (`x`, `y`)."""
    with torch.no_grad():
        logits = torch.cat([model(x[lo : lo + 8192]) for lo in range(0, len(x), 8192)])  # [n, heads, labels]
        target = y[:, None].expand_as(logits)
        loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1).mean(0)
    scores, truth = logits.cpu().numpy(), y.cpu().numpy() > 0.5
    maps = [mean_average_precision(scores[:, h], truth)[0] for h in range(logits.shape[1])]
    return [-1.0 if math.isnan(m) else m for m in maps], loss.nan_to_num(nan=math.inf).cpu().tolist()


def multilabel_probe(x: np.ndarray, y: np.ndarray, split: Split, seed: int, device: torch.device = _CPU) -> ProbeResult:
    """Which labels each image has (`y` bool `[n, labels]`) from pooled features `x` `[n, D]`: one logistic
    regression per label, (lr, weight decay) swept on validation mAP (ties: lowest loss), refitted on train +
    validation; test mean average precision over the labels that have a positive among the test images."""
    if y.shape[1] == 0:
        raise ValueError("the multi-label probe needs at least one tag")
    labels = y.shape[1]
    xs, ys = _tensor(np.asarray(x, dtype=np.float32), device), _tensor(y.astype(np.float32), device)
    train, val, test = (_tensor(rows, device) for rows in (split.train, split.val, split.test))
    candidates = [(lr, wd) for lr in LINEAR_LRS for wd in LINEAR_WDS]
    val_map, val_loss = _multilabel_scores(fit_linear(xs[train], ys[train], labels, candidates, seed), xs[val], ys[val])
    best = max(range(len(candidates)), key=lambda i: (val_map[i], -val_loss[i]))
    lr, wd = candidates[best]
    trainval = torch.cat([train, val])
    model = fit_linear(xs[trainval], ys[trainval], labels, [(lr, wd)], seed)
    score, scored = mean_average_precision(predict_linear(model, xs[test]).cpu().numpy(), y[split.test])
    if math.isnan(score):
        raise ValueError("the multi-label probe needs test images with at least one tag")
    sweep = {f"lr={lr:g},wd={wd:g}": m for (lr, wd), m in zip(candidates, val_map)}
    sizes = {**split.sizes(), "labels": labels, "scored_labels": scored}
    return ProbeResult("multilabel", {"map": score}, sizes, {"lr": lr, "weight_decay": wd}, sweep)


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
    """AdamW with a cosine schedule for `epochs` passes, and at least ATTENTIVE_MIN_STEPS steps on small sets."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AttentiveProbe(patches.shape[-1], _heads(patches.shape[-1]), classes).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
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
    """Attentive probe on patch tokens `[m, L, D]`; the learning rate is picked on validation; test top-1 accuracy."""
    classes = int(y.max()) + 1
    sweep: dict[str, float] = {}
    best: tuple[float, float, AttentiveProbe | None] = (-1.0, 0.0, None)
    for lr in ATTENTIVE_LRS:
        model = _train_attentive(patches, y, split.train, classes, lr, epochs, seed, device)
        score = _accuracy(model, patches, y, split.val, device)
        sweep[f"lr={lr:g}"] = score
        if score > best[0]:
            best = (score, lr, model)
    assert best[2] is not None
    top1 = _accuracy(best[2], patches, y, split.test, device)
    return ProbeResult("attentive", {"top1": top1}, split.sizes(), {"lr": best[1], "epochs": epochs}, sweep)
