"""TC-JEPA assembled: the trainable part (context encoder + predictor), the EMA target, one step's losses.

`JEPA` is what DDP wraps; the target encoder stays outside it (an EMA copy that
gets no gradient and is never wrapped, unlike in the reference code).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from train.choices import VIT_SIZES
from train.config import TrainConfig, resolved_predictor_heads
from train.losses import prediction_loss, target_features, text_regularisers
from train.predictor import Predictor, PredictorOutput, TextBatch
from train.vit import VisionTransformer, build_vit

# DDP finds the tensors of a forward's output by pytree flattening (with `static_graph` it hangs its delayed gradient
# all-reduce on them): registered, the predictor's dataclass output is seen into instead of taken as one opaque leaf.
torch.export.register_dataclass(PredictorOutput)


class JEPA(nn.Module):
    def __init__(self, encoder: VisionTransformer, predictor: Predictor) -> None:
        super().__init__()
        self.encoder = encoder
        self.predictor = predictor

    def forward(
        self,
        images: torch.Tensor,
        context_idx: torch.Tensor,
        target_idx: torch.Tensor,
        text: TextBatch | None,
        context_valid: torch.Tensor | None = None,
    ) -> PredictorOutput:
        context = self.encoder(images, keep=context_idx, keep_valid=context_valid)
        return self.predictor(context, context_idx, target_idx, text, context_valid)


def build_models(cfg: TrainConfig, text_dim: int | None) -> tuple[JEPA, VisionTransformer]:
    """The trainable JEPA and its target encoder (a frozen copy of the context encoder)."""
    encoder = build_vit(cfg.model, cfg.image_size, cfg.patch_size, cfg.width, cfg.depth, cfg.heads)
    size = VIT_SIZES[cfg.model]
    predictor = Predictor(
        encoder_width=encoder.width,
        grid=encoder.grid,
        width=cfg.predictor_width,
        depth=cfg.predictor_depth or size.predictor_depth,
        heads=resolved_predictor_heads(cfg),
        conditioning=cfg.conditioning,
        text_dim=text_dim if cfg.conditioning != "none" else None,
        pool=cfg.pool,
        conditioner=cfg.conditioner,
    )
    target = copy.deepcopy(encoder)
    target.requires_grad_(False)
    return JEPA(encoder, predictor), target


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """target ← m·target + (1 − m)·online, parameter by parameter."""
    t_params: list[torch.Tensor] = list(target.parameters())
    o_params = [p.detach() for p in online.parameters()]
    torch._foreach_lerp_(t_params, o_params, 1.0 - momentum)


def is_text_parameter(name: str) -> bool:
    """The conditioner's own parameters (cross-attention, its norm, the sequence-mode text projection)."""
    return (
        ".cross." in name or ".norm_cross." in name or name.startswith(("predictor.text_embed", "predictor.text_type"))
    )


def apply_schedules(group: dict, lr: float, weight_decay: float) -> None:
    """Set one AdamW group's learning rate and weight decay for a step.

    AdamW's decay shrinks a weight by lr · weight_decay per step, so a group whose learning rate is scaled
    (`lr_scale`, the text conditioner's) gets weight_decay / lr_scale: its decay per step stays that of every
    other weight, only its gradient steps grow.
    """
    group["lr"] = lr * group["lr_scale"]
    group["weight_decay"] = weight_decay / group["lr_scale"] if group["decay"] else 0.0


