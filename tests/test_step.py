"""The training step in one process: accumulated micro-batches give the one-batch update, activation checkpointing
changes nothing but memory, and the host-to-device path (no streams on the CPU) hands over every batch as it is."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.training_step import STEP_CONFIG, STEP_TEXT_DIM, assert_same_models, step_batch, train_steps
from train.config import ModelConfig, TrainConfig
from train.data import Batch
from train.jepa import build_models
from train.masks import padded_length
from train.parallel import checkpoint_blocks
from train.step import micro_batches, on_device


@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_accumulated_micro_batches_give_the_one_batch_update(pool):
    cfg = TrainConfig(**{**STEP_CONFIG.__dict__, "pool": pool})
    batches = [step_batch(s) for s in range(2)]
    counts = [[mb.images_with_text() for mb in micro_batches(b, 4)] for b in batches]
    assert any(len(set(c)) > 1 for c in counts), f"micro-batches must differ in images with text: {counts}"
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(cfg), STEP_TEXT_DIM)
    results = {}
    for k in (1, 2, 4):
        m, t = copy.deepcopy(model), copy.deepcopy(target)
        parts = train_steps(TrainConfig(**{**cfg.__dict__, "accum_steps": k}), m, t, batches)
        results[k] = (m, t, torch.stack(parts))
    one_model, one_target, one_parts = results[1]
    assert one_parts[:, 2].min() > 0, "the regularisers take part"
    for k in (2, 4):
        m, t, parts = results[k]
        torch.testing.assert_close(parts, one_parts, rtol=1e-5, atol=1e-6)
        assert_same_models(m, one_model, rtol=1e-4, atol=1e-6)
        assert_same_models(t, one_target, rtol=1e-4, atol=1e-6)


def test_micro_batches_are_the_batch_rows_with_only_padding_dropped():
    batch = step_batch(3)
    micro = micro_batches(batch, 4)
    assert [len(mb) for mb in micro] == [2] * 4
    for name in ("images", "context_lengths", "targets", "tokens", "lengths"):
        assert torch.equal(torch.cat([getattr(mb, name) for mb in micro]), getattr(batch, name)), name
    for i, mb in enumerate(micro):
        rows = batch.context[2 * i : 2 * i + 2]
        assert mb.context.shape[1] == padded_length(int(mb.context_lengths.max())) <= rows.shape[1]
        for row, full, n in zip(mb.context, rows, mb.context_lengths):
            assert torch.equal(row[:n], full[:n])
    assert sum(mb.images_with_text() for mb in micro) == batch.images_with_text() < len(batch)


def test_checkpointed_blocks_train_the_same_and_keep_their_names():
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(STEP_CONFIG), STEP_TEXT_DIM)
    plain, plain_target = copy.deepcopy(model), copy.deepcopy(target)
    checkpoint_blocks(model.encoder.blocks, model.predictor.blocks)
    assert type(model.encoder.blocks[0]).__name__ == "CheckpointWrapper"
    assert list(model.state_dict()) == list(plain.state_dict())
    batches = [step_batch(s) for s in range(2)]
    parts = train_steps(STEP_CONFIG, model, target, batches)
    plain_parts = train_steps(STEP_CONFIG, plain, plain_target, batches)
    torch.testing.assert_close(torch.stack(parts), torch.stack(plain_parts), rtol=1e-6, atol=1e-7)
    assert_same_models(model, plain, rtol=1e-5, atol=1e-7)
    plain.load_state_dict(model.state_dict())  # a checkpointed model's state loads into a plain one


def test_contexts_padded_to_a_multiple_of_8_train_as_contexts_cut_to_their_longest():
    """The rounding changes shapes only: the same batches with each context cut back to its longest real patch give
    the same losses and the same models."""
    batches = [step_batch(s) for s in range(2)]
    assert all(b.context.shape[1] % 8 == 0 for b in batches)
    assert any(b.context.shape[1] > int(b.context_lengths.max()) for b in batches), "no batch was rounded up"
    cut = [copy.copy(b) for b in batches]
    for b in cut:
        b.context = b.context[:, : int(b.context_lengths.max())]
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(STEP_CONFIG), STEP_TEXT_DIM)
    runs = []
    for inputs in (batches, cut):
        m, t = copy.deepcopy(model), copy.deepcopy(target)
        runs.append((m, t, torch.stack(train_steps(STEP_CONFIG, m, t, inputs))))
    (m, t, parts), (m_cut, t_cut, parts_cut) = runs
    torch.testing.assert_close(parts, parts_cut, rtol=1e-5, atol=1e-6)
    assert_same_models(m, m_cut, rtol=1e-4, atol=1e-6)
    assert_same_models(t, t_cut, rtol=1e-4, atol=1e-6)


def padded_on_host(batch: Batch) -> torch.Tensor:
    """The batch's packed captions zero-padded slot by slot on the host, as the loader used to ship them."""
    b, n = batch.lengths.shape
    longest = padded_length(max(int(batch.lengths.max()), 1))
    out = torch.zeros(b, n, longest, batch.tokens.shape[-1], dtype=torch.float16)
    start = 0
    for k in range(b):
        for j in range(n):
            length = int(batch.lengths[k, j])
            out[k, j, :length] = batch.tokens[start : start + length]
            start += length
    assert start == len(batch.tokens)
    return out


