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

from pipeline.errors import UserError
from pipeline.fsutil import fsync_dir

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(run: Path, state: dict[str, Any]) -> Path:
    """Write `run/checkpoint.pt` via a temporary file, fsync and rename: a crash leaves the previous one intact."""
    final = run / CHECKPOINT
    tmp = run / f".{CHECKPOINT}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
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
        raise UserError(f"{path} cannot be read ({str(exc).splitlines()[0][:120]}); move it away to start over, "
                        "or restore a good copy") from None
