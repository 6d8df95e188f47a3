"""The Vision Transformer used as context and target encoder (I-JEPA style).

No CLS token, fixed 2-D sin-cos position embeddings, a Conv2d patch embedding,
pre-norm blocks with SDPA attention, a final LayerNorm. The context encoder is
called with `keep` (the context patch indices) and runs only on those tokens;
the target encoder is called without it and sees the whole image.

Weights are initialised once, in the constructor, including the depth scaling
of each block's output projections (the reference code re-initialised after
construction and so undid it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from train.choices import VIT_SIZES
from train.packing import TokenLayout

LN_EPS = 1e-6


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` whose scale and shift are raised to the input's precision when theirs is lower: FSDP2 gathers
    bf16 parameters while the residual stream stays float32, as under DDP. CUDA's autocast runs layer norms in
    float32 anyway; the CPU's does not, and the CPU kernel refuses a float32 input with bf16 parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if weight is not None and weight.dtype != x.dtype:
            dtype = torch.promote_types(weight.dtype, x.dtype)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def sincos_1d(dim: int, positions: torch.Tensor) -> torch.Tensor:
    """`[len(positions), dim]` sin-cos embedding of 1-D positions (dim even)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = positions.to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def sincos_2d(dim: int, grid: tuple[int, int]) -> torch.Tensor:
    """`[H*W, dim]` fixed 2-D embedding, row-major: half the channels encode the row, half the column."""
    if dim % 4:
        raise ValueError(f"sin-cos 2-D position embeddings need a width divisible by 4, got {dim}")
    h, w = grid
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    return torch.cat([sincos_1d(dim // 2, rows), sincos_1d(dim // 2, cols)], dim=1).float()


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # Packed tokens attend as nested jagged rows, no padding and no mask (`attention: jagged`, set by
        # `train.parallel.use_attention`), instead of in padded rows with a key mask.
        self.jagged = False

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        """`x` `[B, L, d]`, or packed `[T, d]` when `layout` has slots: the projections run on the real tokens alone
        and attention on rows, where padding (`layout.key_mask` False) is never attended to."""
        packed = layout is not None and layout.packed
        qkv = self.qkv(x)
        if packed and self.jagged:
            assert layout is not None
            return self.proj(self._jagged_attention(qkv, layout))
        if packed:
            assert layout is not None
            qkv = layout.pad(qkv)
        b, n, _ = qkv.shape
        d = qkv.shape[-1] // 3
        q, k, v = qkv.view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if layout is None else layout.key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d)
        if packed:
            assert layout is not None
            out = layout.pack(out)
        return self.proj(out)

    def _jagged_attention(self, qkv: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """Packed `qkv` `[T, 3d]` → attention's output `[T, d]`, each row's tokens attending to that row's alone.

        SDPA takes each of q, k and v as one contiguous `[T, h, d_h]` block (its nested path requires it). On CUDA
        that is the flash kernel's variable-length path; elsewhere SDPA splits the rows and runs its math kernel on
        each (a host sync, and a graph break under torch.compile: for tests, not for speed)."""
        t, three_d = qkv.shape
        d = three_d // 3
        q, k, v = layout.jagged(*(part.contiguous() for part in qkv.view(t, 3, self.heads, d // self.heads).unbind(1)))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).values().reshape(t, d)


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(LN x), then x + MLP(LN x)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=LN_EPS)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = LayerNorm(dim, eps=LN_EPS)
        self.mlp = MLP(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, layout: TokenLayout | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), layout)
        return x + self.mlp(self.norm2(x))


def init_weights(module: nn.Module) -> None:
    """Truncated-normal(0.02) linear/conv weights, zero biases, unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def scale_residual_outputs(blocks: nn.ModuleList) -> None:
    """Divide block l's residual output projections by sqrt(2 l), as I-JEPA does, so deep stacks start stable.

    Every residual branch counts: self-attention, the MLP and, in the predictor, the text cross-attention's output
    projection where it has one (without one, the predictor scales its value rows instead).
    """
    for layer, block in enumerate(blocks, start=1):
        cross = getattr(block, "cross", None)
        outputs = ["attn.proj", "mlp.fc2", *(["cross.proj"] if cross is not None and cross.proj is not None else [])]
        for name in outputs:
            linear = block.get_submodule(name)
            assert isinstance(linear, nn.Linear), name
            linear.weight.data.div_(math.sqrt(2.0 * layer))


class VisionTransformer(nn.Module):
    def __init__(
        self, image_size: int, patch_size: int, width: int, depth: int, heads: int, mlp_ratio: float = 4.0
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"patch size {patch_size} does not divide image size {image_size}")
        self.patch_size = patch_size
        self.grid = (image_size // patch_size, image_size // patch_size)
        self.width = width
        self.heads = heads
        self.patch_embed = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)
        self.register_buffer("pos_embed", sincos_2d(width, self.grid), persistent=False)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(depth))
        self.norm = LayerNorm(width, eps=LN_EPS)
        init_weights(self)
        scale_residual_outputs(self.blocks)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    def forward(
        self, images: torch.Tensor, keep: torch.Tensor | None = None, layout: TokenLayout | None = None
    ) -> torch.Tensor:
        """`images` `[B, 3, H, W]` → features `[B, L, width]`; `keep` `[B, L]` patch indices, or None for all.

        `layout` (of `[B, L]`) marks the real entries of `keep` when contexts are padded to one length: padding is
        never attended to, so each image's features depend only on its own context, however long the batch's longest
        is; a packed layout runs the blocks on the real tokens alone, and the padding's features are zeros.
        """
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        if keep is not None and layout is not None and layout.packed:
            b, patches, width = x.shape
            rows = keep + torch.arange(b, device=keep.device)[:, None] * patches  # each kept patch's row in [B·P]
            x = x.reshape(b * patches, width).index_select(0, layout.pack(rows))
        elif keep is not None:
            x = torch.gather(x, 1, keep[..., None].expand(-1, -1, x.shape[-1]))
        for block in self.blocks:
            x = block(x, layout)
        x = self.norm(x)
        return layout.pad(x) if layout is not None and layout.packed else x


def build_vit(
    model: str,
    image_size: int,
    patch_size: int,
    width: int | None = None,
    depth: int | None = None,
    heads: int | None = None,
) -> VisionTransformer:
    """A named size (`vit_tiny` … `vit_giant`), with width/depth/heads overridable for custom sizes."""
    if model not in VIT_SIZES:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(VIT_SIZES)}")
    size = VIT_SIZES[model]
    return VisionTransformer(
        image_size, patch_size, width or size.width, depth or size.depth, heads or size.heads, size.mlp_ratio
    )
