"""The text regularisers' autograd Function as it was before issue 32 point 1, kept as the reference.

A copy of `train/losses.py` at commit 11af4e7: each layer's float32 cosine map is remade by
one GEMM whenever a pass needs it (two passes forward, three backward), into buffers every
layer reuses, with ~10 elementwise passes over each. Not shipped: `tests/test_predictor.py`
checks today's Function (all layers' maps from one batched GEMM, one pass each way) against
it, and `benchmarks/regularisers.py` measures both side by side. `regularisers(...)` takes
the arguments of `train.losses.text_regularisers` for the full cosine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from train import losses
from train.losses import _Rows, _unit_backward


def _bilinear(maps: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Σ_b rows_bᵀ · maps_b · cols_b for `maps` `[B, I, J]`, `rows` `[B, I]`, `cols` `[B, J]` (one GEMV per image)."""
    return torch.bmm(maps, cols.unsqueeze(-1)).squeeze(-1).mul_(rows).sum()


class _Layer(NamedTuple):
    """One layer's operands: unit queries `[B, I, d]` (zero on padding), the keys as contiguous words `[B, J, d]`."""

    queries: torch.Tensor
    query_rows: _Rows
    words: torch.Tensor
    word_rows: _Rows

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        word_mask: torch.Tensor | None = None,
    ) -> _Layer:
        """From queries `[B, I, d]` and keys `[B, N, S, d]`; the float masks `[B, I]` and `[B, N·S]` zero padding."""
        words = k.flatten(1, 2).contiguous()  # once here, not inside every GEMM that reads it
        query_rows = _Rows.of(q, token_mask)
        units = (q.float() * query_rows.scale[..., None]).to(q.dtype)
        return cls(units, query_rows, words, _Rows.of(words, word_mask))


class _Maps:
    """Buffers for one layer's cosine map at a time, reused by every layer and pass (a fresh map-sized tensor
    costs more than the arithmetic on it on a CPU): the GEMM's output and its float32 copy."""

    def __init__(self, layer: _Layer) -> None:
        b, i = layer.queries.shape[:2]
        shape = (b, i, layer.words.shape[1])
        self.scores = torch.empty(shape, dtype=layer.queries.dtype, device=layer.queries.device)
        self.cosine_map = (
            self.scores if self.scores.dtype == torch.float32 else torch.empty_like(self.scores, dtype=torch.float32)
        )

    def cosines(self, layer: _Layer) -> torch.Tensor:
        """float32 cosines `[B, I, J]`, zero on padding (in the shared buffer: use them before the next call).

        One GEMM of the unit queries with the words, in their dtype (bf16 under autocast, like the attention scores
        the cosines once came from), whose columns are then divided by the words' norms in float32.
        """
        torch.bmm(layer.queries, layer.words.transpose(1, 2), out=self.scores)
        if self.cosine_map is not self.scores:
            self.cosine_map.copy_(self.scores)
        return self.cosine_map.mul_(layer.word_rows.scale[:, None, :])

    def rectified(self, layer: _Layer) -> torch.Tensor:
        """float32 max(cosine, 0) `[B, I, J]`, zero on padding (in the shared buffer)."""
        return self.cosines(layer).clamp_min_(0)


def _layers(queries_keys: tuple[torch.Tensor, ...], token_mask: torch.Tensor, word_mask: torch.Tensor) -> list[_Layer]:
    depth = len(queries_keys) // 2
    return [_Layer.of(q, k, token_mask, word_mask) for q, k in zip(queries_keys[:depth], queries_keys[depth:])]


