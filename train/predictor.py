"""The JEPA predictor and its text conditioner.

Input: context features (projected to the predictor width, plus their position
embeddings) followed by one mask token per target position (a shared learnable
vector plus that position's embedding). Each target block is its own predictor
sequence; sequences are ordered image-major (sequence p = image p // M, block
p % M), so one image's M sequences are adjacent and can be viewed as one
`[M*T]` row when they attend to that image's captions.

Conditioning modes:
- ``none``: plain I-JEPA.
- ``sequence``: the N captions' word tokens, projected to the predictor width
  (plus a learned type embedding), appended once to every predictor sequence;
  padding words are masked out of self-attention.
- ``cross``: TC-JEPA. In every layer, after self-attention, every token (context
  and target positions alike) attends to each caption's words by residual
  cross-attention (padding words masked), then the layer's MLP follows
  (pre-norm residual: x + MLP(LN x)). The N caption-conditioned versions are
  max-pooled over captions, per layer, and the pooled features feed the next
  layer. `pool="after_mlp"` pools after each caption's MLP (the literal reading
  of the paper); `pool="before_mlp"` pools right after the cross-attention and
  runs one shared MLP (N times cheaper). Missing captions are left out of the
  pool; an image without any caption takes the unconditioned path (x + MLP).

The conditioner's form (`conditioner`): ``paper`` (the default) is SPEC §1's formula, q_l = W_Q q,
K = W_K t, V = W_V t with plain matrices and the weighted sum of V added to q as it is: no biases and no output
projection. Heads split the channels, so the heads' outputs side by side are already a vector of the predictor's
width and need no projection to be added back. Every update it adds is then a mix of the words' values: a
predictor can lower its loss only by what the captions say. ``mha`` is standard multi-head attention (biased
W_Q, W_K, W_V and a biased output projection), whose biases add the same vector whatever the words: kept for the
ablation and for runs made before the paper's form was the default.

Padded contexts (`train.packing`): when the encoder's context is packed, so are
the predictor's sequences, and every per-token layer (projections, MLPs, the pool
over captions) runs on real tokens alone; self- and cross-attention see padded
rows. The caption keys and values are projected from real words alone when the
batch counts them (`TextBatch.words`).

The caption keys and values of every layer come from one projection of the word
embeddings; the cross-attention runs as SDPA over (image, caption) pairs. Every
layer hands back its queries, and the predictor its keys, for the sparsity and
consistency regularisers on the patch–word cosines (`train.losses`), which
recompute the cosine maps rather than keep them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from train.choices import CONDITIONERS, CONDITIONING, POOLING
from train.losses import patch_word_cosine
from train.packing import TokenLayout
from train.vit import LN_EPS, MLP, LayerNorm, SelfAttention, init_weights, scale_residual_outputs, sincos_2d


@dataclass
class TextBatch:
    """Up to N captions per image as padded word embeddings; length 0 marks a missing caption."""

    tokens: torch.Tensor  # [B, N, S, d_text]
    lengths: torch.Tensor  # [B, N] int64
    words: int | None = None  # the lengths' sum, counted on the host: the K/V projection runs on real words alone
    # the most real words one image has (all its captions), rounded up to a multiple of 8, counted on the host: the
    # regularisers' patch-word maps then cover that many words per image, not N·S (None: N·S)
    image_words: int | None = None

    @property
    def word_mask(self) -> torch.Tensor:
        """bool `[B, N, S]`: True on real words."""
        s = self.tokens.shape[2]
        return torch.arange(s, device=self.lengths.device) < self.lengths[..., None]

    @property
    def valid(self) -> torch.Tensor:
        """bool `[B, N]`: the caption exists."""
        return self.lengths > 0

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None, non_blocking: bool = False) -> TextBatch:
        return TextBatch(
            self.tokens.to(device, dtype=dtype, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            self.words,
            self.image_words,
        )


@dataclass
class PredictorOutput:
    prediction: torch.Tensor  # [B, M, Lt, encoder width]
    queries: list[torch.Tensor]  # cross mode: per layer, the cross-attention queries [B, M*T, d]; else empty
    keys: list[torch.Tensor]  # cross mode: per layer, the caption word keys [B, N, S, d]; else empty
    token_valid: torch.Tensor | None = None  # bool [B, M*T]: False on context padding (None: no padding)
    context: torch.Tensor | None = None  # the context encoder's tokens [B, Lc, D] (`JEPA` sets it; SIGReg reads it)

    @property
    def cosines(self) -> list[torch.Tensor]:
        """Per layer, the patch–word cosine float32 `[B, M*T, N, S]` of the full projected vectors, for inspection.

        The regularisers never build these maps for backward: `train.losses.text_regularisers` takes `queries` and
        `keys` and recomputes each layer's map when it needs it.
        """
        return [patch_word_cosine(q, k).view(q.shape[:2] + k.shape[1:3]) for q, k in zip(self.queries, self.keys)]


@dataclass
class LayerCaptions:
    """One layer's view of the captions: its word keys and values, and which words a query may attend to."""

    keys: torch.Tensor  # [B, N, S, d]
    values: torch.Tensor  # [B, N, S, d]
    attend: torch.Tensor  # bool [B, N, S]: the real words, and every word of a missing caption (never an empty softmax)


