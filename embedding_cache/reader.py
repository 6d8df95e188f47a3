"""Read caption token embeddings from a store by memory-mapping its shard files.

zarr's own read path costs about a millisecond of CPU per chunk, far too slow for
a trainer that fetches thousands of small captions per step. The store's
`tokens` (and, for int8 stores, `scales`) arrays are uncompressed and sharded, and
a zarr v3 shard file is the raw inner chunks followed by an index of little-endian
``uint64[n_chunks, 2]`` (offset, nbytes) and a crc32c. This reader parses that
index once and serves each caption as a zero-copy view into the mapped file. Only
segments listed in the store's root attributes are read; each array's recorded
data type must be the one the store's codec stores there.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.codec import dequantize_numpy
from embedding_cache.store import EmbeddingStore
from pipeline.core.digests import DigestIndex, as_digests
from pipeline.core.errors import UserError

MISSING = np.uint64(2**64 - 1)
DEFAULT_MAX_OPEN_FILES = 256  # mapped shard files a reader keeps open at most (the usual limit is 1,024 per process)


class OpenFiles:
    """Shard files mapped on demand, at most `limit` at a time, the least recently used dropped first.

    A mapped file holds a file descriptor until the map and every view into it are gone. Each file is owned by the
    array it belongs to, which keeps its chunk views and drops them when told here; the reader keeps no view beyond
    a call, so what it holds is bounded by `limit` (views a caller keeps, e.g. from `get`, keep their file open).
    """

    def __init__(self, limit: int = DEFAULT_MAX_OPEN_FILES) -> None:
        if limit < 1:
            raise ValueError(f"max_open_files must be at least 1, not {limit}")
        self.limit = limit
        self.opened = 0  # files mapped so far (a file dropped and needed again counts again)
        self._drop: OrderedDict[tuple[int, int], Callable[[], None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._drop)

    def touch(self, key: tuple[int, int]) -> None:
        """`key`'s file was used now."""
        self._drop.move_to_end(key)

    def add(self, key: tuple[int, int], drop: Callable[[], None]) -> None:
        """A file was mapped under `key`; `drop` lets go of it (its owner's views) when it is the oldest of too many."""
        self.opened += 1
        self._drop[key] = drop
        while len(self._drop) > self.limit:
            _, oldest = self._drop.popitem(last=False)
            oldest()


