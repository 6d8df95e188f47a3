"""The TC-JEPA objective: L = L_predict + λ/N Σ_n L_sparse^n + β/N Σ_n L_consistency^n.

With O_i^l = max(cos(q_l(i), K_l), 0) over caption n's valid words (layer l, token i):
    L_sparse^n      = 1/|I| Σ_i 1/L Σ_l ||O_i^l||_1
    L_consistency^n = 1/|I| Σ_i 1/L Σ_l ||O_i^l − Ō_i||_1,   Ō_i = 1/L Σ_l O_i^l
I is every token the predictor conditions (context and target positions of every
predictor sequence). The average over n runs over the captions an image has
(images with fewer than N captions are not diluted), then over images with any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.choices import LOSSES


def target_features(features: torch.Tensor, target_idx: torch.Tensor) -> torch.Tensor:
    """Layer-normed (no affine) target-encoder outputs `[B, P, D]` gathered at `target_idx` `[B, M, Lt]`."""
    normed = F.layer_norm(features, features.shape[-1:])
    b, m, lt = target_idx.shape
    flat = target_idx.reshape(b, m * lt, 1).expand(-1, -1, normed.shape[-1])
    return torch.gather(normed, 1, flat).view(b, m, lt, -1)


def prediction_loss(prediction: torch.Tensor, target: torch.Tensor, kind: str = "norm") -> torch.Tensor:
    """The distance between predicted and target features `[..., D]`, averaged over target patches.

    `norm`: mean over patches of the unsquared L2 norm ‖ẑ − sg(z)‖₂ (the paper's equation); `mse`: mean of the
    element-wise squared error, ‖·‖²/D per patch; `smooth_l1`: element-wise smooth-L1 with β = 1 (I-JEPA's code).
    """
    prediction, target = prediction.float(), target.float()
    if kind == "norm":
        return torch.linalg.vector_norm(prediction - target, dim=-1).mean()
    if kind == "mse":
        return F.mse_loss(prediction, target)
    if kind == "smooth_l1":
        return F.smooth_l1_loss(prediction, target, beta=1.0)
    raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {kind!r}")


@dataclass
class TextRegularisers:
    sparse: torch.Tensor  # scalar: 1/N Σ_n L_sparse^n
    consistency: torch.Tensor  # scalar: 1/N Σ_n L_consistency^n
    positive_fraction: torch.Tensor  # [L]: share of valid patch–word cosines > 0 per layer (0 = regulariser dead)


def text_regularisers(
    cosines: list[torch.Tensor], word_mask: torch.Tensor, valid: torch.Tensor, token_valid: torch.Tensor | None = None
) -> TextRegularisers:
    """Sparsity and cross-layer consistency of rectified patch–word cosines.

    `cosines`: per layer `[B, I, N, S]`; `word_mask` `[B, N, S]`; `valid` `[B, N]`; `token_valid` `[B, I]` marks
    real tokens (None: all are; context padding is neither averaged nor counted).
    """
    stacked = torch.stack(cosines).float()  # [L, B, I, N, S], a fresh tensor: padding words are zeroed in place
    words = word_mask[None, :, None].to(stacked.dtype)
    if token_valid is not None:
        words = words * token_valid[None, :, :, None, None].to(stacked.dtype)
    rectified = stacked.mul_(words).clamp_min(0)  # = clamp_min(cosine, 0) · words, gradient included
    mean_over_layers = rectified.mean(dim=0, keepdim=True)
    sparse = rectified.sum(dim=-1).mean(dim=0)  # [B, I, N]
    consistency = (rectified - mean_over_layers).abs().sum(dim=-1).mean(dim=0)
    weights = valid.to(sparse.dtype)
    per_image = weights.sum(dim=1).clamp_min(1)
    with_text = (weights.sum(dim=1) > 0).to(sparse.dtype)
    denom = with_text.sum().clamp_min(1)

    tokens = None if token_valid is None else token_valid.to(sparse.dtype)  # [B, I]

    def average(per_token: torch.Tensor) -> torch.Tensor:
        if tokens is None:
            per_caption = per_token.mean(dim=1)  # [B, N]
        else:
            per_caption = (per_token * tokens[..., None]).sum(dim=1) / tokens.sum(dim=1, keepdim=True).clamp_min(1)
        return ((per_caption * weights).sum(dim=1) / per_image * with_text).sum() / denom

    with torch.no_grad():  # counted in integers on a bool mask (`stacked` is zero on padding words)
        per_layer = stacked[0].numel()
        positive = (
            (stacked > 0)
            .view(len(cosines), per_layer)
            .sum(dim=1, dtype=torch.int32 if per_layer < 2**31 else torch.int64)
        )
        if token_valid is None:  # valid words × tokens, the same in every layer
            counted = word_mask.sum() * stacked.shape[2]
        else:
            counted = (word_mask.flatten(1).sum(dim=1) * token_valid.sum(dim=1)).sum()
        positive_fraction = positive.to(stacked.dtype) / counted.clamp_min(1).to(stacked.dtype)
    return TextRegularisers(average(sparse), average(consistency), positive_fraction)
