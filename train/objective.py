"""One batch's objective: L = L_predict + λ·L_sparse + β·L_consistency, and each micro-batch's share of it.

The loss functions themselves are `train.losses`'s; this module runs the target encoder, the JEPA and those functions
on a batch with the run's settings (its loss, its regulariser weights and cosine).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from train.config import TrainConfig, resolved_predictor_heads
from train.losses import prediction_loss, target_features, text_regularisers
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