@dataclass
class _Array:
    """One sharded, uncompressed array of a segment: its layout read once, each shard file mapped when a row of it is
    read (through `OpenFiles`, which bounds how many stay mapped). A zarr v3 shard is its inner chunks, then
    ``uint64[n_chunks, 2]`` (offset, nbytes) and a crc32c."""

    directory: Path
    dtype: np.dtype
    row_shape: tuple[int, ...]
    chunk_rows: int
    shard_rows: int
    n_chunks: int
    separator: str
    files: OpenFiles
    views: dict[int, list[np.ndarray | None]] = field(default_factory=dict)  # mapped shard -> its chunks

    def rows(self, start: int, stop: int) -> np.ndarray:
        """array[start:stop]: a view into the mapped shard when it lies in one inner chunk, else a copy."""
        if stop <= start:
            return np.zeros((0, *self.row_shape), dtype=self.dtype)
        first, last = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        if first == last:
            base = first * self.chunk_rows
            return self._chunk(first)[start - base : stop - base]
        parts = []
        for c in range(first, last + 1):
            base = c * self.chunk_rows
            parts.append(self._chunk(c)[max(start - base, 0) : min(stop - base, self.chunk_rows)])
        return np.concatenate(parts)

    def _chunk(self, c: int) -> np.ndarray:
        shard, k = divmod(c, self.shard_rows // self.chunk_rows)
        chunks = self.views.get(shard)
        if chunks is None:
            chunks = self._map(shard)
        else:
            self.files.touch((id(self), shard))
        chunk = chunks[k]
        if chunk is None:
            raise UserError(f"{self.directory}: inner chunk {c} is missing; run `tcjepa store verify`")
        return chunk

    def _map(self, shard: int) -> list[np.ndarray | None]:
        """Map shard file `shard` and view each of its inner chunks."""
        per_shard = self.shard_rows // self.chunk_rows
        path = self.directory / self.separator.join(["c", str(shard), *(["0"] * len(self.row_shape))])
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        index = shard_index(path, mapped, per_shard)
        chunk_bytes = self.chunk_rows * int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        chunks: list[np.ndarray | None] = []
        for k in range(min(per_shard, self.n_chunks - shard * per_shard)):
            offset, nbytes = (int(v) for v in index[k])
            if offset == int(MISSING):
                chunks.append(None)
                continue
            if nbytes != chunk_bytes:
                raise UserError(f"{path}: inner chunk {k} has {nbytes} bytes, expected {chunk_bytes} (compressed?)")
            raw = mapped[offset : offset + chunk_bytes].view(self.dtype.newbyteorder("<"))
            # a plain ndarray over the map (np.memmap's Python-level slicing costs more than the copy of a caption)
            chunks.append(np.asarray(raw).reshape(self.chunk_rows, *self.row_shape))
        self.views[shard] = chunks
        self.files.add((id(self), shard), functools.partial(self._unmap, shard))
        return chunks

    def _unmap(self, shard: int) -> None:
        self.views.pop(shard, None)  # the file closes with its last view


def shard_index(path: Path, shard: np.ndarray, chunks: int) -> np.ndarray:
    """The `uint64[chunks, 2]` (offset, nbytes) index at the end of a zarr v3 shard file's bytes `shard`, checked
    against the crc32c stored after it (numcodecs' CRC32C, the codec zarr wrote it with): a damaged index would
    point a read at the wrong bytes, so it is refused in one line."""
    # Imported here: the trainer's step modules import this one, and runs without a store (the GPU check's machine
    # has no numcodecs) never map a shard.
    from numcodecs import CRC32C

    encoded = np.asarray(shard[-(16 * chunks + 4) :])
    if len(encoded) != 16 * chunks + 4:
        raise UserError(f"{path}: shorter than its shard index; the file is damaged (run `tcjepa store verify`)")
    try:
        CRC32C().decode(encoded)
    except RuntimeError:
        raise UserError(
            f"{path}: its shard index fails its crc32c; the file is damaged (run `tcjepa store verify`)"
        ) from None
    return np.frombuffer(encoded[:-4], dtype="<u8").reshape(chunks, 2)


def open_array(array_dir: Path, dtype: np.dtype, row_shape: tuple[int, ...], files: OpenFiles) -> _Array:
    """The layout of a sharded, uncompressed array of `dtype` with rows of `row_shape`; no shard is mapped yet.

    The array's recorded data type must be `dtype`: int8 tokens are never read as float16, nor the reverse.
    """
    meta = json.loads((array_dir / "zarr.json").read_text())
    shape = meta["shape"]
    (codec,) = meta["codecs"]
    config = codec["configuration"]
    inner_codecs = [c["name"] for c in config["codecs"]]
    index_codecs = [c["name"] for c in config["index_codecs"]]
    if meta["data_type"] != dtype.name:
        raise UserError(
            f"{array_dir}: holds {meta['data_type']}, but the store's codec stores {dtype.name} here; the store is "
            "inconsistent (run `tcjepa store verify`)"
        )
    if (
        codec["name"] != "sharding_indexed"
        or inner_codecs != ["bytes"]
        or config["codecs"][0].get("configuration", {}).get("endian", "little") != "little"
        or index_codecs != ["bytes", "crc32c"]
        or config.get("index_location", "end") != "end"
    ):
        raise UserError(f"{array_dir}: must be uncompressed and sharded with the index at the end")
    shard_rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    chunk_rows, *chunk_rest = config["chunk_shape"]
    if tuple(chunk_rest) != row_shape or tuple(shape[1:]) != row_shape:
        raise UserError(f"{array_dir}: rows of shape {shape[1:]} do not match the store's {list(row_shape)}")
    sep = meta["chunk_key_encoding"].get("configuration", {}).get("separator", "/")
    return _Array(array_dir, dtype, row_shape, chunk_rows, shard_rows, -(-shape[0] // chunk_rows), sep, files)


@dataclass(frozen=True)
class Spans:
    """Where captions lie in a store, one entry per caption: the segment (a position in a list of segment ids),
    its first token row in that segment's `tokens`, and its token count. Three flat columns, no per-caption object:
    a trainer resolves them once (rank 0, into the run index) and reads tokens with them, never a key."""

    segment: np.ndarray  # int32
    start: np.ndarray  # int64
    length: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.segment)


class StoreKeys:
    """Where each caption key lives in a store (global row, segment), read from the keys alone.

    No token is read, so a *keys mirror* of a remote store is enough: training builds its
    index from one and then fetches only the segments that hold its captions. Building the
    index costs a pass over every key; `StoreKeys.builds` counts them in this process, so a
    test can tell that a training worker built none.
    """

    builds = 0

    def __init__(self, store: EmbeddingStore) -> None:
        StoreKeys.builds += 1
        self.store = store
        self.segment_ids = store.segment_ids()
        # One run of every segment's keys, sorted once: merging a run per segment costs 2x at 4,000 segments.
        parts = [as_digests(store.read_keys(seg_id)) for seg_id in self.segment_ids]
        self.starts = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in parts], out=self.starts[1:])
        index = DigestIndex()
        if parts:
            keys = np.concatenate(parts)
            parts.clear()  # the segments' copies freed before the sort, which needs twice the keys again
            index.add(keys)
        self._index: DigestIndex | None = index

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """Global row of each 32-byte key (`[n, 32]` uint8), or -1 when the store lacks it."""
        if self._index is None:
            raise RuntimeError("StoreKeys.locate after drop_key_index")
        return self._index.lookup(keys)

    def drop_key_index(self) -> None:
        """Free the key index (32 bytes a stored key) once every key is located: `spans_of_rows` needs only the
        segments' extents, and rank 0 makes the run index's columns next."""
        self._index = None

    def _held(self, keys: np.ndarray) -> np.ndarray:
        """The global row of each key; every key must be there."""
        rows = self.locate(keys)
        if (rows < 0).any():
            raise UserError(
                f"{int((rows < 0).sum())} caption keys are not in the store (it was changed since the index was made)"
            )
        return rows

    def _segments_of(self, rows: np.ndarray) -> np.ndarray:
        """Each global row's segment position. For many rows, a gather from a table of every stored row's segment
        (2 bytes a stored row up to 32,767 segments, 4 beyond; freed on return): at 10⁷ rows in 4,000 segments 0.12 s
        against 1.1 s for a binary search over the segments' starts, whose branches a random row mispredicts at
        every level."""
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows out of range for a store of {len(self)} captions")
        if len(rows) < len(self) // 4:
            return np.searchsorted(self.starts, rows, side="right") - 1
        kind = np.int16 if len(self.segment_ids) <= np.iinfo(np.int16).max else np.int32
        table = np.repeat(np.arange(len(self.segment_ids), dtype=kind), np.diff(self.starts))
        return table[rows]

    def segments_holding(self, keys: np.ndarray) -> list[str]:
        """The segments that hold `keys`, in store order; every key must be there."""
        segs = self._segments_of(self._held(keys))
        return [self.segment_ids[i] for i in np.unique(segs).tolist()]

    def spans(self, keys: np.ndarray) -> tuple[list[str], Spans]:
        """The segments that hold `keys` (in store order) and each key's span, its segment a position in that list.

        Reads the offsets of those segments (a keys mirror carries them); every key must be in the store.
        """
        return self.spans_of_rows(self._held(keys))

    def spans_of_rows(self, rows: np.ndarray) -> tuple[list[str], Spans]:
        """`spans` of the keys at global `rows` (`locate`'s, none of them -1: refused), without looking them up again.

        The held segments' offsets are laid end to end (memory for those segments' rows only, so a lookup of one
        row reads one segment's), and each key's span is two gathers: no sort and no pass per segment over the keys
        (3.5 s → 0.8 s at 10⁷ keys in 4,000 segments)."""
        rows = np.asarray(rows, dtype=np.int64)
        segs = self._segments_of(rows)
        held = np.flatnonzero(np.bincount(segs, minlength=len(self.segment_ids)))
        sizes = self.starts[held + 1] - self.starts[held]
        place = np.cumsum(sizes) - sizes  # each held segment's first row in `first` and `lengths`
        # a row's place there is the row plus its segment's shift: one gather from a table of a few thousand entries
        shift = np.zeros(len(self.segment_ids), dtype=np.int64)
        shift[held] = place - self.starts[held]
        first = np.empty(int(sizes.sum()), dtype=np.int64)
        lengths = np.empty(len(first), dtype=np.int32)
        for seg, lo, n in zip(held.tolist(), place.tolist(), sizes.tolist()):
            offsets = self.store.read_offsets(self.segment_ids[seg]).astype(np.int64)
            first[lo : lo + n] = offsets[:-1]
            lengths[lo : lo + n] = np.diff(offsets)
        at = shift[segs]
        at += rows
        position = np.zeros(len(self.segment_ids), dtype=np.int32)
        position[held] = np.arange(len(held), dtype=np.int32)
        spans = Spans(position[segs], first[at], lengths[at])
        return [self.segment_ids[i] for i in held.tolist()], spans


