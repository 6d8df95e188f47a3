"""Variants of the session's tiny models (`tiny_models`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np


def another_t5(tiny_models: Path, out: Path) -> Path:
    """A copy of the session's tiny T5 with one weight changed: another encoder to every recipe, for the price of a
    file copy (building one with `tcjepa tiny-models --seed 1` costs ~10 CPU-seconds)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(tiny_models / "t5", out)
    weights = load_file(out / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + np.ones((), weights[first].dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
