"""The text cross-attention and regularisers as they were before issue 17 B, kept as the reference.

Copies of the code at commit c1e6ec3: the cross-attention materialises float32
probabilities `[B, h, Q, N·S]` and returns a float32 cosine map `[B, Q, N, S]` per
layer, and the regularisers stack the maps. Not shipped: `tests/test_predictor.py`
checks the lean predictor's outputs and gradients against it, and
`benchmarks/train_step.py` runs it side by side (its `*_ref` modes).

`ReferencePredictor` is the lean `Predictor` with these blocks and forward; its
state dict is in the old layout (per-layer `blocks.L.cross.k` / `.v`), which the
lean predictor loads (it fuses them), so both can hold the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from train.config import TrainConfig
from train.losses import TextRegularisers, prediction_loss, target_features
from train.objective import StepLosses
from train.packing import TokenLayout
from train.predictor import Predictor, PredictorBlock, TextBatch, residual_max
from train.vit import init_weights, scale_residual_outputs


class ReferenceCrossAttention(nn.Module):
    """Multi-head attention from image tokens to each caption's words, one softmax per caption."""

    def __init__(self, dim: int, text_dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(text_dim, dim)
        self.v = nn.Linear(text_dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, text: TextBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[B, Q, d]` (normed) → per-caption outputs `[B, N, Q, d]` and cosines `[B, Q, N, S]`."""
        b, nq, d = x.shape
        n, s = text.tokens.shape[1:3]
        h, dh = self.heads, d // self.heads
        q_full = self.q(x)
        k_full = self.k(text.tokens).reshape(b, n * s, d)
        q = q_full.view(b, nq, h, dh).transpose(1, 2)
        k = k_full.view(b, n * s, h, dh).transpose(1, 2)
        v = self.v(text.tokens).view(b, n, s, h, dh).permute(0, 3, 1, 2, 4)
        raw = q @ k.transpose(-1, -2)  # [B, h, Q, N*S]
        attend = text.word_mask | ~text.valid[..., None]
        bias = torch.zeros(b, 1, 1, n * s, dtype=raw.dtype, device=raw.device)
        bias.masked_fill_(~attend.view(b, 1, 1, n * s), float("-inf"))
        logits = torch.add(bias, raw, alpha=dh**-0.5)
        probs = logits.view(b, h, nq, n, s).softmax(dim=-1)
        out = probs.transpose(2, 3) @ v  # [B, h, N, Q, dh]
        out = self.proj(out.permute(0, 2, 3, 1, 4).reshape(b, n, nq, d))
        norms = q_full.float().norm(dim=-1)[:, :, None] * k_full.float().norm(dim=-1)[:, None, :]
        cosine = raw.sum(dim=1, dtype=torch.float32) / norms.clamp_min(1e-6)
        return out, cosine.view(b, nq, n, s)


class ReferenceBlock(PredictorBlock):
    """The predictor block with the reference cross-attention (the pool over captions is unchanged)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, text_dim: int, pool: str) -> None:
        super().__init__(dim, heads, mlp_ratio, cross=True, pool=pool)
        self.cross = ReferenceCrossAttention(dim, text_dim, heads)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None, text: TextBatch | None, blocks_per_image: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.norm1(x), None if key_mask is None else TokenLayout(key_mask))
        if text is None:
            return x + self.mlp(self.norm2(x)), None
        p, t, d = x.shape
        per_image = x.reshape(p // blocks_per_image, blocks_per_image * t, d)
        out, cosine = self.cross(self.norm_cross(per_image), text)
        return self.pool_rows(per_image, out, text.valid).reshape(p, t, d), cosine

    def pool_rows(self, per_image: torch.Tensor, out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Max over the present captions of `per_image` `[B, M*T, d]` + each caption's update `out` `[B, N, M*T, d]`
        (and its MLP: after_mlp), or of the residual sums before one shared MLP (before_mlp): the pool on padded rows,
        as it was."""
        out = out * valid[:, :, None, None].to(out.dtype)
        pool_keep = valid.clone()
        pool_keep[:, 0] |= ~valid.any(dim=1)
        if self.pool == "after_mlp":
            conditioned = out.to(torch.promote_types(out.dtype, per_image.dtype), copy=True).add_(per_image[:, None])
            return residual_max(conditioned, self.mlp(self.norm2(conditioned)), pool_keep)
        pooled = residual_max(per_image[:, None], out, pool_keep)
        return pooled + self.mlp(self.norm2(pooled))


@dataclass
class ReferenceOutput:
    prediction: torch.Tensor  # [B, M, Lt, encoder width]
    cosines: list[torch.Tensor]  # per layer, patch–word cosine [B, M*T, N, S]
    token_valid: torch.Tensor | None = None  # bool [B, M*T]


class ReferencePredictor(Predictor):
    """The cross-mode predictor as it was: per-layer K/V projections, materialised attention and cosine maps."""

    def __init__(self, encoder_width: int, grid: tuple[int, int], width: int, depth: int, heads: int, **kwargs) -> None:
        super().__init__(encoder_width, grid, width, depth, heads, conditioning="cross", conditioner="mha", **kwargs)
        mlp_ratio = self.blocks[0].mlp.fc1.out_features / width
        text_dim = self.cross.kv.in_features
        pool = self.blocks[0].pool
        self.cross = None
        self.blocks = nn.ModuleList(ReferenceBlock(width, heads, mlp_ratio, text_dim, pool) for _ in range(depth))
        init_weights(self.blocks)
        scale_residual_outputs(self.blocks)

    @classmethod
    def like(cls, lean: Predictor, grid: tuple[int, int]) -> ReferencePredictor:
        """The reference with the lean predictor's shape and weights."""
        reference = cls(
            encoder_width=lean.proj.out_features,
            grid=grid,
            width=lean.embed.out_features,
            depth=len(lean.blocks),
            heads=lean.blocks[0].attn.heads,
            mlp_ratio=lean.blocks[0].mlp.fc1.out_features / lean.embed.out_features,
            text_dim=lean.cross.kv.in_features,
            pool=lean.blocks[0].pool,
        )
        reference.load_state_dict(split_text_keys_values(lean.state_dict(), len(lean.blocks)))
        return reference.to(lean.proj.weight.device)

    def forward(
        self,
        context: torch.Tensor,
        context_idx: torch.Tensor,
        target_idx: torch.Tensor,
        text: TextBatch | None = None,
        context_layout: TokenLayout | None = None,
    ) -> ReferenceOutput:
        """The predictor on padded rows throughout (`context_layout`'s key mask alone is read)."""
        b, m, lt = target_idx.shape
        lc = context_idx.shape[1]
        context_valid = None if context_layout is None else context_layout.key_mask
        x, token_valid = self.sequences(context, context_idx, target_idx, context_valid)
        cosines = []
        for block in self.blocks:
            x, cosine = block(x, token_valid, text, m)
            if cosine is not None:
                cosines.append(cosine)
        out = self.proj(self.norm(x[:, lc : lc + lt]))
        per_image_valid = None if token_valid is None else token_valid.reshape(b, m * (lc + lt))
        return ReferenceOutput(out.view(b, m, lt, -1), cosines, per_image_valid)


def split_text_keys_values(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """A lean predictor's state dict in the old layout: the fused `cross.kv` split into per-layer `k` and `v`."""
    state = dict(state)
    for kind in ("weight", "bias"):
        parts = state.pop(f"cross.kv.{kind}").chunk(2 * depth)
        for layer in range(depth):
            state[f"blocks.{layer}.cross.k.{kind}"] = parts[2 * layer]
            state[f"blocks.{layer}.cross.v.{kind}"] = parts[2 * layer + 1]
    return state


def text_regularisers(
    cosines: list[torch.Tensor], word_mask: torch.Tensor, valid: torch.Tensor, token_valid: torch.Tensor | None = None
) -> TextRegularisers:
    """Sparsity and cross-layer consistency of rectified patch–word cosines, from the stacked maps."""
    stacked = torch.stack(cosines).float()  # [L, B, I, N, S]
    words = word_mask[None, :, None].to(stacked.dtype)
    if token_valid is not None:
        words = words * token_valid[None, :, :, None, None].to(stacked.dtype)
    rectified = stacked.mul_(words).clamp_min(0)
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

    with torch.no_grad():
        per_layer = stacked[0].numel()
        positive = (
            (stacked > 0)
            .view(len(cosines), per_layer)
            .sum(dim=1, dtype=torch.int32 if per_layer < 2**31 else torch.int64)
        )
        if token_valid is None:
            counted = word_mask.sum() * stacked.shape[2]
        else:
            counted = (word_mask.flatten(1).sum(dim=1) * token_valid.sum(dim=1)).sum()
        positive_fraction = positive.to(stacked.dtype) / counted.clamp_min(1).to(stacked.dtype)
    return TextRegularisers(average(sparse), average(consistency), positive_fraction, counted)


def compute_losses(
    model: nn.Module,
    target_encoder: nn.Module,
    images: torch.Tensor,
    context_idx: torch.Tensor,
    target_idx: torch.Tensor,
    text: TextBatch | None,
    cfg: TrainConfig,
    context_layout: TokenLayout | None = None,
) -> StepLosses:
    """`train.objective.compute_losses` with the reference regularisers (the model's predictor a
    `ReferencePredictor`)."""
    with torch.no_grad():
        targets = target_features(target_encoder(images), target_idx)
    out = model(images, context_idx, target_idx, text, context_layout)
    predict = prediction_loss(out.prediction, targets, cfg.loss)
    zero = predict.new_zeros(())
    if not out.cosines or text is None:
        return StepLosses(predict, predict, zero, zero, None)
    regs = text_regularisers(out.cosines, text.word_mask, text.valid, out.token_valid)
    total = predict + cfg.lambda_sparse * regs.sparse + cfg.beta_consistency * regs.consistency
    return StepLosses(total, predict, regs.sparse, regs.consistency, regs.positive_fraction)
