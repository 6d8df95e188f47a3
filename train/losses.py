"""The TC-JEPA objective: L = L_predict + λ/N Σ_n L_sparse^n + β/N Σ_n L_consistency^n.

With O_i^l = max(cos(q_l(i), K_l), 0) over caption n's valid words (layer l, token i):
    L_sparse^n      = 1/|I| Σ_i 1/L Σ_l ||O_i^l||_1
    L_consistency^n = 1/|I| Σ_i 1/L Σ_l ||O_i^l − Ō_i||_1,   Ō_i = 1/L Σ_l O_i^l
I is every token the predictor conditions (context and target positions of every
predictor sequence). The average over n runs over the captions an image has
(images with fewer than N captions are not diluted), then over images with any.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from train.choices import LOSSES, REGULARISER_COSINES
from train.dynamic_shapes import mark_dynamic, without_duck_sizing


def gather_positions(features: torch.Tensor, target_idx: torch.Tensor) -> torch.Tensor:
    """`[B, M, Lt, D]`: features `[B, P, D]` at the positions `target_idx` `[B, M, Lt]`."""
    b, m, lt = target_idx.shape
    flat = target_idx.reshape(b, m * lt, 1).expand(-1, -1, features.shape[-1])
    return torch.gather(features, 1, flat).view(b, m, lt, -1)


def target_features(features: torch.Tensor, target_idx: torch.Tensor) -> torch.Tensor:
    """Layer-normed (no affine) target-encoder outputs `[B, P, D]` gathered at `target_idx` `[B, M, Lt]`."""
    return gather_positions(F.layer_norm(features, features.shape[-1:]), target_idx)


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
    pairs: torch.Tensor  # scalar: the valid patch–word pairs that share is of (to pool it over several batches)


UNIT_EPS = 1e-6  # a vector shorter than this is divided by it, not by its norm (zero stays zero, no NaN)


class _Rows(NamedTuple):
    """Per-row float32 factors of x's unit vectors û = x·scale, padding zeroed."""

    scale: torch.Tensor  # 1 / max(‖x‖, eps) on real rows, 0 on padding
    radial: torch.Tensor  # scale² where ‖x‖ > eps (û a true unit vector, whose gradient loses its radial part), else 0

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor | None = None) -> _Rows:
        norms = torch.linalg.vector_norm(x, dim=-1).float()  # accumulated in float32, rounded to x's dtype
        scale = norms.clamp_min(UNIT_EPS).reciprocal()
        if mask is not None:
            scale = scale * mask
        return cls(scale, scale.square() * (norms > UNIT_EPS))

    def units(self, x: torch.Tensor) -> torch.Tensor:
        """û in x's dtype (zero on padding)."""
        return (x.float() * self.scale[..., None]).to(x.dtype)


def patch_word_cosine(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float32 cosines `[B, I, N·S]` of queries `[B, I, d]` and caption word keys `[B, N, S, d]`, full vectors."""
    words = keys.flatten(1, 2)
    return torch.bmm(_Rows.of(queries).units(queries), _Rows.of(words).units(words).transpose(1, 2)).float()


def _unit_backward(grad: torch.Tensor, x: torch.Tensor, rows: _Rows, weight: torch.Tensor) -> torch.Tensor:
    """The gradient at `x` from `weight`·`grad` (per row) at its unit vector û = x·scale: scale·(g − û(û·g)).

    In x's dtype, the row coefficients in float32.
    """
    radial = (x * grad).sum(dim=-1).float().mul_(rows.radial)
    along = (weight * rows.scale).to(x.dtype)[..., None]
    back = (-weight * rows.scale * radial).to(x.dtype)[..., None]
    return torch.addcmul(grad * along, x, back)


class _UnitLayer(NamedTuple):
    """One layer's operands: queries `[b, I, d]` and words `[b, J, d]`, their row factors and unit vectors (zero on
    padding)."""

    queries: torch.Tensor
    query_rows: _Rows
    unit_queries: torch.Tensor
    words: torch.Tensor
    word_rows: _Rows
    unit_words: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, words: torch.Tensor, token_mask: torch.Tensor, word_mask: torch.Tensor) -> _UnitLayer:
        query_rows, word_rows = _Rows.of(q, token_mask), _Rows.of(words, word_mask)
        return cls(q, query_rows, query_rows.units(q), words, word_rows, word_rows.units(words))


def _rectified_maps(layers: list[_UnitLayer]) -> list[torch.Tensor]:
    """Per layer, float32 max(cos, 0) `[b, I, J]` from one GEMM of the unit vectors in their dtype (bf16 under
    autocast, like the attention scores the cosines once came from); zero on padding."""
    return [torch.bmm(layer.unit_queries, layer.unit_words.transpose(1, 2)).float().relu_() for layer in layers]


def _bilinear(maps: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Σ_b rows_bᵀ · maps_b · cols_b for `maps` `[B, I, J]`, `rows` `[B, I]`, `cols` `[B, J]` (one GEMV per image)."""
    return torch.bmm(maps, cols.unsqueeze(-1)).squeeze(-1).mul_(rows).sum()


