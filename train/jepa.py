"""TC-JEPA assembled: the trainable part (context encoder + predictor) and the EMA target encoder, built from the
model section of a run's config (`ModelConfig`).

`JEPA` is what DDP wraps; the target encoder stays outside it (an EMA copy that
gets no gradient and is never wrapped, unlike in the reference code).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.profiler import record_function

from train.choices import VIT_SIZES
from train.config import ModelConfig
from train.packing import TokenLayout
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
        context_layout: TokenLayout | None = None,
    ) -> PredictorOutput:
        """`context_layout`: where the real context patches are when contexts are padded to one length (packed: the
        encoder and predictor run on them alone)."""
        with record_function("context_encoder"):  # the labels a profile splits the step by (gpu_check's)
            context = self.encoder(images, keep=context_idx, layout=context_layout)
        with record_function("predictor"):
            out = self.predictor(context, context_idx, target_idx, text, context_layout)
        out.context = context
        return out


def build_models(model: ModelConfig, text_dim: int | None) -> tuple[JEPA, VisionTransformer]:
    """The trainable JEPA and its target encoder (a frozen copy of the context encoder). `text_dim`: the caption
    vectors' width (the store's), for a predictor that reads them."""
    encoder = build_vit(model.model, model.image_size, model.patch_size, model.width, model.depth, model.heads)
    predictor = Predictor(
        encoder_width=encoder.width,
        grid=encoder.grid,
        width=model.predictor_width,
        depth=model.predictor_depth or VIT_SIZES[model.model].predictor_depth,
        heads=model.resolved_predictor_heads,
        conditioning=model.conditioning,
        text_dim=text_dim if model.conditioning != "none" else None,
        pool=model.pool,
        conditioner=model.conditioner,
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
