"""TC-JEPA assembled: the trainable part (context encoder + predictor), the EMA target, one step's losses.

`JEPA` is what DDP wraps; the target encoder stays outside it (an EMA copy that
gets no gradient and is never wrapped, unlike in the reference code).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from train.choices import VIT_SIZES
from train.config import TrainConfig
from train.losses import prediction_loss, target_features, text_regularisers
from train.predictor import Predictor, PredictorOutput, TextBatch
from train.vit import VisionTransformer, build_vit


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
        heads=cfg.predictor_heads or encoder.heads,
        conditioning=cfg.conditioning,
        text_dim=text_dim if cfg.conditioning != "none" else None,
        pool=cfg.pool,
    )
    target = copy.deepcopy(encoder)
    target.requires_grad_(False)
    return JEPA(encoder, predictor), target


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, momentum: float) -> None:
    """target ← m·target + (1 − m)·online, parameter by parameter."""
    t_params = list(target.parameters())
    o_params = [p.detach() for p in online.parameters()]
    torch._foreach_lerp_(t_params, o_params, 1.0 - momentum)


def is_text_parameter(name: str) -> bool:
    """The conditioner's own parameters (cross-attention, its norm, the sequence-mode text projection)."""
    return (
        ".cross." in name or ".norm_cross." in name or name.startswith(("predictor.text_embed", "predictor.text_type"))
    )


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


@dataclass
class StepLosses:
    total: torch.Tensor
    predict: torch.Tensor
    sparse: torch.Tensor
    consistency: torch.Tensor
    positive_fraction: torch.Tensor | None  # [L] in cross mode


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
    regs = text_regularisers(out.queries, out.keys, text.word_mask, text.valid, out.token_valid)
    total = predict + cfg.lambda_sparse * regs.sparse + cfg.beta_consistency * regs.consistency
    return StepLosses(total, predict, regs.sparse, regs.consistency, regs.positive_fraction)
