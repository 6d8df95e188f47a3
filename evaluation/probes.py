"""Frozen-feature probes: linear, k-NN, dense (per patch) and attentive.

Every probe picks its one hyper-parameter on a validation split, then scores the
held-out test split once. Linear and dense probes are scikit-learn's multinomial
logistic regression on standardised features, refitted on train + validation
with the chosen regularisation; the k-NN probe votes among the k nearest training
images by cosine similarity; the attentive probe (one learnable query
cross-attending to the patch tokens, then an MLP and a linear head) is trained
with AdamW, and the learning rate with the best validation accuracy is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from train.vit import LN_EPS, MLP

LINEAR_C = (0.001, 0.01, 0.1, 1.0, 10.0)
KNN_K = 20
DENSE_MAX_PATCHES = 100_000
ATTENTIVE_LRS = (1e-3, 3e-3, 1e-2)
ATTENTIVE_EPOCHS = 40
ATTENTIVE_MIN_STEPS = 300
ATTENTIVE_BATCH = 128
_SPLIT_STREAM = 7


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
    chosen: dict[str, Any] = field(default_factory=dict)  # the hyper-parameter picked on validation
    validation: dict[str, float] = field(default_factory=dict)  # validation score of each candidate

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "metrics": self.metrics,
            "split": self.split,
            "chosen": self.chosen,
            "validation": self.validation,
        }


def _logistic(c: float, seed: int) -> Any:
    """A scikit-learn pipeline: standardise, then logistic regression with inverse regularisation `c`."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, random_state=seed))


def _fit_logistic(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    x_all: np.ndarray,
    y_all: np.ndarray,
    seed: int,
) -> tuple[Any, float, dict[str, float]]:
    """Sweep C on validation, refit on train + validation with the best; returns (model, best C, sweep)."""
    sweep = {}
    for c in LINEAR_C:
        sweep[f"C={c:g}"] = float(_logistic(c, seed).fit(x_train, y_train).score(x_val, y_val))
    best = LINEAR_C[int(np.argmax(list(sweep.values())))]
    return _logistic(best, seed).fit(x_all, y_all), best, sweep


def linear_probe(x: np.ndarray, y: np.ndarray, split: Split, seed: int) -> ProbeResult:
    """Multinomial logistic regression on pooled features; test top-1 accuracy."""
    trainval = np.concatenate([split.train, split.val])
    model, best, sweep = _fit_logistic(
        x[split.train], y[split.train], x[split.val], y[split.val], x[trainval], y[trainval], seed
    )
    return ProbeResult(
        "linear", {"top1": float(model.score(x[split.test], y[split.test]))}, split.sizes(), {"C": best}, sweep
    )


def knn_probe(x: np.ndarray, y: np.ndarray, split: Split, k: int = KNN_K) -> ProbeResult:
    """Majority vote of the k nearest train + validation images by cosine similarity; test top-1 accuracy."""
    from sklearn.neighbors import KNeighborsClassifier

    bank = np.concatenate([split.train, split.val])
    k = min(k, len(bank))
    model = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute").fit(x[bank], y[bank])
    return ProbeResult("knn", {"top1": float(model.score(x[split.test], y[split.test]))}, split.sizes(), {"k": k})


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
    patches: np.ndarray, labels: np.ndarray, split: Split, seed: int, max_patches: int = DENSE_MAX_PATCHES
) -> ProbeResult:
    """Per-patch logistic regression (`patches` `[m, L, D]`, `labels` `[m, L]`, -1 = unlabelled): accuracy and mIoU."""
    rng = np.random.default_rng([seed, _SPLIT_STREAM, 1])
    x_train, y_train = _patch_rows(patches, labels, split.train, max_patches, rng)
    x_val, y_val = _patch_rows(patches, labels, split.val, max_patches, rng)
    x_all, y_all = np.concatenate([x_train, x_val]), np.concatenate([y_train, y_val])
    if len(np.unique(y_train)) < 2:
        raise ValueError("the dense probe needs at least two patch classes among the training images")
    model, best, sweep = _fit_logistic(x_train, y_train, x_val, y_val, x_all, y_all, seed)
    x_test, y_test = _patch_rows(patches, labels, split.test, None, rng)
    pred = model.predict(x_test)
    classes = int(max(labels.max(), pred.max())) + 1
    metrics = {"patch_accuracy": float((pred == y_test).mean()), "miou": mean_iou(pred, y_test, classes)}
    sizes = {**split.sizes(), "train_patches": len(y_train), "val_patches": len(y_val), "test_patches": len(y_test)}
    return ProbeResult("dense", metrics, sizes, {"C": best}, sweep)


class AttentiveProbe(nn.Module):
    """One learnable query cross-attends to the (frozen) patch tokens, then MLP, LayerNorm and a linear head."""

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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        kv = self.norm_tokens(tokens)
        x = self.query.expand(len(tokens), -1, -1)
        x = x + self.attn(x, kv, kv, need_weights=False)[0]
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
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
