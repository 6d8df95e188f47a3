"""Checkpoints: written atomically, loaded with `weights_only=True`, never silently skipped.

A checkpoint holds plain state dicts, the step and the resolved config; no
pickled objects. A checkpoint that exists but cannot be read stops the run with
a clear message (the reference code swallowed such errors and restarted from
step 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pipeline.core.errors import UserError
from pipeline.core.fsutil import fsync_dir

CHECKPOINT = "checkpoint.pt"


class _WriteErrorKeeper:
    """Passes writes to a file and keeps the OSError (e.g. disk full) that torch.save reports as a bare RuntimeError."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_checkpoint(run: Path, state: dict[str, Any]) -> Path:
    """Write `run/checkpoint.pt` via a temporary file, fsync and rename: a crash leaves the previous one intact."""
    final = run / CHECKPOINT
    tmp = run / f".{CHECKPOINT}.{os.getpid()}.tmp"
    for stale in run.glob(f".{CHECKPOINT}.*.tmp"):  # left by a run killed while saving
        stale.unlink(missing_ok=True)
    try:
        with open(tmp, "wb") as f:
            writer = _WriteErrorKeeper(f)
            try:
                torch.save(state, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(run)
    return final


def load_checkpoint(run: Path) -> dict[str, Any] | None:
    """The run's checkpoint (on CPU, memory-mapped: only the tensors used are read), or None when it has none yet."""
    path = run / CHECKPOINT
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise UserError(
            f"{path} cannot be read ({str(exc).splitlines()[0][:120]}); move it away to start over, "
            "or restore a good copy"
        ) from None
