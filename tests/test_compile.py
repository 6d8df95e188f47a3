"""`--compile`: one graph per block type for a whole run (torch's own logs count the recompiles and graph breaks), and
compiled blocks train as eager ones do, with activation checkpointing and accumulation on top."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from tests.support.commands import tcjepa
from tests.support.training import TINY_TRAIN
from tests.support.training_step import STEP_CONFIG, STEP_TEXT_DIM, assert_same_models, step_batch, train_steps
from train.config import ModelConfig, TrainConfig
from train.jepa import build_models
from train.parallel import checkpoint_blocks, compile_blocks


@pytest.mark.slow
def test_a_compiled_run_recompiles_at_most_6_times_and_never_breaks_its_graph(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    """30 steps on masks that change every step (context and target lengths), 3 validations (another batch size, no
    grad, shuffled and caption-less controls), counted by TORCH_LOGS. Expected: the grad-mode variants (the target
    encoder and validation run without grad), the encoder block's two layouts (the context packed `[T, d]`, the
    target's whole images `[B, L, d]`), and on the CPU one size range of inductor's C++ reductions (a guard such as
    `1025 <= x.size()[0] <= 4096` on the packed predictor tokens): 5 here. Not one per step. The run's checkpoint is
    the compiled model's (`--compile` through the CLI is tested here alone)."""
    run = tmp_path / "compiled"
    env = {**os.environ, "TORCH_LOGS": "recompiles,graph_breaks"}
    proc = tcjepa(
        "train",
        synth_dir / "images",
        "--cache",
        annotated_cache,
        "--store",
        annotated_store,
        "--out",
        run,
        *TINY_TRAIN,
        "--steps",
        "30",
        "--compile",
        "--set",
        "log_every=5",
        "--set",
        "val_every=10",
        "--set",
        "bf16=false",
        env=env,
    )
    log = proc.stderr
    recompiles = log.count("Recompiling function")
    assert 1 <= recompiles <= 6, log[-4000:]  # at least one: validation runs without grad, so the logs are on
    assert "graph break" not in log.lower(), log[-4000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == [5, 10, 15, 20, 25, 30]
    assert [m["step"] for m in lines if "val_loss_predict" in m] == [10, 20, 30]
    assert lines[-1]["val_loss_predict"] < lines[0]["loss_predict"]
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 30


@pytest.mark.slow
def test_compiled_checkpointed_accumulated_blocks_train_as_eager_ones():
    cfg = TrainConfig(**{**STEP_CONFIG.__dict__, "compile": True, "checkpoint_activations": True, "accum_steps": 2})
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(cfg), STEP_TEXT_DIM)
    eager, eager_target = copy.deepcopy(model), copy.deepcopy(target)
    compile_blocks(model.encoder.blocks, model.predictor.blocks, target.blocks)
    checkpoint_blocks(model.encoder.blocks, model.predictor.blocks)
    batches = [step_batch(s) for s in range(3)]
    parts = torch.stack(train_steps(cfg, model, target, batches))
    eager_parts = torch.stack(train_steps(STEP_CONFIG, eager, eager_target, batches))
    torch.testing.assert_close(parts, eager_parts, rtol=1e-5, atol=1e-6)
    assert_same_models(model, eager, rtol=1e-4, atol=1e-6)
    assert_same_models(target, eager_target, rtol=1e-4, atol=1e-6)
