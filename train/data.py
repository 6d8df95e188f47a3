"""Training batches: item `s` of `StepBatches` is this process's share of step s's global batch.

Everything random is keyed by (seed, step, global sample position): which image
(row block p of a step holds partition p's images, each partition's in a seeded order per pass over it, see
`train.partitions`), its crop, which of its captions, and the masks (drawn for the whole global batch, see
`train.masks`). A run is therefore reproducible, resumes at any step without replay, and gives every
sample the same crop, captions and masks whatever the number of processes.

Images are read through `pipeline.core.sources.ImageReader`; their sha256 is checked
when the index is built (and, with `verify_images`, once more before training), not on
every read. Caption token embeddings come from the memory-mapped `EmbeddingReader`; the
store is opened lazily in each worker (a memory map must not be pickled), its shard files mapped as they are read,
and read by the spans the index resolved once (no process here builds a key index). A batch's
captions are packed (tokens back to back, as stored: float16, or int8 with scales) into
tensors made in shared memory, so handing them to the main process copies nothing;
`train.step.to_device` moves them packed and pads them on the device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embedding_cache.reader import EmbeddingReader, Spans
from pipeline.core.errors import UserError
from pipeline.core.images import MIN_SIDE, ImagePolicy, open_image, oriented_size
from pipeline.core.sources import ImageReader
from train.config import TrainConfig, mask_settings
from train.data_index import TrainIndex
from train.images import EncodedImages, crop_resize, device_decodable
from train.masks import MaskConfig, Masks, padded_length, sample_masks
from train.partitions import PartitionSchedule

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The third word of the per-sample generators' seeds, so that they differ from other streams keyed by (seed, step).
_SAMPLE_STREAM = 0x73616D70  # "samp"
# The validation batch's masks: a step no run reaches.
VALIDATION_STEP = 2**62


def mask_config(cfg: TrainConfig) -> MaskConfig:
    return mask_settings(cfg)


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
    """A rank's share of a step, on the host. Captions are packed: `tokens` holds every caption's tokens back to back,
    image by image and, within an image, slot by slot (`lengths`, row-major, says how many each; a slot of length 0
    has no caption), as the store keeps them; `train.step.to_device` pads them on the device."""

    images: torch.Tensor  # uint8 [b, 3, H, W] (rows listed in `encoded` are filled on the device)
    context: torch.Tensor  # int64 [b, Lc]: each row's context patches, then padding
    context_lengths: torch.Tensor  # int64 [b]: real context patches of each row
    targets: torch.Tensor  # int64 [b, M, Lt]
    tokens: torch.Tensor | None  # float16 or int8 [sum of lengths, d_text]
    lengths: torch.Tensor | None  # int64 [b, N]; 0 = no caption
    replaced: int  # images that could not be read or decoded and were replaced by another
    scales: torch.Tensor | None = None  # float32 [sum of lengths]: int8 tokens' per-token scales
    channel_scales: torch.Tensor | None = None  # float32 [d_text]: an int8 store's per-channel pre-scaling
    encoded: EncodedImages | None = None  # `--decode gpu`: JPEGs decoded, cropped and resized on the device
    lease: torch.Tensor | None = None  # int64 [1] in shared memory: set while the worker's buffer is in use

    def release(self) -> None:
        """Hand the buffer the tensors are in back to the worker that filled it (it refills it for a later batch):
        called once they have been copied on, to pinned memory or to the device."""
        if self.lease is not None:
            self.lease.zero_()
            self.lease = None

    def pin_memory(self) -> Batch:
        """Page-locked copies, for asynchronous host-to-device copies (the DataLoader calls this on CUDA); the
        worker's buffer is released once copied."""

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        pinned = Batch(
            self.images.pin_memory(),
            self.context.pin_memory(),
            self.context_lengths.pin_memory(),
            self.targets.pin_memory(),
            pin(self.tokens),
            pin(self.lengths),
            self.replaced,
            pin(self.scales),
            pin(self.channel_scales),
            self.encoded,
        )
        self.release()
        return pinned

    def __len__(self) -> int:
        return self.images.shape[0]

    def token_offsets(self) -> torch.Tensor:
        """int64 `[b * N + 1]`: where each caption slot's tokens start in `tokens` (CSR offsets)."""
        assert self.lengths is not None, "a batch without text has no token offsets"
        offsets = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(self.lengths.reshape(-1), 0, out=offsets[1:])
        return offsets

    def rows(self, start: int, stop: int) -> Batch:
        """Rows `start:stop` (a micro-batch), the context cut to their longest (rounded up as `sample_masks` rounds
        it): only padding is dropped."""
        lengths = self.context_lengths[start:stop]
        longest = padded_length(int(lengths.max()))
        tokens, scales, caption_lengths = self.tokens, self.scales, self.lengths
        if caption_lengths is not None and tokens is not None:
            n = caption_lengths.shape[1]
            offsets = self.token_offsets()
            first, last = int(offsets[start * n]), int(offsets[stop * n])
            tokens = tokens[first:last]
            scales = None if scales is None else scales[first:last]
            caption_lengths = caption_lengths[start:stop]
        return Batch(
            self.images[start:stop],
            self.context[start:stop, :longest],
            lengths,
            self.targets[start:stop],
            tokens,
            caption_lengths,
            0,
            scales,
            self.channel_scales,
            None if self.encoded is None else self.encoded.select(start, stop),
        )  # no lease: the whole batch releases its buffer

    def images_with_text(self) -> int:
        """Images with at least one caption: the regularisers' denominator (they average over such images)."""
        return 0 if self.lengths is None else int((self.lengths > 0).any(dim=1).sum())


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor, made in shared memory when in a DataLoader worker: the batch is filled in place and
    handed to the main process as it is (a tensor in private memory would first be copied into shared memory)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


