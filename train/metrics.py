"""Run metrics: `metrics.jsonl` (one JSON object per logged step), health diagnostics, a PNG of the curves."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes

METRICS = "metrics.jsonl"
CURVES = "curves.png"


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
    """Draws `curves.png` in a background thread, so the training ranks never wait for matplotlib: one drawing at a
    time, a request made while one runs draws once more after it (with the newest metrics); `close` waits."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="curves")
        self._pending: Future[Path] | None = None
        self._again = False
        self._run: Path | None = None

    def draw(self, run: Path) -> None:
        self._run = run
        if self._pending is not None and not self._pending.done():
            self._again = True
            return
        self._pending = self._pool.submit(self._draw, run)

    def _draw(self, run: Path) -> Path:
        out = plot_curves(run)
        while self._again:
            self._again = False
            out = plot_curves(run)
        return out

    def close(self) -> None:
        """Wait for the drawing under way (its errors surface here)."""
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)
        if self._again and self._run is not None:  # asked for just as the last drawing ended
            self._again = False
            plot_curves(self._run)
