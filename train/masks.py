"""I-JEPA multi-block masks: M target blocks and one context block per image.

Written fresh, vectorised over the batch with numpy, and free of three biases in
the reference sampler (facebookresearch/ijepa ``MaskCollator``):

* it reused one uniform draw for both a block's scale and its aspect ratio, so
  tall blocks were always the large ones; we draw scale and aspect independently;
* its origins ran over ``[0, H - h)``, never reaching the last row or column; ours
  are uniform over all ``[0, H - h]`` × ``[0, W - w]``;
* it equalised context lengths by cutting every image's context to the batch's
  smallest, keeping each image's *first* k patches: that drops 36–45% of the
  context at global batch 128–2048, always from the bottom of the image, and makes
  the task depend on the batch size. We keep every image's context whole and pad
  the rows to one length (`context_equalise="pad"`, the default; the encoder and
  predictor mask the padding out of attention). The cut stays available
  (`"cut"`), with a uniformly random subset instead of the first k.

Everything for a step is drawn for the whole global batch from one generator
seeded by (seed, step), and a process then takes its own rows: the masks of a
sample, and the padded (or cut) context length, do not depend on how many
processes share the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from train.choices import CONTEXT_EQUALISE

# Third word of the generator's seed, so the mask stream differs from other streams seeded by (seed, step).
_MASK_STREAM = 0x6D61736B  # "mask"
# Redraws of the positions of images whose context is under `min_context`.
_MAX_TRIES = 50
# Padded sequences (the encoder's contexts, captions) are padded to a multiple of this: attention kernels on GPUs
# want aligned lengths (tensor-core tiles; masked attention at odd lengths has failed under compile,
# pytorch#121943, #124289), and fewer distinct lengths mean fewer shapes for a compiled graph. The padding is masked
# out, so nothing changes but the shapes. The predictor's sequences (context and one target block) are not rounded.
LENGTH_MULTIPLE = 8


def padded_length(length: int) -> int:
    """`length` rounded up to a multiple of LENGTH_MULTIPLE."""
    return -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE


def _check_range(name: str, value: tuple[float, float], upper: float | None) -> None:
    """A (low, high) pair with 0 < low <= high (<= upper when given), or a ValueError naming the field."""
    if len(value) != 2:
        raise ValueError(f"{name} must be a (low, high) pair, got {value!r}")
    lo, hi = value
    if not lo <= hi:
        raise ValueError(f"{name} must be ordered low <= high, got {value!r}")
    if not lo > 0 or (upper is not None and hi > upper):
        bound = f"in (0, {upper:g}]" if upper is not None else "> 0"
        raise ValueError(f"{name} values must be {bound}, got {value!r}")


@dataclass(frozen=True)
class MaskConfig:
    """Multi-block mask settings; scales are fractions of the grid, aspect = block height / width."""

    num_targets: int = 4
    target_scale: tuple[float, float] = (0.15, 0.2)
    target_aspect: tuple[float, float] = (0.75, 1.5)
    context_scale: tuple[float, float] = (0.85, 1.0)
    context_aspect: tuple[float, float] = (1.0, 1.0)
    min_context: int = 10
    context_equalise: str = "pad"  # pad: each image keeps its whole context; cut: I-JEPA's cut to the batch minimum

    def __post_init__(self) -> None:
        """Refuse a bad config when it is built, not at the first step."""
        if self.context_equalise not in CONTEXT_EQUALISE:
            raise ValueError(
                f"context_equalise must be one of {', '.join(CONTEXT_EQUALISE)}, got {self.context_equalise!r}"
            )
        if self.num_targets < 1:
            raise ValueError(f"num_targets must be >= 1, got {self.num_targets}")
        if self.min_context < 1:
            raise ValueError(f"min_context must be >= 1, got {self.min_context}")
        _check_range("target_scale", self.target_scale, 1.0)
        _check_range("context_scale", self.context_scale, 1.0)
        _check_range("target_aspect", self.target_aspect, None)
        _check_range("context_aspect", self.context_aspect, None)


@dataclass
class Masks:
    """Patch indices (row-major, r * W + c) for the requested rows of a step's global batch."""

    context: np.ndarray  # int64 [B, Lc]: each row's patches sorted, then padding (copies of its first patch)
    context_lengths: np.ndarray  # int64 [B]: real context patches per row; the rest of the row is padding
    targets: np.ndarray  # int64 [B, M, Lt], each block sorted; Lt = h*w
    target_hw: tuple[int, int]
    context_hw: tuple[int, int]

    def context_valid(self) -> np.ndarray:
        """bool `[B, Lc]`: True on real context patches."""
        return np.arange(self.context.shape[1]) < self.context_lengths[:, None]


def block_size(scale: float, aspect: float, grid: tuple[int, int]) -> tuple[int, int]:
    """(h, w) of a block covering `scale` of the grid with h / w ≈ `aspect`, clamped to fit the grid."""
    H, W = grid
    area = scale * H * W
    h = min(max(int(round(math.sqrt(area * aspect))), 1), H)
    w = min(max(int(round(math.sqrt(area / aspect))), 1), W)
    return h, w