class EmbeddingReader:
    """Reads `[length, width]` token vectors of a store, without zarr on the read path.

    Opening it reads only the store's root: shard files are mapped when first read, at most `max_open_files` at a
    time (least recently used dropped first), and the key index (`keys`, `locate`) and the row table (`len`,
    global rows) are built only when asked for. A trainer reads by `Spans` (`gather_spans_*`), which need neither.

    float16 stores are served as they are. For int8 stores, `get`, `gather_packed`, `gather_padded` and
    `gather_spans_padded` return float16 dequantized on the CPU; the `*_raw` methods return the stored int8 tokens
    and float32 scales, for a trainer that ships them to the device and expands them there with
    `embedding_cache.codec.dequantize` (with `channel_scales`).
    """

    def __init__(self, path: str | Path, max_open_files: int = DEFAULT_MAX_OPEN_FILES) -> None:
        store = EmbeddingStore(path)
        self.root = Path(path)
        self.width = store.width
        self.encoder: dict[str, Any] = store.encoder
        self.encoder_hash = store.encoder_hash
        self.codec: str = store.codec
        transform = store.transform
        self.token_dtype: np.dtype = transform.token_dtype
        # float32 [width] or None: the last factor of `dequantize` (the same for every segment of the store)
        self.channel_scales: np.ndarray | None = transform.channel_scales
        self.segment_ids = store.segment_ids()
        self.files = OpenFiles(max_open_files)
        self._store = store
        self._position = {seg_id: i for i, seg_id in enumerate(self.segment_ids)}
        self._arrays: dict[int, tuple[_Array, _Array | None]] = {}
        self._keys: StoreKeys | None = None
        self._row_table: tuple[np.ndarray, list[np.ndarray], np.ndarray] | None = None

    @property
    def keys(self) -> StoreKeys:
        """The key index, built on first use (a pass over every key of the store)."""
        if self._keys is None:
            self._keys = StoreKeys(self._store)
        return self._keys

    def positions(self, segment_ids: Sequence[str], partial: bool = False) -> np.ndarray:
        """The position in this store of each of `segment_ids` (int32); each must be published here, unless
        `partial` (a node's mirror of its partitions' segments): then -1 for one it does not hold."""
        if partial:
            return np.asarray([self._position.get(s, -1) for s in segment_ids], dtype=np.int32)
        missing = [s for s in segment_ids if s not in self._position]
        if missing:
            raise UserError(
                f"{self.root} no longer holds {len(missing)} segment(s) the run index refers to (e.g. {missing[0]}); "
                "the store was changed since the index was made: delete the run's index.parquet to rebuild it"
            )
        return np.asarray([self._position[s] for s in segment_ids], dtype=np.int32)

    def _arrays_of(self, seg: int) -> tuple[_Array, _Array | None]:
        """Segment `seg`'s tokens (and int8 scales) layout, read on first use."""
        arrays = self._arrays.get(seg)
        if arrays is None:
            where = self._store.segment_path(self.segment_ids[seg])
            tokens = open_array(where / "tokens", self.token_dtype, (self.width,), self.files)
            scales = None
            if self.codec == "int8":
                scales = open_array(where / "scales", np.dtype(np.float32), (), self.files)
                if scales.chunk_rows != tokens.chunk_rows:
                    raise UserError(f"{where}: scales are chunked unlike tokens; the segment was not written by tcjepa")
            arrays = self._arrays[seg] = (tokens, scales)
        return arrays

    def _rows(self) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(first global row of each segment + total, each segment's offsets, each row's length), read on first
        use: global rows are for tools and tests; a trainer reads by spans."""
        if self._row_table is None:
            offsets = [self._store.read_offsets(s).astype(np.int64) for s in self.segment_ids]
            starts = np.zeros(len(offsets) + 1, dtype=np.int64)
            np.cumsum([len(o) - 1 for o in offsets], out=starts[1:])
            lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, dtype=np.int64)
            self._row_table = (starts, offsets, lengths.astype(np.int32))
        return self._row_table

    def __len__(self) -> int:
        return int(self._rows()[0][-1])

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """Global row of each 32-byte key (`[n, 32]` uint8), or -1 when the store lacks it."""
        return self.keys.locate(keys)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """Token count of each global row."""
        return self._rows()[2][np.asarray(rows, dtype=np.int64)]

    def spans_of_rows(self, rows: np.ndarray) -> Spans:
        """The span of each global row, its segment a position in `segment_ids`."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows out of range for a store of {len(self)} captions")
        starts, offsets, lengths = self._rows()
        segs = np.searchsorted(starts, rows, side="right") - 1
        local = rows - starts[segs]
        first = np.empty(len(rows), dtype=np.int64)
        for seg in np.unique(segs).tolist():
            pick = segs == seg
            first[pick] = offsets[seg][local[pick]]
        return Spans(segs.astype(np.int32), first, lengths[rows])

    def _span_raw(self, seg: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        tokens, scales = self._arrays_of(seg)
        return tokens.rows(start, stop), None if scales is None else scales.rows(start, stop)

    def get_raw(self, row: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One caption as stored: tokens `[length, width]` (a read-only view into the mapped shard when possible),
        and its float32 scales `[length]` (int8) or None (float16)."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for a store of {len(self)} captions")
        span = self.spans_of_rows(np.array([row]))
        start = int(span.start[0])
        return self._span_raw(int(span.segment[0]), start, start + int(span.length[0]))

    def get(self, row: int) -> np.ndarray:
        """Token vectors of one caption as float16 (for a float16 store, a view into the mapped shard when
        possible)."""
        tokens, scales = self.get_raw(row)
        return dequantize_numpy(tokens, scales, self.channel_scales)

    def get_key(self, key: bytes) -> np.ndarray:
        row = int(self.locate(np.frombuffer(key, dtype=np.uint8).reshape(1, -1))[0])
        if row < 0:
            raise KeyError(key.hex())
        return self.get(row)

    def gather_spans_raw(
        self,
        spans: Spans,
        max_len: int | None = None,
        out_tokens: np.ndarray | None = None,
        out_scales: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Captions as stored, concatenated: tokens `[sum of lengths, width]` (int8 or float16, `token_dtype`),
        scales float32 `[sum of lengths]` (int8) or None (float16), and CSR offsets int64 `[n + 1]`. Each caption
        keeps at most its first `max_len` tokens; `spans.segment` are positions in `segment_ids`.

        Nothing is dequantized: vector = tokens * scales[:, None] * channel_scales, which
        `embedding_cache.codec.dequantize` computes on the device. `out_tokens` / `out_scales` (e.g. the numpy views
        of pinned or shared torch buffers, at least as many rows as the captions' tokens) are filled in place, and
        the views of their leading rows returned, so a batch is copied once.
        """
        lengths = spans.length.astype(np.int64)
        if max_len is not None:
            lengths = np.minimum(lengths, max_len)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        tokens = _buffer(out_tokens, total, (self.width,), self.token_dtype, "out_tokens")
        scales = None
        if self.codec == "int8":
            scales = _buffer(out_scales, total, (), np.dtype(np.float32), "out_scales")
        arrays, arrays_of = self._arrays, self._arrays_of
        for seg, start, lo, hi in zip(
            spans.segment.tolist(), spans.start.tolist(), offsets[:-1].tolist(), offsets[1:].tolist()
        ):
            seg_tokens, seg_scales = arrays.get(seg) or arrays_of(seg)
            tokens[lo:hi] = seg_tokens.rows(start, start + hi - lo)
            if scales is not None and seg_scales is not None:
                scales[lo:hi] = seg_scales.rows(start, start + hi - lo)
        return tokens, scales, offsets

    def gather_spans_padded(self, spans: Spans, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stack captions into `[n, L, d]` float16 zero-padded (L = longest, capped at `max_len`) plus lengths.

        A span whose segment is -1 (no caption) yields length 0.
        """
        present = spans.segment >= 0
        lengths = np.where(present, spans.length, 0).astype(np.int64)
        if max_len is not None:
            lengths = np.minimum(lengths, max_len)
        out = np.zeros((len(lengths), int(lengths.max(initial=1)) or 1, self.width), dtype=np.float16)
        for i in np.flatnonzero(present).tolist():
            start = int(spans.start[i])
            tokens, scales = self._span_raw(int(spans.segment[i]), start, start + int(lengths[i]))
            out[i, : lengths[i]] = dequantize_numpy(tokens, scales, self.channel_scales)
        return out, lengths

    def gather_packed_raw(
        self,
        rows: np.ndarray,
        max_len: int | None = None,
        out_tokens: np.ndarray | None = None,
        out_scales: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """`gather_spans_raw` of global rows."""
        return self.gather_spans_raw(self.spans_of_rows(rows), max_len, out_tokens, out_scales)

    def gather_packed(self, rows: np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate captions (each cut to `max_len` tokens) into one `[sum of lengths, d]` float16 array plus CSR
        offsets `[n + 1]`."""
        tokens, scales, offsets = self.gather_packed_raw(rows, max_len)
        return dequantize_numpy(tokens, scales, self.channel_scales), offsets

    def gather_padded(self, rows: np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`gather_spans_padded` of global rows; a row of -1 (no caption) yields length 0."""
        rows = np.asarray(rows, dtype=np.int64)
        present = rows >= 0
        spans = Spans(np.full(len(rows), -1, np.int32), np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int32))
        found = self.spans_of_rows(rows[present])
        for column, values in (
            (spans.segment, found.segment),
            (spans.start, found.start),
            (spans.length, found.length),
        ):
            column[present] = values
        return self.gather_spans_padded(spans, max_len)


def _buffer(given: np.ndarray | None, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    """A new `[rows, *row_shape]` array, or the leading rows of `given` after checking it fits."""
    if given is None:
        return np.empty((rows, *row_shape), dtype=dtype)
    if given.dtype != dtype or given.shape[1:] != row_shape or len(given) < rows:
        raise ValueError(
            f"{name}: {given.dtype}{list(given.shape)} cannot hold {rows} rows of {dtype}{list(row_shape)}"
        )
    return given[:rows]