def _summed(maps: list[torch.Tensor]) -> torch.Tensor:
    """Σ_l maps[l], in one new tensor (each pass needs the maps themselves afterwards)."""
    total = maps[0].clone()
    for m in maps[1:]:
        total.add_(m)
    return total


def _gathered(words: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`words` `[b, J, d]` at `order` `[b, W]`: each image's real words first (`real_words_first`)."""
    return words.gather(1, order[..., None].expand(-1, -1, words.shape[-1]))


def _scattered(grad: torch.Tensor, order: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient at the gathered words `[b, W, d]` put back in their places of `like` `[b, J, d]` (zero
    elsewhere: padding)."""
    return torch.zeros_like(like).scatter(1, order[..., None].expand(-1, -1, like.shape[-1]), grad)


def _forward_pass(
    queries: list[torch.Tensor],
    words: list[torch.Tensor],
    token_mask: torch.Tensor,
    word_mask: torch.Tensor,
    token_weight: torch.Tensor,
    word_weight: torch.Tensor,
    order: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ w·Σ_l R^l, Σ w·Σ_l |R^l − R̄| and each layer's count of positive cosines, for a chunk of images (each
    layer's queries `[b, I, d]` and words `[b, J, d]`): every layer's map is read together, so compiled it is one
    kernel that reads each map once."""
    words = [_gathered(w, order) for w in words]
    maps = _rectified_maps([_UnitLayer.of(q, w, token_mask, word_mask) for q, w in zip(queries, words)])
    counts = torch.stack([torch.count_nonzero(m) for m in maps])
    total = _summed(maps)
    sparse = _bilinear(total, token_weight, word_weight)
    mean = total.div_(len(maps))
    spread = maps[0].sub_(mean).abs_()
    for m in maps[1:]:
        spread.add_(m.sub_(mean).abs_())
    return sparse, _bilinear(spread, token_weight, word_weight), counts


def _backward_pass(
    queries: list[torch.Tensor],
    words: list[torch.Tensor],
    token_mask: torch.Tensor,
    word_mask: torch.Tensor,
    token_weight: torch.Tensor,
    word_weight: torch.Tensor,
    order: torch.Tensor,
    grad_sparse: torch.Tensor,
    grad_consistency: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients at each layer's queries and words, for a chunk of images, from the maps remade:
        H^l = [cos^l > 0]·(g_sparse + g_consistency·(sgn(R^l − R̄) − 1/L Σ_l' sgn(R^l' − R̄))),
    ∂/∂q̂_i = u_i Σ_j H_ij v_j k̂_j / L and ∂/∂k̂_j = v_j Σ_i H_ij u_i q̂_i / L (the weights go into the GEMMs'
    operands), then through the normalisation. Compiled, every H^l comes from one kernel that reads each map
    once."""
    full = words
    layers = [_UnitLayer.of(q, _gathered(w, order), token_mask, word_mask) for q, w in zip(queries, words)]
    maps = _rectified_maps(layers)
    depth, dtype = len(maps), queries[0].dtype
    mean = _summed(maps).div_(depth)
    positive = [m > 0 for m in maps]
    signs = [m.sub_(mean).sign_() for m in maps]  # in place: the maps are not needed past their signs
    base = signs[0].clone()
    for sign in signs[1:]:
        base.add_(sign)
    base.mul_(-grad_consistency / depth).add_(grad_sparse)
    grads_q, grads_k = [], []
    for sign, above, layer in zip(signs, positive, layers):
        slope = sign.mul_(grad_consistency).add_(base).mul_(above).to(dtype)
        weighted_words = (layer.unit_words * (word_weight / depth)[..., None]).to(dtype)
        weighted_queries = (layer.unit_queries * (token_weight / depth)[..., None]).to(dtype)
        grad_q, grad_k = torch.bmm(slope, weighted_words), torch.bmm(slope.transpose(1, 2), weighted_queries)
        grads_q.append(_unit_backward(grad_q, layer.queries, layer.query_rows, token_weight))
        grads_k.append(_unit_backward(grad_k, layer.words, layer.word_rows, word_weight))
    return grads_q, [_scattered(g, order, w) for g, w in zip(grads_k, full)]


class RegulariserPasses(NamedTuple):
    """The two passes over the cosine maps, eager (`EAGER_PASSES`) or compiled (`compiled_regulariser_passes`)."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]]


EAGER_PASSES = RegulariserPasses(_forward_pass, _backward_pass)


def _lengths_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A pass (`queries, words, token_mask, word_mask, token_weight, word_weight, order, *grads`) called with its
    images, queries and words dims marked dynamic and its widths and depth static (`train.dynamic_shapes`: compiled
    with every dim dynamic, a caption length equal to the width on the traced step compiled each pass again)."""

    def call(queries: list[torch.Tensor], words: list[torch.Tensor], *rest: torch.Tensor) -> tuple[Any, ...]:
        for tensor in (*queries, *words, *rest[:5]):
            mark_dynamic(tensor, 0, 1)
        return without_duck_sizing(compiled, queries, words, *rest)

    return call


@functools.cache
def compiled_regulariser_passes(backend: str = "inductor") -> RegulariserPasses:
    """The passes compiled by `backend`, which fuses each into a kernel that reads every layer's map once (bytes:
    `benchmarks/regularisers.py`). One graph per pass for every step's batch, context and caption lengths. One pair
    per process and backend."""
    return RegulariserPasses(
        _lengths_dynamic(torch.compile(_forward_pass, backend=backend, fullgraph=True)),
        _lengths_dynamic(torch.compile(_backward_pass, backend=backend, fullgraph=True)),
    )


MAP_CHUNK_BYTES = 2**30  # one chunk of images' maps, all layers at once, and their temporaries (eager: float32)


def _chunks(queries_keys: tuple[torch.Tensor, ...]) -> list[slice]:
    """Slices of images whose maps are made together, as even as can be: as many as keep every layer's float32 map
    and two temporaries of its size under MAP_CHUNK_BYTES. Never a chunk of one image beside larger ones, which a
    compiled pass would compile again for (a dim of size 1 is specialised): one image each instead."""
    depth = len(queries_keys) // 2
    b, i = queries_keys[0].shape[:2]
    per_image = depth * i * math.prod(queries_keys[depth].shape[1:-1]) * 12  # the words: N·S, at most
    most = max(1, MAP_CHUNK_BYTES // per_image) if per_image else max(b, 1)  # images a chunk may hold
    count = -(-b // most)
    if 2 * count > b:  # fewer than two images a chunk on average: some would hold one
        count = b
    bounds = [b * k // max(count, 1) for k in range(count + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


class _RectifiedCosineTerms(torch.autograd.Function):
    """Both regularisers of L layers' rectified cosines R^l = max(cos(q^l, K^l), 0), keeping no map for backward.

    With weights w = token_weight ⊗ word_weight (zero on padding, missing captions and images without text):
        sparse = 1/L Σ_l Σ w·R^l,   consistency = 1/L Σ_l Σ w·|R^l − R̄|,   R̄ = 1/L Σ_l R^l.
    Only the queries and keys are saved (the cross-attention keeps them anyway), and the order of each image's
    words (`real_words_first`). Each pass (`_forward_pass`, `_backward_pass`) takes a chunk of images from the
    queries and keys as given and gathers each image's real words first: their unit vectors, every layer's map by
    one GEMM over those words alone, read together, and (backward) the gradients through the normalisation, put
    back in the words' places and written chunk by chunk into the gradients' final tensors. The third output, the
    count of valid positive cosines per layer, has no gradient.
    """

    @staticmethod
    def forward(ctx, passes, token_weight, word_weight, token_mask, word_mask, order, *queries_keys):
        depth = len(queries_keys) // 2
        queries, words = queries_keys[:depth], [k.flatten(1, 2) for k in queries_keys[depth:]]
        sparse = consistency = token_weight.new_zeros(())
        counts = torch.zeros(depth, dtype=torch.int64, device=token_weight.device)
        with torch.autocast(queries_keys[0].device.type, enabled=False):
            for images in _chunks(queries_keys):
                chunk_sparse, chunk_consistency, chunk_counts = passes.forward(
                    [q[images] for q in queries],
                    [w[images] for w in words],
                    token_mask[images],
                    word_mask[images],
                    token_weight[images],
                    word_weight[images],
                    order[images],
                )
                sparse, consistency = sparse + chunk_sparse, consistency + chunk_consistency
                counts = counts + chunk_counts
        ctx.save_for_backward(token_weight, word_weight, token_mask, word_mask, order, *queries_keys)
        ctx.passes = passes
        positive = counts.float()
        ctx.mark_non_differentiable(positive)
        return sparse / depth, consistency / depth, positive

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sparse, grad_consistency, _grad_positive):
        token_weight, word_weight, token_mask, word_mask, order, *queries_keys = ctx.saved_tensors
        depth = len(queries_keys) // 2
        queries, words = queries_keys[:depth], [k.flatten(1, 2) for k in queries_keys[depth:]]
        chunks = _chunks(tuple(queries_keys))
        whole = len(chunks) == 1
        grads = [x if whole else torch.zeros_like(x) for x in queries_keys]  # whole: replaced below
        autocast_off = torch.autocast(queries_keys[0].device.type, enabled=False)
        with autocast_off, record_function("regularisers_backward"):  # a profile's label (gpu_check's)
            for images in chunks:
                grads_q, grads_k = ctx.passes.backward(
                    [q[images] for q in queries],
                    [w[images] for w in words],
                    token_mask[images],
                    word_mask[images],
                    token_weight[images],
                    word_weight[images],
                    order[images],
                    grad_sparse,
                    grad_consistency,
                )
                for n in range(depth):
                    grad_k = grads_k[n].view(queries_keys[depth + n][images].shape)
                    if whole:
                        grads[n], grads[depth + n] = grads_q[n], grad_k
                    else:
                        grads[n][images], grads[depth + n][images] = grads_q[n], grad_k
        return None, None, None, None, None, None, *grads


def centred_heads(
    queries: list[torch.Tensor], keys: list[torch.Tensor], word_mask: torch.Tensor, heads: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, what each attention head compares: queries `[B, I, d]` → `[B·h, I, d/h]`, and keys `[B, N, S, d]`
    → `[B·h, N, S, d/h]` less their mean over each caption's valid words.

    Softmax is blind to a shift that every word of a caption shares, so the centred cosine is the part of the
    patch–word cosine that the attention acts on. Centred keys sum to zero over a caption's words, so no query has
    a negative cosine with all of them: the rectified terms cannot switch themselves off by a shared offset.
    """
    words = word_mask.to(keys[0].dtype)[..., None]  # [B, N, S, 1]
    count = words.sum(dim=2, keepdim=True).clamp_min(1)
    out_q, out_k = [], []
    for q, k in zip(queries, keys):
        b, i, d = q.shape
        n, s = k.shape[1:3]
        centred = (k - (k * words).sum(dim=2, keepdim=True) / count) * words
        out_q.append(q.view(b, i, heads, d // heads).transpose(1, 2).reshape(b * heads, i, d // heads))
        out_k.append(centred.view(b, n, s, heads, d // heads).permute(0, 3, 1, 2, 4).reshape(b * heads, n, s, -1))
    return out_q, out_k


COSINE_BINS = 200  # the validation histogram of patch–word cosines: bins of 0.01 over [-1, 1]


@torch.no_grad()
def cosine_histogram(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    word_mask: torch.Tensor,
    token_valid: torch.Tensor | None = None,
    cosine: str = "full",
    heads: int = 1,
) -> torch.Tensor:
    """float64 `[L, COSINE_BINS]`: per layer, how many valid patch–word cosines (the regularisers', before they
    are rectified) fall in each bin of [-1, 1]; histograms add over batches and processes."""
    if cosine == "head_centred":
        queries, keys = centred_heads(queries, keys, word_mask, heads)
        word_mask = word_mask.repeat_interleave(heads, 0)
        token_valid = None if token_valid is None else token_valid.repeat_interleave(heads, 0)
    b, i = queries[0].shape[:2]
    tokens = torch.ones(b, i, dtype=torch.bool, device=word_mask.device) if token_valid is None else token_valid
    pairs = tokens[:, :, None] & word_mask.flatten(1)[:, None, :]  # [B, I, N·S]
    out = []
    for q, k in zip(queries, keys):
        values = patch_word_cosine(q, k)[pairs].clamp(-1, 1)
        out.append(torch.histc(values, COSINE_BINS, -1.0, 1.0).double())
    return torch.stack(out)


def histogram_quantiles(histogram: torch.Tensor, quantiles: tuple[float, ...]) -> list[list[float]]:
    """Per row of `histogram` `[L, bins]` over [-1, 1], each quantile (the upper edge of the bin where the cumulative
    count reaches it), to the bins' resolution."""
    edges = torch.linspace(-1, 1, histogram.shape[1] + 1, dtype=torch.float64)[1:]
    out = []
    for row in histogram.cpu():
        cumulative = row.cumsum(0) / row.sum().clamp_min(1)
        out.append([round(float(edges[int(torch.searchsorted(cumulative, q))].clamp(max=1.0)), 3) for q in quantiles])
    return out


def text_regularisers(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    word_mask: torch.Tensor,
    valid: torch.Tensor,
    token_valid: torch.Tensor | None = None,
    cosine: str = "full",
    heads: int = 1,
    passes: RegulariserPasses = EAGER_PASSES,
    image_words: int | None = None,
) -> TextRegularisers:
    """Sparsity and cross-layer consistency of rectified patch–word cosines.

    Per layer, `queries` `[B, I, d]` (the cross-attention's) and `keys` `[B, N, S, d]` (the caption words');
    `word_mask` `[B, N, S]`; `valid` `[B, N]`; `token_valid` `[B, I]` marks real tokens (None: all are; context
    padding is neither averaged nor counted).

    `cosine` ``full``: the cosine of the full projected vectors (the formula as the seeds write it);
    ``head_centred``: per attention head (of `heads`), with the keys centred over each caption's valid words
    (`centred_heads`), the terms averaged over heads. `passes`: eager, or compiled where the blocks are
    (`compiled_regulariser_passes`). `image_words`: at least the most real words one image has (all its captions;
    `TextBatch.image_words`, counted on the host): each image's real words are gathered to the front and the maps
    cover that many, so that padded words cost nothing (None: all N·S).
    """
    if cosine not in REGULARISER_COSINES:
        raise ValueError(f"cosine must be one of {', '.join(REGULARISER_COSINES)}, got {cosine!r}")
    if cosine == "head_centred":
        queries, keys = centred_heads(queries, keys, word_mask, heads)
        word_mask, valid = word_mask.repeat_interleave(heads, 0), valid.repeat_interleave(heads, 0)
        token_valid = None if token_valid is None else token_valid.repeat_interleave(heads, 0)
        # Each image's heads are `heads` images of the flat call, each weighted alike: the mean over heads, then
        # over the images with captions, as before.
        return text_regularisers(queries, keys, word_mask, valid, token_valid, passes=passes, image_words=image_words)
    weights = RegulariserWeights.of(word_mask, valid, token_valid, queries[0].shape[1])
    words = weights.word_mask.shape[1]
    order, weights = real_words_first(weights, words if image_words is None else min(image_words, words))
    sparse, consistency, positive = _RectifiedCosineTerms.apply(passes, *weights.arguments(), order, *queries, *keys)
    return TextRegularisers(sparse, consistency, positive / weights.pairs.clamp_min(1), weights.pairs)


def real_words_first(weights: RegulariserWeights, width: int) -> tuple[torch.Tensor, RegulariserWeights]:
    """The order `[B, width]` that puts every image's real words (all its captions') first, in order, then padding,
    cut to `width` (at least the most real words an image has), and the words' weights and mask in that order. The
    passes gather the words by it, so each map covers `width` words, not N·S; the regularisers weigh pairs, not
    captions, so the order does not matter, and the gradients go back to each word's place (zero on padding, as
    before). Computed on the device: no sync."""
    order = torch.argsort((weights.word_mask == 0).to(torch.uint8), dim=1, stable=True)[:, :width].contiguous()
    packed = weights._replace(
        word_weight=weights.word_weight.gather(1, order), word_mask=weights.word_mask.gather(1, order)
    )
    return order, packed


class RegulariserWeights(NamedTuple):
    """What each patch–word pair of the flat (full-cosine) call weighs: w = token_weight ⊗ word_weight."""

    token_weight: torch.Tensor  # [B, I]: 1 / (the image's real tokens) on real tokens, else 0
    word_weight: torch.Tensor  # [B, N·S]: 1 / (its image's captions × images with text) on valid words, else 0
    token_mask: torch.Tensor  # [B, I] float: real tokens
    word_mask: torch.Tensor  # [B, N·S] float: valid words
    pairs: torch.Tensor  # scalar: valid words × real tokens, the same every layer

    @classmethod
    def of(
        cls, word_mask: torch.Tensor, valid: torch.Tensor, token_valid: torch.Tensor | None, tokens: int
    ) -> RegulariserWeights:
        if token_valid is None:
            token_mask = torch.ones(word_mask.shape[0], tokens, dtype=torch.float32, device=word_mask.device)
        else:
            token_mask = token_valid.to(torch.float32)
        token_weight = token_mask / token_mask.sum(dim=1, keepdim=True).clamp_min(1)  # mean over an image's tokens
        captions = valid.to(torch.float32)
        per_image = captions.sum(dim=1)
        with_text = (per_image > 0).to(torch.float32)
        # Mean over the captions an image has, then over the images that have any.
        caption_weight = (
            captions / per_image.clamp_min(1)[:, None] * (with_text / with_text.sum().clamp_min(1))[:, None]
        )
        words = word_mask.to(torch.float32)
        word_weight = (words * caption_weight[..., None]).flatten(1)
        words = words.flatten(1)
        pairs = (words.sum(dim=1) * token_mask.sum(dim=1)).sum()
        return cls(token_weight, word_weight, token_mask, words, pairs)

    def arguments(self) -> tuple[torch.Tensor, ...]:
        """The leading arguments of the regularisers' autograd Function."""
        return self.token_weight, self.word_weight, self.token_mask, self.word_mask


SIGREG_KNOTS = 17  # quadrature points of the Epps–Pulley integral over t in [0, SIGREG_T]
SIGREG_T = 3.0


def sigreg_directions(width: int, count: int, seed: int, step: int, device: torch.device) -> torch.Tensor:
    """`[width, count]` random unit directions for step `step`: drawn from (seed, step) alone, so every process of a
    run draws the same ones and a resumed run the same as an uninterrupted one."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    directions = torch.randn(width, count, generator=generator)
    return (directions / directions.norm(dim=0, keepdim=True)).to(device)


def sigreg(embeddings: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """LeJEPA's SIGReg: how far the embeddings `[n, D]`, projected on unit `directions` `[D, K]`, are from N(0, 1),
    by the Epps–Pulley statistic: ∫ |φ_n(t) − e^{−t²/2}|² e^{−t²/2} dt over t (symmetric, so twice the integral over
    [0, T], by the trapezoid rule), φ_n the projections' empirical characteristic function; averaged over the
    directions. 0 when every projection is standard normal; it grows as the embeddings collapse onto fewer
    directions."""
    z = embeddings.float() @ directions.float()  # [n, K]
    t = torch.linspace(0, SIGREG_T, SIGREG_KNOTS, device=z.device)
    phase = z[..., None] * t  # [n, K, T]
    gauss = torch.exp(-0.5 * t * t)
    error = (torch.cos(phase).mean(0) - gauss).square() + torch.sin(phase).mean(0).square()  # [K, T]
    return 2 * torch.trapezoid(error * gauss, t, dim=-1).mean()
