"""One batch's objective: L = L_predict + λ·L_sparse + β·L_consistency (+ an optional anti-collapse term, LeJEPA's
SIGReg on the context encoder's tokens, off by default), and each micro-batch's share of it.

The loss functions themselves are `train.losses`'s; this module runs the target encoder, the JEPA and those functions
on a batch with the run's settings (its loss, its regulariser weights and cosine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.profiler import record_function

from train.config import TrainConfig, resolved_predictor_heads
from train.losses import (
    EAGER_PASSES,
    RegulariserPasses,
    prediction_loss,
    sigreg,
    target_features,
    text_regularisers,
)
from train.packing import TokenLayout
from train.predictor import PredictorOutput, TextBatch
from train.vit import VisionTransformer


@dataclass
class StepLosses:
    total: torch.Tensor
    predict: torch.Tensor
    sparse: torch.Tensor
    consistency: torch.Tensor
    positive_fraction: torch.Tensor | None  # [L] in cross mode
    cosine_pairs: torch.Tensor | None = None  # the valid patch–word pairs `positive_fraction` is a share of
    output: PredictorOutput | None = None  # cross mode: the predictor's output (validation reads its cosines)
    sigreg: torch.Tensor | None = None  # SIGReg of the context tokens (with `sigreg` > 0 and directions)

    def weighted(self, predict: float, text: float | torch.Tensor, cfg: TrainConfig) -> StepLosses:
        """A micro-batch's share of its step's losses: the prediction loss (a mean over target patches, the same
        number per image) and SIGReg times its share of the images, the regularisers (means over images with
        captions) times its share of those, so the shares of a step's micro-batches add up to the whole batch's."""
        sig = None if self.sigreg is None else self.sigreg * predict
        scaled = replace(
            self,
            predict=self.predict * predict,
            sparse=self.sparse * text,
            consistency=self.consistency * text,
            sigreg=sig,
        )
        scaled.total = scaled.predict + cfg.lambda_sparse * scaled.sparse + cfg.beta_consistency * scaled.consistency
        if sig is not None:
            scaled.total = scaled.total + cfg.sigreg * sig
        return scaled


def compute_losses(
    model: nn.Module,
    target_encoder: VisionTransformer,
    images: torch.Tensor,
    context_idx: torch.Tensor,
    target_idx: torch.Tensor,
    text: TextBatch | None,
    cfg: TrainConfig,
    context_layout: TokenLayout | None = None,
    sigreg_directions: torch.Tensor | None = None,
    regulariser_passes: RegulariserPasses = EAGER_PASSES,
) -> StepLosses:
    """L = L_predict + λ·L_sparse + β·L_consistency for one batch (regularisers only in cross mode with text), plus
    `cfg.sigreg` × SIGReg of the context encoder's real tokens when `sigreg_directions` `[D, K]` are given.

    `context_layout` marks real context patches when contexts are padded to one length (packed: only they are
    computed).
    """
    with torch.no_grad(), record_function("target_encoder"):
        targets = target_features(target_encoder(images), target_idx)
    out = model(images, context_idx, target_idx, text, context_layout)
    predict = prediction_loss(out.prediction, targets, cfg.loss)
    zero = predict.new_zeros(())
    anti_collapse = None
    if sigreg_directions is not None and cfg.sigreg > 0 and out.context is not None:
        tokens = out.context
        if context_layout is not None:  # the real tokens alone (packed: without waiting for the device to count them)
            tokens = context_layout.pack(tokens) if context_layout.packed else tokens[context_layout.key_mask]
        anti_collapse = sigreg(tokens.reshape(-1, tokens.shape[-1]), sigreg_directions)
    extra = zero if anti_collapse is None else cfg.sigreg * anti_collapse
    if not out.queries or text is None:
        return StepLosses(predict + extra, predict, zero, zero, None, sigreg=anti_collapse)
    with record_function("regularisers"):
        regs = text_regularisers(
            out.queries,
            out.keys,
            text.word_mask,
            text.valid,
            out.token_valid,
            cosine=cfg.regulariser_cosine,
            heads=resolved_predictor_heads(cfg),
            passes=regulariser_passes,
            image_words=text.image_words,
        )
    total = predict + cfg.lambda_sparse * regs.sparse + cfg.beta_consistency * regs.consistency + extra
    return StepLosses(
        total, predict, regs.sparse, regs.consistency, regs.positive_fraction, regs.pairs, out, anti_collapse
    )
