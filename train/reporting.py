"""Seeing a run's progress: the progress bar with the loss, or a line every `log_every` steps (`--no-progress`),
and the metrics sent on to TensorBoard and Weights & Biases (`--log`). metrics.jsonl stays the record
(train.metrics); nothing here is read back."""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

logger = logging.getLogger(__name__)

LOGGERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_PROJECT = "tcjepa"


def check_loggers(names: list[str]) -> None:
    """Refuse an unknown `--log` value, or one whose package is not installed, before anything is built."""
    for name in names:
        if name not in LOGGERS:
            raise UserError(f"--log {name}: choose {' or '.join(LOGGERS)}")
    missing = {
        "tensorboard": ("tensorboard", "pip install 'tcjepa[tensorboard]' (or pip install tensorboard)"),
        "wandb": ("wandb", "pip install wandb, then `wandb login` (or WANDB_MODE=offline)"),
    }
    for name in names:
        module, how = missing[name]
        try:
            __import__(module)
        except ImportError:
            raise UserError(f"--log {name} needs the {module} package, which is not installed: {how}") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers by name (per-layer lists as `name/i`), the step left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, list):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if isinstance(v, (int, float))})
    return out


def format_line(record: dict[str, Any], total: int, eta_s: float | None) -> str:
    """One line of a training log record: step, loss terms, lr, images/s, ETA."""
    eta = "" if eta_s is None else f" | ETA {time.strftime('%H:%M:%S', time.gmtime(eta_s))}"
    if eta_s is not None and eta_s >= 86400:
        eta = f" | ETA {eta_s / 86400:.1f} d"
    return (
        f"step {record['step']}/{total} | loss {record['loss']:.4f} (predict {record['loss_predict']:.4f}, sparse "
        f"{record['loss_sparse']:.4f}, consistency {record['loss_consistency']:.4f}) | lr {record['lr']:.3g} | "
        f"{record['images_per_s']:.1f} images/s{eta}"
    )


class Progress:
    """What rank 0 shows and sends while training. `step()` after every step; `logged()` with every metrics record."""

    def __init__(self, run: Path, config: dict[str, Any], start: int, total: int, bar: bool, loggers: list[str]):
        self.start, self.total = start, total
        self.began = time.perf_counter()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr)
        self.tensorboard = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run / TENSORBOARD_DIR))
        self.wandb = None
        if "wandb" in loggers:
            import wandb

            # One W&B run per run directory: a resumed run continues its curves.
            run_id = hashlib.sha256(str(run.resolve()).encode()).hexdigest()[:16]
            self.wandb = wandb.init(
                project=WANDB_PROJECT, name=run.name, id=run_id, resume="allow", dir=str(run), config=config
            )

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def eta(self, step: int) -> float | None:
        done = step - self.start
        if done < 1:
            return None
        return (self.total - step) * (time.perf_counter() - self.began) / done

    def logged(self, record: dict[str, Any]) -> None:
        """A metrics record (training or validation): on the bar or as a line, and to the loggers."""
        step = int(record["step"])
        if "loss" in record:
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            else:
                logger.info(format_line(record, self.total, self.eta(step)))
        elif "val_loss_predict" in record and self.bar is None:
            logger.info(
                f"step {step}/{self.total} | validation: predict {record['val_loss_predict']:.4f} (shuffled captions "
                f"{record['val_loss_predict_shuffled']:.4f}, no text {record['val_loss_predict_notext']:.4f}) | "
                f"position only {record['val_loss_position_only']:.4f} | RankMe {record['val_rankme']:.1f} "
                f"({record['val_rankme_centred']:.1f} with each position's mean removed)"
            )
        values = scalars(record)
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