class RecomputedPerLayerTerms(torch.autograd.Function):
    """Both regularisers of L layers' rectified cosines R^l = max(cos(q^l, K^l), 0), keeping no map for backward.

    With weights w = token_weight ⊗ word_weight (zero on padding, missing captions and images without text):
        sparse = 1/L Σ_l Σ w·R^l,   consistency = 1/L Σ_l Σ w·|R^l − R̄|,   R̄ = 1/L Σ_l R^l.
    Only the queries and keys are saved (the cross-attention keeps them anyway). Each layer's map is made by one
    GEMM whenever a pass needs it, into buffers every layer reuses (two passes forward, three backward: a GEMM
    costs about what one elementwise pass over the map does, and L maps at once would be L times the memory).
    Backward forms, per layer,
        H^l = [cos^l > 0]·(g_sparse + g_consistency·(sgn(R^l − R̄) − 1/L Σ_l' sgn(R^l' − R̄))),
    so that ∂/∂cos^l = w·H^l / L, and takes it to the unit queries and keys by two GEMMs (the weights folded into
    their operands and row scales), then through the normalisation. The third output, the count of valid positive
    cosines per layer, has no gradient.
    """

    @staticmethod
    def forward(ctx, token_weight, word_weight, token_mask, word_mask, *queries_keys):
        depth = len(queries_keys) // 2
        with torch.autocast(queries_keys[0].device.type, enabled=False):
            layers = _layers(queries_keys, token_mask, word_mask)
            maps = _Maps(layers[0])
            total = torch.zeros_like(maps.cosine_map)
            spread = torch.empty_like(total)
            counts = []
            for layer in layers:
                rectified = maps.rectified(layer)
                # Zero on padding, so the positive entries are the valid positive cosines.
                counts.append(torch.sign(rectified, out=spread).sum(dtype=torch.float64))
                total.add_(rectified)
            sparse = _bilinear(total, token_weight, word_weight) / depth
            mean = total.div_(depth)
            spread.zero_()
            for layer in layers:
                spread.add_(maps.rectified(layer).sub_(mean).abs_())
            consistency = _bilinear(spread, token_weight, word_weight) / depth
        positive = torch.stack(counts).float()
        ctx.save_for_backward(token_weight, word_weight, token_mask, word_mask, *queries_keys)
        ctx.mark_non_differentiable(positive)
        return sparse, consistency, positive

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sparse, grad_consistency, _grad_positive):
        token_weight, word_weight, token_mask, word_mask, *queries_keys = ctx.saved_tensors
        depth = len(queries_keys) // 2
        with torch.autocast(queries_keys[0].device.type, enabled=False):
            layers = _layers(queries_keys, token_mask, word_mask)
            maps = _Maps(layers[0])
            mean = torch.zeros_like(maps.cosine_map)
            for layer in layers:
                mean.add_(maps.rectified(layer))
            mean.div_(depth)
            base = torch.zeros_like(mean)
            for layer in layers:
                base.add_(maps.rectified(layer).sub_(mean).sign_())
            base.mul_(-grad_consistency / depth).add_(grad_sparse)  # g_s − g_c · (mean of the signs)
            positive = torch.empty_like(mean)
            slope = maps.scores  # H^l in the GEMM's dtype (its buffer is free once the map is made)
            token_scale, word_scale = token_weight / depth, word_weight / depth
            grads_q, grads_k = [], []
            for layer, q, k in zip(layers, queries_keys[:depth], queries_keys[depth:]):
                rectified = maps.rectified(layer)
                torch.sign(rectified, out=positive)  # 1 where the cosine is positive (and not padding), else 0
                rectified.sub_(mean).sign_().mul_(grad_consistency).add_(base).mul_(positive)
                if slope is not rectified:
                    slope.copy_(rectified)
                # ∂/∂q̂_i = u_i Σ_j H_ij v_j k̂_j / L and ∂/∂k̂_j = v_j Σ_i H_ij u_i q̂_i / L, with k̂_j = k_j·scale_j.
                scaled_words = layer.words * (word_scale * layer.word_rows.scale).to(layer.words.dtype)[..., None]
                scaled_queries = layer.queries * token_scale.to(layer.queries.dtype)[..., None]
                grad_q_unit = torch.bmm(slope, scaled_words)
                grad_k_unit = torch.bmm(slope.transpose(1, 2), scaled_queries)
                grads_q.append(_unit_backward(grad_q_unit, q, layer.query_rows, token_weight))
                grads_k.append(_unit_backward(grad_k_unit, layer.words, layer.word_rows, word_weight).view(k.shape))
        return None, None, None, None, *grads_q, *grads_k


def regularisers(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    word_mask: torch.Tensor,
    valid: torch.Tensor,
    token_valid: torch.Tensor | None = None,
) -> losses.TextRegularisers:
    """`train.losses.text_regularisers` (full cosine), computed by the Function above."""
    weights = losses.RegulariserWeights.of(word_mask, valid, token_valid, queries[0].shape[1])
    sparse, consistency, positive = RecomputedPerLayerTerms.apply(*weights.arguments(), *queries, *keys)
    return losses.TextRegularisers(sparse, consistency, positive / weights.pairs.clamp_min(1), weights.pairs)
