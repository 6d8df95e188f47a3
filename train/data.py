"""Training batches: item `s` of `StepBatches` is this process's share of step s's global batch.

Everything random is keyed by (seed, step, global sample position): which image
(an epoch permutation keyed by (seed, epoch)), its crop, which of its captions,
and the masks (drawn for the whole global batch, see `train.masks`). A run is
therefore reproducible, resumes at any step without replay, and gives every
sample the same crop, captions and masks whatever the number of processes.

Images are read through `pipeline.core.sources.ImageReader` and checked against the
sha256 recorded in the index, so a source that changed since the join is caught
instead of silently pairing images with another image's captions. Caption token
embeddings come from the memory-mapped `EmbeddingReader`; the store is opened
lazily in each worker (a memory map must not be pickled).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from embedding_cache.reader import EmbeddingReader
from pipeline.core.images import ImagePolicy, decode
from pipeline.core.sources import ImageReader
from train.config import TrainConfig, mask_settings
from train.data_index import TrainIndex
from train.masks import MaskConfig, Masks, sample_masks

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Third words of per-purpose generator seeds, so streams keyed by the same (seed, step) differ.
_ORDER_STREAM = 0x6F726465  # "orde"
_SAMPLE_STREAM = 0x73616D70  # "samp"
_SPLIT_STREAM = 0x73706C69  # "spli"
# The validation batch's masks: a step no run reaches.
VALIDATION_STEP = 2**62


def mask_config(cfg: TrainConfig) -> MaskConfig:
    return mask_settings(cfg)


def split_images(n: int, val_images: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out validation ids), a fixed random split keyed by the seed."""
    if n <= val_images:
        raise ValueError(f"only {n} images: cannot hold out {val_images} for validation (lower val_images)")
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n)
    return np.sort(order[val_images:]), np.sort(order[:val_images])


