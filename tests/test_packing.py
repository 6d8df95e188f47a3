"""Packed batches (`train.packing`): the real tokens alone through every per-token layer, the same features and
gradients as padded rows with a key mask, and fewer FLOPs."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from pipeline.core.errors import UserError
from tests.support.training_step import STEP_CONFIG, STEP_TEXT_DIM
from train.config import ModelConfig
from train.jepa import build_models
from train.objective import compute_losses
from train.packing import TokenLayout
from train.parallel import use_attention, wrap_models
from train.predictor import TextBatch
from train.vit import VisionTransformer


def test_pack_and_pad_are_inverse_on_the_real_tokens_and_pad_writes_zeros():
    valid = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    layout = TokenLayout.of(valid)
    assert layout.slots is not None and layout.slots.tolist() == [0, 1, 3, 6, 7, 8]
    x = torch.arange(9 * 2, dtype=torch.float32).view(3, 3, 2)
    packed = layout.pack(x)
    torch.testing.assert_close(packed, x[valid])
    padded = layout.pad(packed)
    torch.testing.assert_close(padded[valid], x[valid])
    assert (padded[~valid] == 0).all()
    ranks = layout.ranks().view(3, 3)
    assert ranks[valid].tolist() == list(range(6))
    assert layout.pack(torch.arange(9).view(3, 3)).tolist() == [0, 1, 3, 6, 7, 8]  # rows without features


def test_jagged_rows_are_each_row_s_real_tokens_in_packed_order_and_bound_the_longest():
    """`TokenLayout.jagged`: nested rows over the packed tokens whose offsets are the rows' starts, one ragged size
    for all the tensors of a call (q, k and v), and whose `max_seqlen` (what sizes the flash kernel's grid on CUDA; a
    CPU ignores it) is at least the longest row."""
    valid = torch.tensor([[True, False, True, False], [True, True, True, True], [False, True, False, False]])
    layout = TokenLayout.of(valid, 7)
    x = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    q, k = layout.jagged(x, x + 1)
    assert q.offsets().tolist() == [0, 2, 6, 7]
    assert [row.tolist() for row in q.unbind()] == [x[0:2].tolist(), x[2:6].tolist(), x[6:7].tolist()]
    assert q._get_max_seqlen() >= 4 and q._get_min_seqlen() >= 1 and q.shape[1] == k.shape[1]  # one ragged size


def test_a_count_that_cannot_fit_is_refused_and_one_that_is_not_the_mask_s_is_caught():
    with pytest.raises(ValueError, match="7 real tokens cannot fit in a padded batch of \\(2, 3\\)"):
        TokenLayout.of(torch.ones(2, 3, dtype=torch.bool), 7)
    with pytest.raises(RuntimeError, match="the host's token count is not the mask's"):
        TokenLayout.of(torch.tensor([[True, False, False], [True, True, False]]), 4)


def _contexts(g: torch.Generator, patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four images' contexts of 3, 9, 5 and 1 of `patches` patches, padded to 9 with arbitrary patches."""
    lengths = torch.tensor([3, 9, 5, 1])
    keep = torch.stack([torch.randperm(patches, generator=g)[:9] for _ in lengths])
    return keep, torch.arange(9) < lengths[:, None]


