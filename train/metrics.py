"""Run metrics: `metrics.jsonl` (one JSON object per logged step), health diagnostics, a PNG of the curves."""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes

METRICS = "metrics.jsonl"
CURVES = "curves.png"
# A drawing takes the GIL from the thread beside it: on a long run's metrics (30,000 logged steps, 300 validations) it
# costs 1.2–1.7 s of CPU, and a Python thread beside it ran at 0.64 of its speed for 2 s (measured on 2 cores). Rank
# 0's thread launches the step's kernels while the other ranks wait for it: drawn after every validation, ~0.7 s lost
# every `val_every` steps (100 by default); at most one drawing per 5 minutes costs it under 0.3%.
CURVES_EVERY_S = 300.0


class MetricsLog:
    """Appends to `run/metrics.jsonl`; on resume, lines past the checkpoint's step are dropped first."""

    def __init__(self, run: Path) -> None:
        self.path = run / METRICS

    def truncate_after(self, step: int) -> None:
        """Drop what a killed run logged after its last checkpoint, so the file reads as one uninterrupted run."""
        if not self.path.exists():
            return
        keep = [line for line in self.read() if line["step"] <= step]
        atomic_write_bytes(self.path, "".join(json.dumps(line) + "\n" for line in keep).encode())

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every logged record; a last line cut short (killed, or disk full, while appending) is left out."""
        if not self.path.exists():
            return []
        lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except ValueError:
                if i < len(lines) - 1:
                    raise UserError(
                        f"{self.path} line {i + 1} is not JSON; the run's log was edited or damaged"
                    ) from None
        return records


def effective_rank(features: torch.Tensor) -> float:
    """RankMe: exp of the entropy of the normalised singular values of `[n, D]` features (collapse → small)."""
    return _rankme(torch.linalg.svdvals(features.float()))


def effective_rank_from_gram(gram: torch.Tensor) -> float:
    """RankMe of features `X` given only their `[D, D]` Gram matrix XᵀX (summed over chunks, ranks): the singular
    values of X are the square roots of its eigenvalues. Memory is D², whatever the number of features."""
    eigenvalues = torch.linalg.eigvalsh(gram.double()).clamp_min(0)
    return _rankme(eigenvalues.sqrt())


def _rankme(singular: torch.Tensor) -> float:
    p = singular / singular.sum().clamp_min(1e-12) + 1e-12
    return float(torch.exp(-(p * p.log()).sum()))


def plot_curves(run: Path) -> Path:
    """`run/curves.png`: training losses, and validation loss with true / shuffled / no captions."""
    from matplotlib.figure import Figure  # the object API, no pyplot state: safe in a background thread

    lines = MetricsLog(run).read()
    train = [r for r in lines if "loss" in r]
    val = [r for r in lines if "val_loss_predict" in r]
    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, 3)
    for key in ("loss", "loss_predict", "loss_sparse", "loss_consistency"):
        pts = [(r["step"], r[key]) for r in train if key in r and math.isfinite(r[key])]
        if pts and any(v for _, v in pts):
            axes[0].plot(*zip(*pts), label=key)
    axes[0].set_yscale("log")
    axes[0].set_title("training")
    for key, label in (
        ("val_loss_predict", "true captions"),
        ("val_loss_predict_shuffled", "shuffled captions"),
        ("val_loss_predict_notext", "no text"),
        ("val_loss_position_only", "position only (floor)"),
    ):
        pts = [(r["step"], r[key]) for r in val if key in r]
        if pts:
            axes[1].plot(*zip(*pts), marker="o", label=label)
    axes[1].set_title("validation prediction loss")
    ratio = [
        (r["step"], r["val_loss_predict"] / r["val_loss_predict_shuffled"])
        for r in val
        if r.get("val_loss_predict_shuffled")
    ]
    if ratio:
        axes[2].plot(*zip(*ratio), marker="o", label="true / shuffled")
    rank = [(r["step"], r["val_rankme"]) for r in val if "val_rankme" in r]
    centred = [(r["step"], r["val_rankme_centred"]) for r in val if "val_rankme_centred" in r]
    if rank:
        twin = axes[2].twinx()
        twin.plot(*zip(*rank), color="grey", linestyle="--", label="RankMe (right)")
        if centred:
            twin.plot(*zip(*centred), color="grey", linestyle=":", label="RankMe, position means removed")
        twin.legend(loc="upper right")
    axes[2].set_title("text reliance and feature rank")
    for ax in axes:
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left" if ax is axes[2] else "best")
    fig.tight_layout()
    out = run / CURVES
    tmp = run / f".{CURVES}.tmp.png"
    fig.savefig(tmp, dpi=90)
    tmp.replace(out)
    return out


class CurvePlotter:
    """Draws `curves.png` in a background thread, so the training ranks never wait for matplotlib, and at most once
    per `every_s` seconds (`CURVES_EVERY_S`), so its hold on the GIL stays small: the first request at once, later
    ones once `every_s` has passed since the last drawing began (a request in between, or made while one runs, is
    kept for then); `close` waits for the drawing under way and draws what is still asked for."""

    def __init__(self, every_s: float = CURVES_EVERY_S) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="curves")
        self._pending: Future[Path] | None = None
        self._every_s = every_s
        self._started: float | None = None  # time.monotonic() when the last drawing was handed to the thread
        self._asked = False  # a request not drawn yet
        self._run: Path | None = None
        self.drawings = 0  # handed to the thread (the one at `close` not counted)

    def draw(self, run: Path) -> None:
        self._run, self._asked = run, True
        running = self._pending is not None and not self._pending.done()
        if running or (self._started is not None and time.monotonic() - self._started < self._every_s):
            return
        self._started, self._asked = time.monotonic(), False
        self.drawings += 1
        self._pending = self._pool.submit(plot_curves, run)

    def close(self) -> None:
        """Wait for the drawing under way (its errors surface here), then draw the newest metrics if a request has
        not been drawn yet."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)
        if self._asked and self._run is not None:
            self._asked = False
            plot_curves(self._run)