def crop_box(
    rng: np.random.Generator, width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """Random resized crop box (left, top, right, bottom): area fraction in `scale`, aspect w/h in `ratio`
    (log-uniform)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    # Fallback: the largest centred crop whose aspect lies in `ratio`.
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


@dataclass
class Batch:
    images: torch.Tensor  # uint8 [b, 3, H, W]
    context: torch.Tensor  # int64 [b, Lc]: each row's context patches, then padding
    context_lengths: torch.Tensor  # int64 [b]: real context patches of each row
    targets: torch.Tensor  # int64 [b, M, Lt]
    tokens: torch.Tensor | None  # float16 [b, N, S, d_text]
    lengths: torch.Tensor | None  # int64 [b, N]; 0 = no caption
    replaced: int  # images that could not be read or decoded and were replaced by another

    def pin_memory(self) -> Batch:
        """Page-locked copies, for asynchronous host-to-device copies (the DataLoader calls this on CUDA)."""
        tokens, lengths = self.tokens, self.lengths
        return Batch(
            self.images.pin_memory(),
            self.context.pin_memory(),
            self.context_lengths.pin_memory(),
            self.targets.pin_memory(),
            None if tokens is None else tokens.pin_memory(),
            None if lengths is None else lengths.pin_memory(),
            self.replaced,
        )

    def __len__(self) -> int:
        return self.images.shape[0]

    def rows(self, start: int, stop: int) -> Batch:
        """Rows `start:stop` (a micro-batch), the context cut to their longest: only padding is dropped."""
        lengths = self.context_lengths[start:stop]
        longest = int(lengths.max())
        tokens, caption_lengths = self.tokens, self.lengths
        return Batch(
            self.images[start:stop],
            self.context[start:stop, :longest],
            lengths,
            self.targets[start:stop],
            None if tokens is None else tokens[start:stop],
            None if caption_lengths is None else caption_lengths[start:stop],
            0,
        )

    def images_with_text(self) -> int:
        """Images with at least one caption: the regularisers' denominator (they average over such images)."""
        return 0 if self.lengths is None else int((self.lengths > 0).any(dim=1).sum())


def image_policy(image_size: int) -> ImagePolicy:
    """Decoding limits for images trained or evaluated at `image_size`: generous, but no decompression bombs."""
    return ImagePolicy(max_pixels=max(1024 * 1024, 4 * image_size**2))


class Normalise(torch.nn.Module):
    """uint8 `[b, 3, H, W]` → float, ImageNet mean/std (done on the device: 4× less to copy).

    The constants are buffers, moved to the device once: made afresh they would be a host-to-device copy, and a
    wait for it, every step.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std


def normalise(images: torch.Tensor) -> torch.Tensor:
    """`Normalise` for a one-off batch (evaluation); a loop keeps one `Normalise` on its device instead."""
    return Normalise().to(images.device)(images)


class StepBatches(torch.utils.data.Dataset):
    """Map-style dataset over steps: `dataset[step]` is this rank's `Batch` for that step."""

    def __init__(
        self,
        index: TrainIndex,
        image_ids: np.ndarray,
        cfg: TrainConfig,
        grid: tuple[int, int],
        rank: int = 0,
        world: int = 1,
    ) -> None:
        if cfg.batch_size % world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by {world} processes")
        self.index = index
        self.image_ids = np.asarray(image_ids, dtype=np.int64)
        self.cfg = cfg
        self.grid = grid
        self.local = cfg.batch_size // world
        self.rows = slice(rank * self.local, (rank + 1) * self.local)
        self.masks = mask_config(cfg)
        self.text = cfg.conditioning != "none" and cfg.store is not None
        self.policy = image_policy(cfg.image_size)
        self.caption_rows = self._locate_captions() if self.text else None
        self._train_pool = np.unique(self.image_ids)
        self._images: ImageReader | None = None
        self._store: EmbeddingReader | None = None

    def _locate_captions(self) -> np.ndarray:
        """Store row of every caption key in the index (resolved once; keys, not rows, are what the index keeps)."""
        rows = EmbeddingReader(self.cfg.text_store).locate(self.index.caption_keys)
        if (rows < 0).any():
            raise ValueError(
                f"{int((rows < 0).sum())} captions of the index are missing from {self.cfg.store}; rebuild the index"
            )
        return rows

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_images"] = state["_store"] = None
        return state

    def __len__(self) -> int:
        return self.cfg.steps

    @lru_cache(maxsize=2)  # noqa: B019 - one epoch's permutation, reused by every step of the epoch
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.seed, epoch, _ORDER_STREAM]).permutation(len(self.image_ids))

    def images_of_step(self, step: int) -> np.ndarray:
        """Index ids of this rank's samples at `step` (global positions step·B + j, epochs back to back)."""
        n = len(self.image_ids)
        positions = step * self.cfg.batch_size + np.arange(self.rows.start, self.rows.stop)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(positions // n).tolist():
            pick = positions // n == epoch
            out[pick] = self.image_ids[self._epoch_order(epoch)[positions[pick] % n]]
        return out

    def __getitem__(self, step: int) -> Batch:
        ids = self.images_of_step(step)
        positions = np.arange(self.rows.start, self.rows.stop)
        rngs = [np.random.default_rng([self.cfg.seed, step, int(j), _SAMPLE_STREAM]) for j in positions]
        masks = sample_masks(self.masks, self.grid, self.cfg.seed, step, self.cfg.batch_size, self.rows)
        return self.make_batch(ids, rngs, masks, self._train_pool)

    def validation_batch(self, image_ids: np.ndarray) -> Batch:
        """A fixed batch: whole images resized (no crop), masks from a step no run reaches, the first N captions."""
        ids = np.asarray(image_ids, dtype=np.int64)
        masks = sample_masks(self.masks, self.grid, self.cfg.seed, VALIDATION_STEP, len(ids))
        return self.make_batch(ids, [None] * len(ids), masks, np.unique(ids))

    def make_batch(
        self, ids: np.ndarray, rngs: Sequence[np.random.Generator | None], masks: Masks, pool: np.ndarray
    ) -> Batch:
        """Images `ids` (each replaced, when unusable, by the next usable image of `pool`), their captions, `masks`.

        A replaced image brings its own captions: pixels and text always belong to the same image.
        """
        images = np.empty((len(ids), 3, self.cfg.image_size, self.cfg.image_size), dtype=np.uint8)
        used = np.empty(len(ids), dtype=np.int64)
        for k, (i, rng) in enumerate(zip(ids.tolist(), rngs)):
            images[k], used[k] = self._image(i, rng, pool)
        replaced = int((used != ids).sum())
        tokens = lengths = None
        if self.text:
            tokens, lengths = self._captions(used, rngs)
        return Batch(
            torch.from_numpy(images),
            torch.from_numpy(masks.context),
            torch.from_numpy(masks.context_lengths),
            torch.from_numpy(masks.targets),
            tokens,
            lengths,
            replaced,
        )

    def _image(self, i: int, rng: np.random.Generator | None, pool: np.ndarray) -> tuple[np.ndarray, int]:
        """`[3, H, W]` uint8 pixels of image i and the id they come from: an image that is gone, unreadable or
        undecodable is replaced by the next usable one of `pool` (sorted ids of the same split, so a validation
        image never stands in for a training one; counted in `Batch.replaced`, logged as `images_replaced`)."""
        if self._images is None:
            self._images = ImageReader()
        start = int(np.searchsorted(pool, i))
        for attempt in range(len(pool)):
            j = int(pool[(start + attempt) % len(pool)])  # attempt 0 is i itself: `pool` holds every id asked for
            try:
                data = self._images.read(self.index.refs[j])
            except OSError:
                continue
            if hashlib.sha256(data).hexdigest() != self.index.sha256[j]:
                raise RuntimeError(
                    f"image {self.index.refs[j].source_id} changed since the training index was built; "
                    "delete the run's index.parquet to rebuild it"
                )
            im, _ = decode(data, self.policy)
            if im is not None:
                return self._transform(im, rng), j
        raise RuntimeError("no image of the training set can be read and decoded")

    def _transform(self, im: Image.Image, rng: np.random.Generator | None) -> np.ndarray:
        size = (self.cfg.image_size, self.cfg.image_size)
        if rng is None:
            out = im.resize(size, Image.Resampling.BICUBIC)
        else:
            box = crop_box(rng, im.width, im.height, self.cfg.crop_scale, self.cfg.crop_ratio)
            out = im.resize(size, Image.Resampling.BICUBIC, box=box)
            if self.cfg.hflip and rng.random() < 0.5:
                out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out, dtype=np.uint8).transpose(2, 0, 1)

    def _captions(
        self, ids: np.ndarray, rngs: Sequence[np.random.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to N caption token arrays per image (a random N when there are more), zero-padded to the batch's
        longest."""
        if self._store is None:
            self._store = EmbeddingReader(self.cfg.text_store)
        assert self.caption_rows is not None, "captions are read only by a run that reads text"
        n = self.cfg.captions_per_image
        offsets = self.index.caption_offsets
        chosen = np.full((len(ids), n), -1, dtype=np.int64)
        for k, (i, rng) in enumerate(zip(ids.tolist(), rngs)):
            rows = self.caption_rows[offsets[i] : offsets[i + 1]]
            if len(rows) > n:
                rows = rows[np.sort(rng.choice(len(rows), n, replace=False))] if rng is not None else rows[:n]
            chosen[k, : len(rows)] = rows
        flat, lengths = self._store.gather_padded(chosen.reshape(-1), max_len=self.cfg.max_words)
        tokens = torch.from_numpy(flat).view(len(ids), n, flat.shape[1], flat.shape[2])
        return tokens, torch.from_numpy(lengths).view(len(ids), n)
