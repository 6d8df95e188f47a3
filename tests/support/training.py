"""Tiny `tcjepa train` runs: their options, the steps of the session's reference and exact runs, and comparing
runs by their metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def sets(*pairs: str) -> list[str]:
    """`--set key=value` for each pair."""
    return [arg for pair in pairs for arg in ("--set", pair)]


# A tiny run: 8×8 patches of 8 px, a 2-layer encoder and predictor, 4 captions per image.
TINY_TRAIN = [
    *("--model", "vit_tiny", "--patch-size", "8", "--image-size", "64", "--batch-size", "8"),
    *("--captions-per-image", "4", "--no-progress"),
    *sets("depth=2", "predictor_width=96", "predictor_depth=2", "min_context=4", "val_images=8"),
    *sets("num_workers=1", "warmup_steps=2"),
]
LOSS_KEYS = ("loss", "loss_predict", "loss_sparse", "loss_consistency")
# The reference run: 12 steps of `cross`, logging every step, validating and checkpointing every 4.
REFERENCE_STEPS = ["--steps", "12", *sets("log_every=1", "val_every=4", "checkpoint_every=4")]
# Runs compared across process counts: float32 (bf16 rounds differently per batch split), a checkpoint every 2 steps,
# gradients clipped to a norm that the first steps exceed (~31 to ~9 over the 8 steps), so that clipping on sharded
# gradients (FSDP, HSDP) is compared too.
EXACT_CLIP = 12.0
EXACT_STEPS = [
    "--steps",
    "8",
    *sets("log_every=1", "val_every=4", "checkpoint_every=2", "bf16=false", f"grad_clip={EXACT_CLIP}"),
]


def train_args(images: Path, cache: Path | str | None, store: Path | str | None, run: Path, *extra: object) -> list:
    """`tcjepa train` arguments of a tiny run on `images` (with a cache and store unless they are None)."""
    data = [] if cache is None else ["--cache", cache, "--store", store]
    return ["train", images, *data, "--out", run, *TINY_TRAIN, *extra]


def metrics(run: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_close_runs(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics agree step by step: losses within float32 reduction-order noise, schedules exactly."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in (*LOSS_KEYS, "grad_norm", "val_loss_predict"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), (x["step"], key)
        if "lr" in x:
            assert (x["lr"], x["wd"], x["ema"]) == (y["lr"], y["wd"], y["ema"])