def test_on_the_cpu_batches_reach_the_step_unchanged_and_one_ahead():
    """While the step holds batch i, a thread of on_device's own takes batch i + 1 from the loader and copies it:
    the step's thread never waits for the loader while there is a batch ahead."""
    import threading
    import time

    batches = [step_batch(s) for s in range(3)]
    pulled, threads = [], set()

    def source():
        for i, b in enumerate(batches):
            pulled.append(i)
            threads.add(threading.current_thread().name)
            yield b

    seen = []
    for i, (batch, micro) in enumerate(on_device(source(), torch.device("cpu"), 2)):
        deadline = time.monotonic() + 10
        while len(pulled) < min(i + 2, len(batches)) and time.monotonic() < deadline:
            time.sleep(0.01)  # this step "runs": the next batch is fetched meanwhile
        assert pulled == list(range(min(i + 2, len(batches))))
        assert batch is batches[i]
        for mb, host in zip(micro, micro_batches(batch, 2)):
            assert torch.equal(mb.images, host.images) and torch.equal(mb.context, host.context)
            assert torch.equal(mb.tokens, padded_on_host(host)) and torch.equal(mb.lengths, host.lengths)
            assert mb.images_with_text == host.images_with_text()
        seen.append(i)
    assert seen == [0, 1, 2]
    assert threading.current_thread().name not in threads and all(t.startswith("tcjepa-batches") for t in threads)


def _block_input_dtypes(cfg: TrainConfig, model: torch.nn.Module, target: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes of the residual stream each encoder and predictor block took in one training step."""
    seen: set[torch.dtype] = set()
    blocks = [*model.encoder.blocks, *model.predictor.blocks]
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.add(args[0].dtype)) for b in blocks]
    train_steps(cfg, model, target, [step_batch(0, cfg)])
    for hook in hooks:
        hook.remove()
    return seen


def test_under_fsdp_with_bf16_parameters_the_residual_stream_stays_float32_as_in_one_process(tmp_path):
    """FSDP2 gathers bf16 parameters; autocast casts for the matmuls, as in one process (and under DDP), where the
    residual stream between blocks stays float32. Blocks that cast their inputs (FSDP's default) would take it in
    bf16. A one-process gloo group: FSDP's hooks run as on many."""
    import torch.distributed as dist

    from train.parallel import shard

    cfg = TrainConfig(**{**STEP_CONFIG.__dict__, "bf16": True})
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(cfg), STEP_TEXT_DIM)
    assert _block_input_dtypes(cfg, copy.deepcopy(model), copy.deepcopy(target)) == {torch.float32}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        shard(model, target, cfg, torch.device("cpu"))
        assert _block_input_dtypes(cfg, model, target) == {torch.float32}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("affine", [{}, {"bias": False}, {"elementwise_affine": False}])
def test_a_layer_norm_with_bf16_parameters_normalises_a_float32_input_in_float32(affine):
    from train.vit import LayerNorm

    x = torch.randn(4, 8)
    norm = LayerNorm(8, **affine)
    if norm.weight is not None:
        torch.nn.init.normal_(norm.weight)
    norm.to(torch.bfloat16)
    rounded = [None if p is None else p.float() for p in (norm.weight, norm.bias)]
    out = norm(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,), *rounded, eps=norm.eps))
    assert norm(x.bfloat16()).dtype == torch.bfloat16, "a bf16 input stays bf16, as nn.LayerNorm keeps it"


def test_the_step_reports_the_gradient_norm_before_clipping_and_clips_to_grad_clip():
    def gradients(model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    batches = [step_batch(0)]
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(STEP_CONFIG), STEP_TEXT_DIM)
    free = copy.deepcopy(model)
    (parts,) = train_steps(
        TrainConfig(**{**STEP_CONFIG.__dict__, "grad_clip": 0.0}), free, copy.deepcopy(target), batches
    )
    norm = float(parts[5])
    assert norm == pytest.approx(float(gradients(free).norm()), rel=1e-5)
    clipped = copy.deepcopy(model)
    cfg = TrainConfig(**{**STEP_CONFIG.__dict__, "grad_clip": norm / 4})
    (parts,) = train_steps(cfg, clipped, copy.deepcopy(target), batches)
    assert float(parts[5]) == pytest.approx(norm, rel=1e-5), "the norm reported is the one before clipping"
    assert float(gradients(clipped).norm()) == pytest.approx(norm / 4, rel=1e-4)
    torch.testing.assert_close(gradients(clipped), gradients(free) / 4, rtol=1e-4, atol=1e-9)