def test_a_packed_encoder_gives_the_masked_one_s_features_and_gradients():
    """Run on the real tokens alone, the encoder's features at real positions and its parameters' gradients equal
    those of padded rows with a key mask; the padding's features are zeros."""
    torch.manual_seed(0)
    encoder = VisionTransformer(image_size=32, patch_size=8, width=32, depth=2, heads=4)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, 32, 32, generator=g)
    keep, valid = _contexts(g, 16)
    weights = torch.randn(4, 9, 32, generator=g) * valid[..., None]

    def run(layout: TokenLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
        encoder.zero_grad()
        features = encoder(images, keep, layout)
        (features * weights).sum().backward()
        return features, [p.grad.clone() for p in encoder.parameters()]

    masked, masked_grads = run(TokenLayout(valid))
    packed, packed_grads = run(TokenLayout.of(valid, int(valid.sum())))
    torch.testing.assert_close(packed[valid], masked[valid], rtol=1e-5, atol=1e-5)
    assert (packed[~valid] == 0).all()
    for a, b in zip(packed_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["masked", "jagged"])
@pytest.mark.parametrize("conditioning", ["none", "cross"])
def test_a_packed_step_computes_the_masked_step_s_losses_and_gradients_with_fewer_flops(conditioning, attention):
    """The whole objective (encoder, predictor, regularisers) on packed contexts and words against padded rows with
    a key mask: the same losses and gradients, and FlopCounterMode counts the padding's FLOPs gone. Packed tokens
    attend in padded rows with the key mask (`masked`), or as nested jagged rows (`jagged`); the padded run is
    always masked."""
    torch.manual_seed(0)
    cfg = replace(STEP_CONFIG, conditioning=conditioning)
    model, target = build_models(ModelConfig.of(cfg), text_dim=STEP_TEXT_DIM)
    use_attention(model, attention)
    g = torch.Generator().manual_seed(2)
    images = torch.randn(4, 3, 64, 64, generator=g)
    keep, valid = _contexts(g, 64)
    targets = torch.stack([torch.randperm(64, generator=g)[:4].view(2, 2) for _ in range(4)])
    lengths = torch.tensor([[7, 2], [3, 0], [8, 8], [1, 5]])  # padded to 8 words; one caption missing
    tokens = torch.randn(4, 2, 8, STEP_TEXT_DIM, generator=g) * (torch.arange(8) < lengths[..., None])[..., None]

    def run(layout: TokenLayout, words: int | None) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        model.zero_grad()
        text = TextBatch(tokens, lengths, words)
        # FlopCounterMode cannot follow SDPA's nested math path on a CPU (it counts the flash kernel's on CUDA)
        with FlopCounterMode(display=False) if attention == "masked" else contextlib.nullcontext() as counter:
            losses = compute_losses(model, target, images, keep, targets, text, cfg, layout)
            losses.total.backward()
        parts = torch.stack([losses.total, losses.predict, losses.sparse, losses.consistency])
        return (
            parts.detach(),
            [p.grad.clone() for p in model.parameters() if p.grad is not None],
            counter.get_total_flops() if counter is not None else 0,
        )

    masked, masked_grads, masked_flops = run(TokenLayout(valid), None)
    packed, packed_grads, packed_flops = run(TokenLayout.of(valid), int(lengths.sum()))
    torch.testing.assert_close(packed, masked, rtol=1e-5, atol=1e-6)
    assert len(packed_grads) == len(masked_grads)
    for a, b in zip(packed_grads, masked_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # 18 of 36 context patches and 34 of 64 words are real; the target encoder's whole images are never padded
    # (measured: 0.85 of the masked step's FLOPs without text, 0.82 with).
    assert packed_flops < 0.9 * masked_flops or attention == "jagged", (packed_flops, masked_flops)


class AttentionMasks(TorchFunctionMode):
    """Whether each `scaled_dot_product_attention` call made under it had a mask, in call order (the calls run as
    they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.masked: list[bool] = []
        self.jagged: list[bool] = []  # whether its query was a nested tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.masked.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None)
            self.jagged.append(args[0].is_nested)
        return func(*args, **kwargs)


@pytest.mark.parametrize(("padded", "attention"), [(False, "masked"), (True, "masked"), (True, "jagged")])
def test_only_attention_over_padding_takes_a_mask_so_the_rest_may_run_on_the_flash_kernel(padded, attention):
    """Issue 32 point 3: SDPA's flash kernel takes no mask. The target encoder reads whole images, so none of its
    attentions gets one; the context encoder's and the predictor's get one only when the contexts come with a layout
    (padded; the trainer gives one in `pad` mode, where contexts are padded to a multiple of 8 and so mostly are,
    and none in `cut` mode), and then not with `attention: jagged`, where each row attends as its real tokens alone
    (nested jagged tensors: flash's variable-length kernel on CUDA). Without text: the captions' cross-attention
    always takes their words' mask."""
    torch.manual_seed(0)
    cfg = replace(STEP_CONFIG, conditioning="none")
    model, target = build_models(ModelConfig.of(cfg), text_dim=None)
    use_attention(model, attention)
    g = torch.Generator().manual_seed(2)
    images = torch.randn(4, 3, 64, 64, generator=g)
    keep, valid = _contexts(g, 64)  # 9 distinct patches each, all real without a layout
    layout = TokenLayout.of(valid) if padded else None
    targets = torch.stack([torch.randperm(64, generator=g)[:4].view(2, 2) for _ in range(4)])
    with AttentionMasks() as calls:
        compute_losses(model, target, images, keep, targets, None, cfg, layout)
    encoder, predictor = len(target.blocks), len(model.predictor.blocks)
    masked = padded and attention == "masked"
    assert calls.masked == [False] * encoder + [masked] * (encoder + predictor)  # target encoder first
    assert calls.jagged == [False] * encoder + [padded and not masked] * (encoder + predictor)


def test_the_trainer_s_attention_setting_reaches_the_context_encoder_and_predictor_and_what_cannot_run_is_refused():
    """`wrap_models` (what the trainer runs the models through) sets `attention: jagged` on every self-attention of
    the context encoder and the predictor, never on the target encoder, which sees whole images. Refused in one
    line: compiled off CUDA (SDPA's nested path there is its math kernel, which torch.compile cannot trace), and with
    activation checkpointing (its recomputed nested rows fail checkpointing's comparison with the first pass's)."""
    cfg = replace(STEP_CONFIG, conditioning="none", attention="jagged")
    model, target = build_models(ModelConfig.of(cfg), text_dim=None)
    assert wrap_models(model, target, cfg, torch.device("cpu")) is model
    assert [block.attn.jagged for block in (*model.encoder.blocks, *model.predictor.blocks)] == [True] * (
        len(model.encoder.blocks) + len(model.predictor.blocks)
    )
    assert not any(block.attn.jagged for block in target.blocks)
    for change, message in (
        ({"compile": True}, "attention jagged cannot be compiled off CUDA"),
        ({"checkpoint_activations": True}, "attention jagged cannot be combined with checkpoint_activations"),
    ):
        with pytest.raises(UserError, match=message) as caught:
            wrap_models(model, target, replace(cfg, **change), torch.device("cpu"))
        assert "\n" not in str(caught.value)
