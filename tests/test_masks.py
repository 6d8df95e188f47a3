"""Multi-block masks: validity, determinism, world-size invariance and the absence of the reference biases."""

from __future__ import annotations

import numpy as np
import pytest

from train.masks import MaskConfig, Masks, block_size, padded_length, sample_masks

CFG = MaskConfig()


def check_masks(m: Masks, cfg: MaskConfig, grid: tuple[int, int], batch: int) -> None:
    """Everything a single call must satisfy, whatever the draw."""
    H, W = grid
    h, w = m.target_hw
    ch, cw = m.context_hw
    assert 1 <= h <= H and 1 <= w <= W and 1 <= ch <= H and 1 <= cw <= W
    assert m.context.dtype == np.int64 and m.targets.dtype == np.int64
    assert m.context.ndim == 2 and m.context.shape[0] == batch and m.context_lengths.shape == (batch,)
    assert m.targets.shape == (batch, cfg.num_targets, h * w)
    assert m.context_lengths.min() >= cfg.min_context and m.context_lengths.max() <= m.context.shape[1]
    for arr in (m.context, m.targets):
        assert arr.min() >= 0 and arr.max() < H * W
    valid = m.context_valid()
    for row, keep, n in zip(m.context, valid, m.context_lengths):
        assert (np.diff(row[:n]) > 0).all(), "real context patches sorted and unique"
        assert (row[~keep] == row[0]).all(), "padding repeats the row's first patch"
    # Each target block is exactly the h×w rectangle whose top-left patch is its first index.
    offsets = (np.arange(h)[:, None] * W + np.arange(w)[None, :]).ravel()
    first = m.targets[..., :1]
    assert (m.targets == first + offsets).all()
    assert (first[..., 0] // W <= H - h).all() and (first[..., 0] % W <= W - w).all()
    # The context lies within one ch×cw block and misses every target patch.
    rows, cols = m.context // W, m.context % W  # padding repeats a real patch, so it cannot widen the span
    assert (rows.max(1) - rows.min(1) < ch).all() and (cols.max(1) - cols.min(1) < cw).all()
    for ctx, tgt in zip(m.context, m.targets):
        assert not np.isin(ctx, tgt).any()


@pytest.mark.parametrize("grid", [(16, 16), (14, 14), (8, 12), (12, 8)])
@pytest.mark.parametrize("equalise", ["pad", "cut"])
def test_masks_valid(grid, equalise):
    cfg = MaskConfig(context_equalise=equalise)
    for step in range(10):
        check_masks(sample_masks(cfg, grid, 0, step, 64), cfg, grid, 64)


def test_pad_keeps_every_context_patch_and_cut_keeps_the_batch_minimum():
    """Both settings draw the same blocks; pad keeps each image's whole context, cut the batch's smallest count."""
    H, W = 16, 16
    for step in range(5):
        pad = sample_masks(MaskConfig(context_equalise="pad"), (H, W), 9, step, 32)
        cut = sample_masks(MaskConfig(context_equalise="cut"), (H, W), 9, step, 32)
        assert np.array_equal(pad.targets, cut.targets) and pad.context_hw == cut.context_hw
        assert pad.context.shape[1] == padded_length(int(pad.context_lengths.max())) and pad.context.shape[1] % 8 == 0
        assert (cut.context_lengths == pad.context_lengths.min()).all() and cut.context.shape[
            1
        ] == pad.context_lengths.min()
        for p_row, p_n, c_row in zip(pad.context, pad.context_lengths, cut.context):
            assert set(c_row) <= set(p_row[:p_n]), "cut keeps a subset of the sampled context"
        # pad's context is a whole ch×cw context block minus the targets: no patch of it is dropped.
        ch, cw = pad.context_hw
        for b in range(32):
            kept = set(pad.context[b, : pad.context_lengths[b]].tolist())
            targets = set(pad.targets[b].ravel().tolist())
            blocks = (
                {(r0 + i) * W + c0 + j for i in range(ch) for j in range(cw)} - targets
                for r0 in range(H - ch + 1)
                for c0 in range(W - cw + 1)
            )
            assert any(kept == block for block in blocks), f"image {b}: not a whole context block minus its targets"


def test_padded_lengths_are_rounded_up_to_a_multiple_of_8_even_past_the_grid():
    """Rounding pads with the row's first patch, masked like any padding; on a grid of fewer patches than the rounded
    length the rows are still whole (the padding then repeats the first patch past the grid's end)."""
    assert [padded_length(n) for n in (1, 7, 8, 9, 16, 17, 196)] == [8, 8, 8, 16, 16, 24, 200]
    cfg = MaskConfig(num_targets=1, target_scale=(0.2, 0.2), target_aspect=(1.0, 1.0), min_context=1)
    for grid in ((2, 3), (14, 14)):
        masks = sample_masks(cfg, grid, 0, 0, 16)
        assert masks.context.shape[1] == padded_length(int(masks.context_lengths.max()))
        for row, n in zip(masks.context, masks.context_lengths):
            assert len(set(row[:n].tolist())) == n and (row[n:] == row[0]).all()
            assert row.max() < grid[0] * grid[1]


def test_with_pad_the_context_an_image_keeps_does_not_depend_on_the_batch_size():
    """The mean context per image is the same at global batch 8 and 256 with pad; cut's falls as the batch grows."""

    def mean_context(equalise: str, batch: int) -> float:
        cfg = MaskConfig(context_equalise=equalise)
        return float(np.mean([sample_masks(cfg, (14, 14), 1, s, batch).context_lengths.mean() for s in range(200)]))

    assert mean_context("pad", 8) == pytest.approx(mean_context("pad", 256), rel=0.02)
    assert mean_context("cut", 256) < 0.85 * mean_context("cut", 8) < 0.85 * mean_context("pad", 8)


def test_tiny_grid_with_lower_min_context():
    """On 4×4 about a third of first draws leave under 8 context patches: the retry must fix them all."""
    cfg = MaskConfig(min_context=8)
    for step in range(20):
        check_masks(sample_masks(cfg, (4, 4), 1, step, 32), cfg, (4, 4), 32)


@pytest.mark.parametrize(
    "cfg",
    [
        MaskConfig(min_context=16, context_scale=(1.0, 1.0)),  # targets always take a patch of the 16
        MaskConfig(min_context=17),  # more than the grid holds
    ],
)
def test_config_that_cannot_fit_raises(cfg):
    with pytest.raises(ValueError, match="no context"):
        sample_masks(cfg, (4, 4), 0, 0, 8)


def test_deterministic_per_seed_and_step():
    a = sample_masks(CFG, (16, 16), 7, 3, 32)
    b = sample_masks(CFG, (16, 16), 7, 3, 32)
    assert np.array_equal(a.context, b.context) and np.array_equal(a.targets, b.targets)
    assert (a.target_hw, a.context_hw) == (b.target_hw, b.context_hw)
    for other in (sample_masks(CFG, (16, 16), 7, 4, 32), sample_masks(CFG, (16, 16), 8, 3, 32)):
        assert not np.array_equal(a.targets, other.targets)


def test_world_size_invariance():
    full = sample_masks(CFG, (16, 16), 5, 11, 16)
    for parts in (
        [slice(0, 8), slice(8, 16)],
        [slice(i, i + 4) for i in range(0, 16, 4)],
        [np.array([15, 3, 8]), np.array([0])],
    ):
        for rows in parts:
            part = sample_masks(CFG, (16, 16), 5, 11, 16, rows=rows)
            want = np.arange(16)[rows]
            assert part.context.shape[1] == full.context.shape[1], "one context length per global batch"
            assert np.array_equal(part.context, full.context[want])
            assert np.array_equal(part.targets, full.targets[want])
            assert (part.target_hw, part.context_hw) == (full.target_hw, full.context_hw)


@pytest.mark.parametrize("rows", [np.array([16]), np.array([-1]), np.array([[0, 1]]), np.array([0.5])])
def test_bad_rows_raise(rows):
    with pytest.raises(ValueError, match="rows"):
        sample_masks(CFG, (16, 16), 0, 0, 16, rows=rows)


def test_targets_reach_every_edge():
    H, W = 16, 16
    seen = np.zeros(H * W, dtype=bool)
    for step in range(100):
        seen[sample_masks(CFG, (H, W), 2, step, 16).targets.ravel()] = True
    assert seen[0] and seen[H * W - 1], "first and last patch"
    assert seen.reshape(H, W)[H - 1].any() and seen.reshape(H, W)[:, W - 1].any(), "last row and column"


def test_context_subset_has_no_spatial_bias():
    """P(kept | eligible) is the same in the top-left and bottom-right corners (first-k keeping fails this)."""
    H, W = 16, 16
    # I-JEPA's cut; the context block is the whole grid: eligible = not a target.
    cfg = MaskConfig(context_scale=(1.0, 1.0), context_equalise="cut")
    kept = np.zeros((H, W))
    eligible = np.zeros((H, W))
    for step in range(20):
        m = sample_masks(cfg, (H, W), 3, step, 256)
        B = m.context.shape[0]
        is_target = np.zeros((B, H * W), dtype=bool)
        is_target[np.arange(B)[:, None], m.targets.reshape(B, -1)] = True
        is_kept = np.zeros((B, H * W), dtype=bool)
        is_kept[np.arange(B)[:, None], m.context] = True
        assert m.context.shape[1] < (~is_target).sum(1).max(), "equalisation drops patches"
        kept += is_kept.sum(0).reshape(H, W)
        eligible += (~is_target).sum(0).reshape(H, W)
    top_left = kept[:6, :6].sum() / eligible[:6, :6].sum()
    bottom_right = kept[-6:, -6:].sum() / eligible[-6:, -6:].sum()
    assert 0.9 < top_left / bottom_right < 1.1


@pytest.mark.parametrize("grid", [(14, 14), (16, 16)])
def test_target_size_statistics(grid):
    H, W = grid
    hw = np.array([sample_masks(CFG, grid, 4, step, 1).target_hw for step in range(2000)], dtype=float)
    scale = hw[:, 0] * hw[:, 1] / (H * W)
    assert abs(scale.mean() - 0.175) < 0.01, "mean scale within rounding of the range's midpoint"
    log_ratio = np.log(hw[:, 0] / hw[:, 1])
    assert log_ratio.std() > 0.1 and scale.std() > 0.005, "both vary"
    assert abs(np.corrcoef(log_ratio, scale)[0, 1]) < 0.1, "scale and aspect drawn independently"
    # The same statistic catches a sampler that reuses one uniform for both (as the reference did).
    u = np.random.default_rng(0).random(2000)
    shared = np.array([block_size(0.15 + 0.05 * x, 0.75 + 0.75 * x, grid) for x in u], dtype=float)
    assert np.corrcoef(np.log(shared[:, 0] / shared[:, 1]), shared[:, 0] * shared[:, 1])[0, 1] > 0.4


def test_block_size():
    assert block_size(0.175, 1.0, (16, 16)) == (7, 7)
    assert block_size(0.2, 1.5, (14, 14)) == (8, 5)  # sqrt(39.2*1.5)=7.67, sqrt(39.2/1.5)=5.11
    assert block_size(1.0, 4.0, (4, 4)) == (4, 2), "height clamped to the grid"
    assert block_size(0.01, 1.0, (4, 4)) == (1, 1), "at least one patch"
    assert block_size(1.0, 1.0, (8, 12)) == (8, 10)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_targets": 0}, "num_targets"),
        ({"min_context": 0}, "min_context"),
        ({"target_scale": (0.2, 0.15)}, "target_scale"),
        ({"target_scale": (0.0, 0.2)}, "target_scale"),
        ({"context_scale": (0.85, 1.1)}, "context_scale"),
        ({"target_aspect": (0.0, 1.5)}, "target_aspect"),
        ({"context_aspect": (2.0, 1.0)}, "context_aspect"),
    ],
)
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MaskConfig(**kwargs)