LEASE_BYTES = 64  # a buffer's lease word, padded so that what follows stays aligned


class BatchBuffers:
    """A worker's shared-memory buffers, one per batch in flight, reused once the main process lets go of them.

    Fresh shared memory costs, on every batch, its page faults and one file descriptor per tensor passed to the main
    process: at t5-large width more than copying the tokens themselves. Each buffer starts with a lease word, set
    when the buffer leaves in a batch (to the number of that take, from 1) and cleared by `Batch.release`. At most
    `keep` buffers are kept; when all are out, a batch gets a fresh one that is not kept.
    """

    def __init__(self, capacity: int, keep: int = 6) -> None:
        self.capacity = capacity
        self.keep = keep
        self.pool: list[torch.Tensor] = []  # uint8 [LEASE_BYTES + capacity], shared
        self.taken = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a free buffer's `capacity` bytes, its lease word, now set to this take's number)."""
        for buffer in self.pool:
            lease = buffer[:8].view(torch.int64)
            if int(lease[0]) == 0:
                break
        else:
            buffer = shared_empty((LEASE_BYTES + self.capacity,), torch.uint8)
            if len(self.pool) < self.keep:
                self.pool.append(buffer)
            lease = buffer[:8].view(torch.int64)
        self.taken += 1
        lease.fill_(self.taken)
        return buffer[LEASE_BYTES:], lease


def aligned(nbytes: int) -> int:
    return -(-nbytes // LEASE_BYTES) * LEASE_BYTES


class Arena:
    """A batch's tensors, carved one after another out of `space` (a leased buffer's bytes), or, without one,
    allocated as usual."""

    def __init__(self, space: torch.Tensor | None) -> None:
        self.space = space
        self.at = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.space is None:
            return torch.empty(shape, dtype=dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if self.at + nbytes > len(self.space):
            raise RuntimeError(f"a batch needs more than its buffer's {len(self.space)} bytes")
        view = self.space[self.at : self.at + nbytes].view(dtype).view(shape)
        self.at += aligned(nbytes)
        return view

    def copy(self, array: np.ndarray) -> torch.Tensor:
        source = torch.from_numpy(np.ascontiguousarray(array))
        return self.empty(tuple(source.shape), source.dtype).copy_(source)


def device_decoding(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether `--decode gpu` decodes on `device`; without CUDA it falls back to the CPU, saying so in one line."""
    if cfg.decode != "gpu":
        return False
    if device.type != "cuda":
        logger.warning(f"--decode gpu: no CUDA device ({device}); decoding images on the CPU")
        return False
    return True


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
    """Map-style dataset over steps: `dataset[step]` is this rank's `Batch` for that step.

    `image_ids` are the training images; `partition_of` gives each index image's partition (None: one partition).
    """

    def __init__(
        self,
        index: TrainIndex,
        image_ids: np.ndarray,
        cfg: TrainConfig,
        grid: tuple[int, int],
        rank: int = 0,
        world: int = 1,
        device_decode: bool = False,
        partition_of: np.ndarray | None = None,
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
        self.device_decode = device_decode
        self.caption_spans = self._locate_captions() if self.text else None
        self._segment_positions: np.ndarray | None = None  # index segment -> position in the opened store
        train = np.unique(self.image_ids)
        count = 1 if partition_of is None else cfg.partitions
        part = np.zeros(len(train), np.int64) if partition_of is None else np.asarray(partition_of)[train]
        self.schedule = PartitionSchedule([train[part == p] for p in range(count)], cfg.batch_size, cfg.seed)
        # An unusable image is replaced by one of its own partition (its node reads that partition's files).
        self._pools = [self.schedule.members[p] for p in self.schedule.partition_of_row(self.rows).tolist()]
        self._images: ImageReader | None = None
        self._store: EmbeddingReader | None = None
        self._buffers: BatchBuffers | None = None

    def _locate_captions(self) -> Spans:
        """Where every caption of the index lies in the store: the index's spans, resolved once when it was built."""
        spans = self.index.caption_spans
        if (spans.segment < 0).any():
            raise ValueError(
                f"{int((spans.segment < 0).sum())} captions of the index were not resolved in a store (built without "
                f"--store); delete the run's index.parquet to rebuild it with {self.cfg.store}"
            )
        return spans

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_images"] = state["_store"] = state["_buffers"] = None
        return state

    def __len__(self) -> int:
        return self.cfg.steps

    def images_of_step(self, step: int) -> np.ndarray:
        """Index ids of this rank's samples at `step`: its rows of the step's global batch."""
        return self.schedule.images(step, self.rows)

    def __getitem__(self, step: int) -> Batch:
        ids = self.images_of_step(step)
        positions = np.arange(self.rows.start, self.rows.stop)
        rngs = [np.random.default_rng([self.cfg.seed, step, int(j), _SAMPLE_STREAM]) for j in positions]
        masks = sample_masks(self.masks, self.grid, self.cfg.seed, step, self.cfg.batch_size, self.rows)
        return self.make_batch(ids, rngs, masks, self._pools)

    def validation_batch(self, image_ids: np.ndarray, rows: slice | None = None, within: slice | None = None) -> Batch:
        """Rows `rows` (default all) of the fixed validation batch of `image_ids`: whole images resized (no crop),
        masks from a step no run reaches (each row's those of the whole batch), the first N captions. An unusable
        image is replaced by one of the rows `within` (default all: its partition's)."""
        ids = np.asarray(image_ids, dtype=np.int64)
        rows = rows if rows is not None else slice(0, len(ids))
        masks = sample_masks(self.masks, self.grid, self.cfg.seed, VALIDATION_STEP, len(ids), rows)
        picked = ids[rows]
        pool = np.unique(ids[within if within is not None else slice(None)])
        return self.make_batch(picked, [None] * len(picked), masks, [pool] * len(picked))

    def make_batch(
        self, ids: np.ndarray, rngs: Sequence[np.random.Generator | None], masks: Masks, pools: Sequence[np.ndarray]
    ) -> Batch:
        """Images `ids` (each replaced, when unusable, by the next usable image of its row's pool), their captions,
        `masks`.

        A replaced image brings its own captions: pixels and text always belong to the same image.
        """
        size = self.cfg.image_size
        if self.text and self._store is None:
            self._store = EmbeddingReader(self.cfg.text_store)
            self._segment_positions = self._store.positions(self.index.segments, partial=True)
        space = lease = None
        if torch.utils.data.get_worker_info() is not None:  # in a DataLoader worker: one reused shared buffer
            if self._buffers is None:
                self._buffers = BatchBuffers(self._most_bytes(len(ids)))
            space, lease = self._buffers.take()
        arena = Arena(space)
        images = arena.empty((len(ids), 3, size, size), torch.uint8)
        encoded = EncodedImages([], [], [], [], self.cfg.device_resize)
        used = np.empty(len(ids), dtype=np.int64)
        for k, (i, rng, pool) in enumerate(zip(ids.tolist(), rngs, pools)):
            used[k] = self._image(i, rng, pool, images[k], encoded, k)
        replaced = int((used != ids).sum())
        batch = Batch(
            images,
            arena.copy(masks.context),
            arena.copy(masks.context_lengths),
            arena.copy(masks.targets),
            None,
            None,
            replaced,
            encoded=encoded.packed() if encoded.rows else None,
            lease=lease,
        )
        if self.text:
            batch.tokens, batch.scales, batch.lengths = self._captions(used, rngs, arena)
            store = self._store
            assert store is not None
            if store.channel_scales is not None:
                batch.channel_scales = torch.from_numpy(store.channel_scales)
        return batch

    def _most_bytes(self, b: int) -> int:
        """The largest buffer a batch of `b` images can fill: pixels, masks, and each caption at `max_words`."""
        size, patches, n = self.cfg.image_size, self.grid[0] * self.grid[1], self.cfg.captions_per_image
        context = b * padded_length(patches) * 8
        parts = [b * 3 * size * size, context, b * 8, b * self.cfg.num_targets * patches * 8, b * n * 8]
        if self._store is not None:
            tokens = b * n * self.cfg.max_words
            parts += [tokens * self._store.width * self._store.token_dtype.itemsize, tokens * 4]
        return sum(aligned(p) for p in parts)

    def _image(
        self,
        i: int,
        rng: np.random.Generator | None,
        pool: np.ndarray,
        out: torch.Tensor,
        encoded: EncodedImages,
        row: int,
    ) -> int:
        """Image i's sample written to `out` (uint8 `[3, H, W]`), or, decoded on the device, its JPEG bytes added to
        `encoded` as batch row `row`; returns the id the pixels come from. An image that is gone, unreadable or
        undecodable is replaced by the next usable one of `pool` (sorted ids of the same split, so a validation
        image never stands in for a training one; counted in `Batch.replaced`, logged as `images_replaced`).

        The crop (or, for validation, the whole image) is drawn from the header's size, before any pixel is decoded.
        """
        if self._images is None:
            self._images = ImageReader()
        start = int(np.searchsorted(pool, i))
        for attempt in range(len(pool)):
            j = int(pool[(start + attempt) % len(pool)])  # attempt 0 is i itself: `pool` holds every id asked for
            try:
                data = self._images.read(self.index.refs[j])
            except OSError:
                continue
            im, _ = open_image(data, MIN_SIDE)
            if im is None:
                continue
            upright = oriented_size(im)
            box = (0, 0, *upright)
            flip = False
            if rng is not None:
                box = crop_box(rng, *upright, self.cfg.crop_scale, self.cfg.crop_ratio)
                flip = self.cfg.hflip and rng.random() < 0.5
            if self.device_decode:
                if device_decodable(im, data):
                    encoded.rows.append(row)
                    encoded.data.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    encoded.boxes.append(box)
                    encoded.flips.append(flip)
                    return j
                _say_not_device_decodable(self.index.refs[j].source_id)
            pixels = crop_resize(im, upright, box, self.cfg.image_size, flip)
            if pixels is not None:
                out.copy_(pixels)
                return j
        raise RuntimeError("no image of the training set can be read and decoded")

    def _captions(
        self, ids: np.ndarray, rngs: Sequence[np.random.Generator | None], arena: Arena
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Up to N captions per image (a random N when there are more), packed as stored: tokens `[sum of lengths,
        d]` (float16, or int8), their scales (int8 stores), lengths `[b, N]` (0: no caption in that slot), each
        caption cut to `max_words`. The tokens are gathered once, straight into the batch's `arena` (in a DataLoader
        worker, a reused shared-memory buffer)."""
        store = self._store
        assert store is not None and self.caption_spans is not None, "captions are read only by a run that reads text"
        n = self.cfg.captions_per_image
        offsets = self.index.caption_offsets
        chosen = np.full((len(ids), n), -1, dtype=np.int64)  # caption numbers in the index; -1: none
        for k, (i, rng) in enumerate(zip(ids.tolist(), rngs)):
            numbers = np.arange(offsets[i], offsets[i + 1])
            if len(numbers) > n:
                picked = np.sort(rng.choice(len(numbers), n, replace=False)) if rng is not None else np.arange(n)
                numbers = numbers[picked]
            chosen[k, : len(numbers)] = numbers
        spans = self._spans_of(chosen.reshape(-1))
        lengths = np.minimum(spans.length, self.cfg.max_words).astype(np.int64)
        present = spans.segment >= 0
        dtype = torch.from_numpy(np.empty(0, dtype=store.token_dtype)).dtype
        tokens = arena.empty((int(lengths.sum()), store.width), dtype)
        scales = arena.empty((int(lengths.sum()),), torch.float32) if store.codec == "int8" else None
        store.gather_spans_raw(
            Spans(spans.segment[present], spans.start[present], spans.length[present]),
            max_len=self.cfg.max_words,
            out_tokens=tokens.numpy(),
            out_scales=None if scales is None else scales.numpy(),
        )
        return tokens, scales, arena.copy(lengths.reshape(len(ids), n))

    def _spans_of(self, numbers: np.ndarray) -> Spans:
        """The spans of caption `numbers` of the index (-1: no caption, segment -1 and length 0), their segments as
        positions in the opened store."""
        assert self.caption_spans is not None and self._segment_positions is not None
        spans, present = self.caption_spans, numbers >= 0
        if not present.any():
            none = np.full(len(numbers), -1, np.int32)
            return Spans(none, np.zeros(len(numbers), np.int64), np.zeros(len(numbers), np.int32))
        picked = np.where(present, numbers, 0)
        segment = np.where(present, self._segment_positions[spans.segment[picked]], -1).astype(np.int32)
        absent = present & (segment < 0)
        if absent.any():
            name = self.index.segments[int(spans.segment[picked[absent][0]])]
            raise UserError(
                f"{self.cfg.text_store} does not hold segment {name}, which the run index reads; the store was changed "
                "since the index was made (delete the run's index.parquet to rebuild it), or a mirror was cut short"
            )
        return Spans(segment, spans.start[picked], np.where(present, spans.length[picked], 0).astype(np.int32))


_told_not_jpeg = False


def _say_not_device_decodable(source_id: str) -> None:
    """One stderr line per process the first time `--decode gpu` meets an image the device decoder is not given."""
    global _told_not_jpeg
    if not _told_not_jpeg:
        logger.warning(
            f"--decode gpu: {source_id} is not a JPEG the device decodes (not JPEG, CMYK, EXIF-rotated, or not ending"
            " at its end-of-image marker: cut short or with data appended); such images are decoded on the CPU"
        )
        _told_not_jpeg = True