class TextKeysValues(nn.Module):
    """The caption keys and values of every layer in one GEMM: d_text → L·2·d, split per layer.

    The split (not indexing) matters for backward: its gradient is one concatenation of every layer's, where a
    slice per layer would fill a zero buffer of the whole output for each.
    """

    def __init__(self, text_dim: int, dim: int, depth: int, bias: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.kv = nn.Linear(text_dim, depth * 2 * dim, bias=bias)

    def forward(self, text: TextBatch) -> list[LayerCaptions]:
        """Every layer's keys and values. With `text.words` counted, only real words are projected (padding's keys
        and values are zeros, never attended to): ~30% of a batch's words are padding."""
        if text.words is None:
            kv = self.kv(text.tokens)
        else:
            b, n, s, d = text.tokens.shape
            words = TokenLayout.of(text.word_mask.view(b * n, s), text.words)
            assert words.slots is not None
            projected = self.kv(words.pack(text.tokens.view(b * n, s, d)))
            # Put into a fresh tensor of the padded shape, in place and not through a view (whose backward would
            # copy the whole gradient), as the dense projection makes it: the keys and values are views of it, and a
            # compiled graph guards on their base's shape.
            kv = projected.new_zeros(b, n, s, projected.shape[-1])
            kv.index_put_((words.slots // (n * s), words.slots // s % n, words.slots % s), projected)
        parts = kv.split(self.dim, dim=-1)  # k_0, v_0, k_1, v_1, …
        attend = text.word_mask | ~text.valid[..., None]  # a missing caption attends to its padding (output discarded)
        return [LayerCaptions(k, v, attend) for k, v in zip(parts[0::2], parts[1::2])]


@dataclass(frozen=True)
class TokenCaptions:
    """Which captions each of the predictor's tokens reads, and where it sits among the cross-attention's rows.

    The tokens are the packed ones (`layout` packed) or every row's, flattened (`layout` None); the cross-attention
    runs on one row of `Q = M·T` queries per image (its M sequences side by side), one softmax per caption.
    """

    layout: TokenLayout | None  # the predictor's packed layout, to lay the tokens out in rows; None: they are rows
    rows: torch.Tensor  # int64 [P, N]: token p's row, for each caption, in the cross-attention's output [B·N·Q]
    valid: torch.Tensor  # bool [P, N]: the caption exists (its update counts)
    keep: torch.Tensor  # bool [P, N]: pooled over (an image without captions keeps one empty one: no update)

    @classmethod
    def of(cls, layout: TokenLayout | None, valid: torch.Tensor, sequence_rows: int) -> TokenCaptions:
        """For tokens in `layout` (None: every position of the `[B·M, T]` rows) of images whose captions exist where
        `valid` bool `[B, N]`; `sequence_rows` = M·T, one image's queries."""
        b, n = valid.shape
        positions = (
            layout.slots
            if layout is not None and layout.slots is not None
            else torch.arange(b * sequence_rows, device=valid.device)
        )
        image = positions // sequence_rows
        captions = torch.arange(n, device=valid.device)
        rows = (image[:, None] * n + captions) * sequence_rows + (positions % sequence_rows)[:, None]
        keep = valid.clone()
        keep[:, 0] |= ~valid.any(dim=1)
        packed = layout if layout is not None and layout.packed else None
        return cls(packed, rows, valid.index_select(0, image), keep.index_select(0, image))


class TextCrossAttention(nn.Module):
    """Multi-head attention from image tokens to each caption's words, one softmax per caption (SDPA).

    `form` ``paper``: a bias-free W_Q and no output projection (the heads' outputs side by side are the update);
    ``mha``: a biased W_Q and a biased output projection.
    """

    def __init__(self, dim: int, heads: int, form: str = "paper") -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=form == "mha")
        self.proj = nn.Linear(dim, dim) if form == "mha" else None

    def forward(
        self, x: torch.Tensor, captions: LayerCaptions, tokens: TokenCaptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[P, d]` (normed tokens) → each caption's update `[P, N, d]`, and the queries in rows `[B, Q, d]`.

        One SDPA over the B·N (image, caption) pairs, `[B·N, h, Q, d_h]` × `[B·N, h, S, d_h]`, with a key-padding
        mask: every image's queries are copied once per caption (SDPA takes one batch dimension). The copy is laid
        out `[B·N, Q, h, d_h]`, so SDPA's output comes in that layout too, and each token's rows are gathered from
        it without another copy. The projections run on the tokens alone, never on padding.
        """
        b, n, s = captions.keys.shape[:3]
        d = x.shape[-1]
        h, dh = self.heads, d // self.heads
        q = self.q(x)
        rows = (q if tokens.layout is None else tokens.layout.pad(q)).reshape(b, -1, d)
        nq = rows.shape[1]
        queries = rows[:, None].expand(b, n, nq, d).reshape(b * n, nq, h, dh).transpose(1, 2)
        keys = captions.keys.reshape(b * n, s, h, dh).transpose(1, 2)
        values = captions.values.reshape(b * n, s, h, dh).transpose(1, 2)
        mask = captions.attend.view(b * n, 1, 1, s)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)  # [B·N, h, Q, d_h]
        out = out.transpose(1, 2).reshape(b * n * nq, d).index_select(0, tokens.rows.view(-1)).view(-1, n, d)
        return (out if self.proj is None else self.proj(out)), rows


class _ResidualMax(torch.autograd.Function):
    """Max over captions (dim 1) of `x + update` among entries with `keep` True, at a fraction of the memory traffic.

    Same values and gradient as `(x + update).masked_fill(~keep, -inf).amax(dim=1)`.
    Through autograd, the add, the fill and `amax` each make a float tensor of the
    `[B, N, ...]` size, and `amax`'s backward compares, counts, divides, multiplies
    by a float copy of the comparison and then undoes the fill. Here the sum is made
    in one float buffer (filled in place), the tie mask is computed once and kept as
    bool, and the backward is one `where`: the gradient is `amax`'s, split evenly
    among ties; a dropped entry is -inf, never the max, so it gets none.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, update: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        total = update.to(torch.promote_types(x.dtype, update.dtype), copy=True)
        total.add_(x)
        total.masked_fill_(~keep.view(keep.shape + (1,) * (total.dim() - 2)), float("-inf"))
        out = total.amax(dim=1)
        is_max = total == out.unsqueeze(1)
        count = is_max.sum(dim=1, dtype=torch.uint8 if total.shape[1] < 256 else torch.int32)
        ctx.save_for_backward(is_max, count)
        ctx.x_broadcast = x.shape[1] == 1 and total.shape[1] > 1
        ctx.update_dtype = update.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        is_max, count = ctx.saved_tensors
        share = (grad / count).unsqueeze(1)
        if ctx.x_broadcast:
            # x's gradient, the sum of the shares over dim 1, is the incoming gradient (exactly so unless 3+ tie).
            share = share.to(ctx.update_dtype)
            return grad.unsqueeze(1), torch.where(is_max, share, share.new_zeros(())), None
        full = torch.where(is_max, share, share.new_zeros(()))
        return full, full.to(ctx.update_dtype), None


def residual_max(x: torch.Tensor, update: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Max of `x + update` over dim 1 where `keep` `[B, N]`; `x` `[B, N, ...]` or `[B, 1, ...]`, `update` `[B, N,
    ...]`."""
    return _ResidualMax.apply(x, update, keep)


class PredictorBlock(nn.Module):
    """Self-attention, then (cross mode) text cross-attention pooled over captions, then the MLP."""

    def __init__(
        self, dim: int, heads: int, mlp_ratio: float, cross: bool, pool: str, conditioner: str = "paper"
    ) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=LN_EPS)
        self.attn = SelfAttention(dim, heads)
        self.cross = TextCrossAttention(dim, heads, conditioner) if cross else None
        self.norm_cross = LayerNorm(dim, eps=LN_EPS) if cross else None
        self.norm2 = LayerNorm(dim, eps=LN_EPS)
        self.mlp = MLP(dim, int(dim * mlp_ratio))
        self.pool = pool

    def forward(
        self,
        x: torch.Tensor,
        layout: TokenLayout | None,
        captions: LayerCaptions | None,
        tokens: TokenCaptions | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x` `[B*M, T, d]`, or packed `[P, d]` (`layout` packed) → the layer's output and (cross mode with captions)
        its cross-attention queries `[B, M*T, d]`."""
        x = x + self.attn(self.norm1(x), layout)
        if self.cross is None or self.norm_cross is None or captions is None or tokens is None:
            return x + self.mlp(self.norm2(x)), None
        flat = x.reshape(-1, x.shape[-1])  # [P, d]: the packed tokens, or every row's
        out, queries = self.cross(self.norm_cross(flat), captions, tokens)
        return self.pool_captions(flat, out, tokens).view_as(x), queries

    def pool_captions(self, x: torch.Tensor, out: torch.Tensor, tokens: TokenCaptions) -> torch.Tensor:
        """Max over the present captions of `x` `[P, d]` + each caption's update `out` `[P, N, d]` (and its MLP:
        after_mlp), or of the residual sums before one shared MLP (before_mlp)."""
        out = out * tokens.valid[..., None].to(out.dtype)
        if self.pool == "after_mlp":
            # x[:, None] + out, [P, N, d], summed in one float buffer
            conditioned = out.to(torch.promote_types(out.dtype, x.dtype), copy=True).add_(x[:, None])
            return residual_max(conditioned, self.mlp(self.norm2(conditioned)), tokens.keep)
        pooled = residual_max(x[:, None], out, tokens.keep)
        return pooled + self.mlp(self.norm2(pooled))


class Predictor(nn.Module):
    """The JEPA predictor: context features and mask tokens in, predicted target features out, optionally reading
    captions (see the module docstring)."""

    pos_embed: torch.Tensor

    def __init__(
        self,
        encoder_width: int,
        grid: tuple[int, int],
        width: int = 384,
        depth: int = 6,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        conditioning: str = "none",
        text_dim: int | None = None,
        pool: str = "after_mlp",
        conditioner: str = "paper",
    ) -> None:
        super().__init__()
        if conditioning not in CONDITIONING:
            raise ValueError(f"conditioning must be one of {', '.join(CONDITIONING)}, got {conditioning!r}")
        if pool not in POOLING:
            raise ValueError(f"pool must be one of {', '.join(POOLING)}, got {pool!r}")
        if conditioner not in CONDITIONERS:
            raise ValueError(f"conditioner must be one of {', '.join(CONDITIONERS)}, got {conditioner!r}")
        if conditioning != "none" and not text_dim:
            raise ValueError(f"conditioning {conditioning!r} needs the text embedding width (text_dim)")
        text_width = text_dim or 0
        self.conditioning = conditioning
        self.embed = nn.Linear(encoder_width, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.register_buffer("pos_embed", sincos_2d(width, grid), persistent=False)
        cross = conditioning == "cross"
        self.blocks = nn.ModuleList(
            PredictorBlock(width, heads, mlp_ratio, cross, pool, conditioner) for _ in range(depth)
        )
        self.cross = TextKeysValues(text_width, width, depth, bias=conditioner == "mha") if cross else None
        self.text_embed = nn.Linear(text_width, width) if conditioning == "sequence" else None
        self.text_type = nn.Parameter(torch.zeros(1, 1, width)) if conditioning == "sequence" else None
        self.norm = LayerNorm(width, eps=LN_EPS)
        self.proj = nn.Linear(width, encoder_width)
        init_weights(self)
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        if self.text_type is not None:
            nn.init.trunc_normal_(self.text_type, std=0.02)
        scale_residual_outputs(self.blocks)
        if self.cross is not None and conditioner == "paper":
            self._scale_values_as_residual_outputs()
        self.register_load_state_dict_pre_hook(_fuse_text_keys_values)

    @torch.no_grad()
    def _scale_values_as_residual_outputs(self) -> None:
        """Without an output projection, layer l's W_V writes to the residual stream: its rows get the depth scaling
        of every residual output (`scale_residual_outputs`), 1/√(2l)."""
        assert self.cross is not None
        width = self.cross.dim
        for layer in range(len(self.blocks)):
            values = slice((2 * layer + 1) * width, (2 * layer + 2) * width)
            self.cross.kv.weight[values] /= math.sqrt(2.0 * (layer + 1))

    def forward(
        self,
        context: torch.Tensor,
        context_idx: torch.Tensor,
        target_idx: torch.Tensor,
        text: TextBatch | None = None,
        context_layout: TokenLayout | None = None,
    ) -> PredictorOutput:
        """`context` `[B, Lc, D]` at `context_idx` `[B, Lc]`; predicts `[B, M, Lt, D]` at `target_idx` `[B, M, Lt]`.

        `context_layout` marks real context patches (None: all are): padding is never attended to and never counted
        by the regularisers; packed, the predictor's sequences are packed too (their real tokens, back to back).
        `text` None (or mode ``none``) predicts without captions: the no-text control.
        """
        b, m, lt = target_idx.shape
        lc = context_idx.shape[1]
        context_valid = None if context_layout is None else context_layout.key_mask
        x, token_valid = self.sequences(context, context_idx, target_idx, context_valid)
        layout = None if token_valid is None else TokenLayout(token_valid)
        use_text = text if self.conditioning != "none" else None
        if use_text is not None and self.text_embed is not None and self.text_type is not None:  # sequence mode
            words = self.text_embed(use_text.tokens) + self.text_type  # [B, N, S, w]
            words = words.reshape(b, -1, words.shape[-1]).repeat_interleave(m, dim=0)
            x = torch.cat([x, words.to(x.dtype)], dim=1)
            word_mask = use_text.word_mask.reshape(b, -1).repeat_interleave(m, dim=0)
            image_tokens = token_valid
            if image_tokens is None:
                image_tokens = torch.ones(b * m, lc + lt, dtype=torch.bool, device=x.device)
            layout = TokenLayout(torch.cat([image_tokens, word_mask], dim=1))
        elif token_valid is not None and context_layout is not None and context_layout.slots is not None:
            layout = TokenLayout.of(token_valid, m * (context_layout.slots.shape[0] + b * lt))
            x = layout.pack(x)
        layers = self.cross(use_text) if use_text is not None and self.cross is not None else [None] * len(self.blocks)
        tokens = None
        if use_text is not None and self.cross is not None:
            tokens = TokenCaptions.of(layout, use_text.valid, m * (lc + lt))
        queries = []
        for block, captions in zip(self.blocks, layers):
            x, q = block(x, layout, captions, tokens)
            if q is not None:
                queries.append(q)
        keys = [captions.keys for captions in layers if captions is not None] if queries else []
        if layout is not None and layout.slots is not None:  # the target positions, among the packed tokens
            sequence_starts = torch.arange(b * m, device=x.device)[:, None] * (lc + lt)
            positions = sequence_starts + lc + torch.arange(lt, device=x.device)
            targets = x.index_select(0, layout.ranks().index_select(0, positions.view(-1)))
        else:
            targets = x[:, lc : lc + lt]
        out = self.proj(self.norm(targets))
        per_image_valid = None if token_valid is None else token_valid.reshape(b, m * (lc + lt))
        return PredictorOutput(out.view(b, m, lt, -1), queries, keys, per_image_valid)

    def sequences(
        self,
        context: torch.Tensor,
        context_idx: torch.Tensor,
        target_idx: torch.Tensor,
        context_valid: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The predictor sequences `[B*M, Lc + Lt, w]` (image-major) and which tokens are real (None: all are)."""
        b, m, lt = target_idx.shape
        pos = self.pos_embed
        ctx = self.embed(context) + pos[context_idx]
        ctx = ctx.repeat_interleave(m, dim=0)  # [B*M, Lc, w], image-major
        queries = self.mask_token + pos[target_idx.reshape(b * m, lt)]
        x = torch.cat([ctx, queries.to(ctx.dtype)], dim=1)
        if context_valid is None:
            return x, None
        targets_valid = torch.ones(b, lt, dtype=torch.bool, device=x.device)
        return x, torch.cat([context_valid, targets_valid], dim=1).repeat_interleave(m, dim=0)


def _fuse_text_keys_values(module: Predictor, state_dict: dict, prefix: str, *args: object) -> None:
    """Read a state dict saved before the K/V projections were fused (per layer `blocks.L.cross.k` / `.v`).

    The fused projection's rows are k_0, v_0, k_1, v_1, … (see `TextKeysValues`).
    """
    old = f"{prefix}blocks.0.cross.k.weight"
    if old not in state_dict or module.cross is None:
        return
    for kind in ("weight", "bias"):
        parts = [
            state_dict.pop(f"{prefix}blocks.{layer}.cross.{name}.{kind}")
            for layer in range(len(module.blocks))
            for name in ("k", "v")
        ]
        state_dict[f"{prefix}cross.kv.{kind}"] = torch.cat(parts)