def param_groups(model: JEPA, text_lr_scale: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and 1-D parameters; the text conditioner's LR scaled."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim > 1
        groups.setdefault((decay, is_text_parameter(name)), []).append(p)
    return [
        {"params": params, "decay": decay, "lr_scale": text_lr_scale if text else 1.0}
        for (decay, text), params in sorted(groups.items())
    ]


def _mark_lengths_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` (a block's forward) called with its batch and sequence dims marked dynamic.

    Blocks are called as `block(x [B, L, d], key_mask [B, L] | None, *rest)`; a `TextBatch` in `rest` has a dynamic
    batch dim only (N is fixed and words are padded to max_words). Duck sizing is off so that two dims that happen to
    be equal when a graph is traced (B·M = L on some step) are not assumed equal forever, which would recompile.
    """
    from torch._dynamo import maybe_mark_dynamic
    from torch.fx.experimental import _config as shape_config

    def forward(x: torch.Tensor, key_mask: torch.Tensor | None = None, *rest: Any) -> Any:
        for tensor in (x, key_mask):
            if tensor is not None:
                maybe_mark_dynamic(tensor, 0)
                maybe_mark_dynamic(tensor, 1)
        for arg in rest:
            if isinstance(arg, TextBatch):
                maybe_mark_dynamic(arg.tokens, 0)
                maybe_mark_dynamic(arg.lengths, 0)
        with shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # set by install_config_module
            return compiled(x, key_mask, *rest)

    return forward


def compile_blocks(*stacks: nn.ModuleList) -> None:
    """torch.compile each block's forward (a whole graph, no break allowed), one graph shared by all blocks alike.

    Shapes: the batch and sequence lengths are marked dynamic rather than padded to a few bucket sizes. Context and
    target lengths change every step (block sizes are drawn per step, contexts are padded only to the batch's
    longest) and the validation batch has its own size: buckets would compile one graph per (context bucket,
    target size, batch size) and pad every step to its bucket, while marked dims compile one graph per block type and
    grad mode for the whole run. The price is CUDA graphs, which need static shapes; at ViT-B/16 and batches of 64+
    per GPU the kernels are long enough that launch overhead is small.

    Only `forward` is compiled: module hooks (DDP, FSDP's all-gathers, activation checkpointing) stay outside the
    graph, and the state-dict keys do not change.
    """
    for blocks in stacks:
        for block in blocks:
            block.forward = _mark_lengths_dynamic(torch.compile(block.forward, fullgraph=True))


def checkpoint_blocks(*stacks: nn.ModuleList) -> None:
    """Recompute each block's activations in the backward (torch.utils.checkpoint, non-reentrant) instead of keeping
    them. The blocks are wrapped in place; state-dict keys stay those of the unwrapped model (the wrapper strips its
    prefix on save and restores it on load)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for blocks in stacks:
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


@dataclass
class StepLosses:
    total: torch.Tensor
    predict: torch.Tensor
    sparse: torch.Tensor
    consistency: torch.Tensor
    positive_fraction: torch.Tensor | None  # [L] in cross mode
    cosine_pairs: torch.Tensor | None = None  # the valid patch–word pairs `positive_fraction` is a share of
    output: PredictorOutput | None = None  # cross mode: the predictor's output (validation reads its cosines)

    def weighted(self, predict: float, text: float | torch.Tensor, cfg: TrainConfig) -> StepLosses:
        """A micro-batch's share of its step's losses: the prediction loss (a mean over target patches, the same
        number per image) times its share of the images, the regularisers (means over images with captions) times its
        share of those, so the shares of a step's micro-batches add up to the whole batch's losses."""
        scaled = replace(
            self, predict=self.predict * predict, sparse=self.sparse * text, consistency=self.consistency * text
        )
        scaled.total = scaled.predict + cfg.lambda_sparse * scaled.sparse + cfg.beta_consistency * scaled.consistency
        return scaled


def compute_losses(
    model: nn.Module,
    target_encoder: VisionTransformer,
    images: torch.Tensor,
    context_idx: torch.Tensor,
    target_idx: torch.Tensor,
    text: TextBatch | None,
    cfg: TrainConfig,
    context_valid: torch.Tensor | None = None,
) -> StepLosses:
    """L = L_predict + λ·L_sparse + β·L_consistency for one batch (regularisers only in cross mode with text).

    `context_valid` bool `[B, Lc]` marks real context patches when contexts are padded to one length.
    """
    with torch.no_grad():
        targets = target_features(target_encoder(images), target_idx)
    out = model(images, context_idx, target_idx, text, context_valid)
    predict = prediction_loss(out.prediction, targets, cfg.loss)
    zero = predict.new_zeros(())
    if not out.queries or text is None:
        return StepLosses(predict, predict, zero, zero, None)
    regs = text_regularisers(
        out.queries,
        out.keys,
        text.word_mask,
        text.valid,
        out.token_valid,
        cosine=cfg.regulariser_cosine,
        heads=resolved_predictor_heads(cfg),
    )
    total = predict + cfg.lambda_sparse * regs.sparse + cfg.beta_consistency * regs.consistency
    return StepLosses(total, predict, regs.sparse, regs.consistency, regs.positive_fraction, regs.pairs, out)