def _draw_size(
    rng: np.random.Generator, scale: tuple[float, float], aspect: tuple[float, float], grid: tuple[int, int]
) -> tuple[int, int]:
    """One block size, scale and aspect from separate uniform draws."""
    s = rng.uniform(*scale)
    a = rng.uniform(*aspect)
    return block_size(s, a, grid)


def _rect_grids(
    rng: np.random.Generator, n: int, k: int, hw: tuple[int, int], grid: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Origins [n, k] (flat index of the top-left patch) and boolean grids [n, k, H, W] of n×k uniform h×w blocks."""
    H, W = grid
    h, w = hw
    top = rng.integers(0, H - h + 1, size=(n, k))
    left = rng.integers(0, W - w + 1, size=(n, k))
    r = np.arange(H)
    c = np.arange(W)
    in_rows = (r >= top[..., None]) & (r < (top + h)[..., None])  # [n, k, H]
    in_cols = (c >= left[..., None]) & (c < (left + w)[..., None])  # [n, k, W]
    return top * W + left, in_rows[..., :, None] & in_cols[..., None, :]


def _draw_positions(
    rng: np.random.Generator,
    n: int,
    m: int,
    target_hw: tuple[int, int],
    context_hw: tuple[int, int],
    grid: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Target origins [n, m] and context grids [n, H, W] (context block minus all targets) for n images."""
    origins, targets = _rect_grids(rng, n, m, target_hw, grid)
    _, context = _rect_grids(rng, n, 1, context_hw, grid)
    return origins, context[:, 0] & ~targets.any(axis=1)


def _select_rows(rows: slice | np.ndarray | None, global_batch: int) -> np.ndarray:
    """Global sample positions asked for, as an int64 array within [0, global_batch)."""
    if rows is None:
        return np.arange(global_batch)
    if isinstance(rows, slice):
        return np.arange(global_batch)[rows]
    idx = np.asarray(rows)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"rows must be a slice or a 1-D integer array, got {rows!r}")
    if idx.size and (idx.min() < 0 or idx.max() >= global_batch):
        raise ValueError(f"rows must lie in [0, {global_batch}), got {idx.min()}..{idx.max()}")
    return idx.astype(np.int64)


def sample_masks(
    cfg: MaskConfig,
    grid: tuple[int, int],
    seed: int,
    step: int,
    global_batch: int,
    rows: slice | np.ndarray | None = None,
) -> Masks:
    """Masks for `rows` (default all) of step `step`'s global batch of `global_batch` images.

    The whole global batch is drawn every time so that a sample's masks and the
    batch's context length depend only on (cfg, grid, seed, step, global_batch, row).
    """
    H, W = grid
    if H < 1 or W < 1:
        raise ValueError(f"grid must be at least 1×1 patches, got {grid!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    idx = _select_rows(rows, global_batch)
    no_context = (
        f"mask settings leave no context on this {H}×{W} grid "
        f"(min_context={cfg.min_context}); lower min_context or the target scale"
    )

    rng = np.random.default_rng([seed, step, _MASK_STREAM])
    target_hw = _draw_size(rng, cfg.target_scale, cfg.target_aspect, grid)
    context_hw = _draw_size(rng, cfg.context_scale, cfg.context_aspect, grid)
    if context_hw[0] * context_hw[1] < cfg.min_context:
        raise ValueError(no_context)

    origins, context = _draw_positions(rng, global_batch, cfg.num_targets, target_hw, context_hw, grid)
    counts = context.sum(axis=(1, 2))
    for _ in range(_MAX_TRIES):
        failing = np.flatnonzero(counts < cfg.min_context)
        if failing.size == 0:
            break
        origins[failing], context[failing] = _draw_positions(
            rng, failing.size, cfg.num_targets, target_hw, context_hw, grid
        )
        counts[failing] = context[failing].sum(axis=(1, 2))
    if (counts < cfg.min_context).any():
        raise ValueError(no_context)

    flat = context.reshape(global_batch, H * W)[idx]
    if cfg.context_equalise == "cut":
        # A uniformly random subset of the batch minimum: random keys for every global image (so the stream does not
        # depend on `rows`), non-context patches pushed past the end, then the smallest Lc keys kept.
        length = int(counts.min())
        keys = rng.random((global_batch, H * W))
        keys = np.where(flat, keys[idx], 2.0)
        context_idx = np.sort(np.argpartition(keys, length - 1, axis=1)[:, :length], axis=1).astype(np.int64)
        lengths = np.full(len(idx), length, dtype=np.int64)
    else:
        # Every patch kept, rows padded to the global batch's longest, rounded up to a multiple of LENGTH_MULTIPLE
        # (so the shape does not depend on `rows`): a stable sort puts each row's context patches first, in patch
        # order, then pads with its first patch.
        length = padded_length(int(counts.max()))
        order = np.argsort(~flat, axis=1, kind="stable")[:, :length]
        lengths = counts[idx].astype(np.int64)
        pad = np.arange(length) >= lengths[:, None]
        order = np.pad(order, ((0, 0), (0, length - order.shape[1])))  # a grid of fewer patches than `length`
        context_idx = np.where(pad, order[:, :1], order).astype(np.int64)

    h, w = target_hw
    offsets = (np.arange(h)[:, None] * W + np.arange(w)[None, :]).ravel()
    targets = (origins[idx][..., None] + offsets).astype(np.int64)
    return Masks(context_idx, lengths, targets, target_hw, context_hw)
