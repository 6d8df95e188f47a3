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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.codec import dequantize_numpy
from embedding_cache.store import EmbeddingStore
from pipeline.core.digests import DigestIndex
from pipeline.core.errors import UserError

MISSING = np.uint64(2**64 - 1)


@dataclass
class _Chunks:
    """The inner chunks of one sharded array, each a view into its mapped shard file (None: a missing chunk)."""

    chunk_rows: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    chunks: list[np.ndarray | None]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """array[start:stop] as a view when it lies in one inner chunk, else a copy."""
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
        chunk = self.chunks[c]
        if chunk is None:
            raise UserError(f"embedding store chunk {c} is missing; run `tcjepa store verify`")
        return chunk


@dataclass
class _Segment:
    offsets: np.ndarray
    tokens: _Chunks
    scales: _Chunks | None  # int8 stores


def map_chunks(array_dir: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> _Chunks:
    """Memory-map every inner chunk of a sharded, uncompressed array of `dtype` with rows of `row_shape`.

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
    per_shard = shard_rows // chunk_rows
    n_chunks = -(-shape[0] // chunk_rows)
    chunk_bytes = chunk_rows * int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    chunks: list[np.ndarray | None] = []
    for s in range(-(-shape[0] // shard_rows)):
        path = array_dir / sep.join(["c", str(s), *(["0"] * len(row_shape))])
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        index = np.frombuffer(mapped[-(16 * per_shard + 4) : -4], dtype="<u8").reshape(per_shard, 2)
        for k in range(min(per_shard, n_chunks - s * per_shard)):
            offset, nbytes = index[k]
            if offset == MISSING:
                chunks.append(None)
                continue
            if nbytes != chunk_bytes:
                raise UserError(f"{path}: inner chunk {k} has {nbytes} bytes, expected {chunk_bytes} (compressed?)")
            raw = mapped[int(offset) : int(offset) + chunk_bytes]
            chunks.append(raw.view(dtype.newbyteorder("<")).reshape(chunk_rows, *row_shape))
    return _Chunks(chunk_rows, row_shape, dtype, chunks)


class StoreKeys:
    """Where each caption key lives in a store (global row, segment), read from the keys alone.

    No token is read, so a *keys mirror* of a remote store is enough: training builds its
    index from one and then fetches only the segments that hold its captions.
    """

    def __init__(self, store: EmbeddingStore) -> None:
        self.segment_ids = store.segment_ids()
        self._index = DigestIndex()
        starts = [0]
        for seg_id in self.segment_ids:
            keys = store.read_keys(seg_id)
            self._index.add(keys, np.arange(len(keys), dtype=np.int64) + starts[-1])
            starts.append(starts[-1] + len(keys))
        self.starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """Global row of each 32-byte key (`[n, 32]` uint8), or -1 when the store lacks it."""
        return self._index.lookup(keys)

    def segments_holding(self, keys: np.ndarray) -> list[str]:
        """The segments that hold `keys`, in store order; every key must be there."""
        rows = self.locate(keys)
        if (rows < 0).any():
            raise UserError(
                f"{int((rows < 0).sum())} caption keys are not in the store (it was changed since the index was made)"
            )
        held = np.unique(np.searchsorted(self.starts, rows, side="right") - 1)
        return [self.segment_ids[i] for i in held.tolist()]


class EmbeddingReader:
    """Maps caption keys to `[length, width]` token vectors of a store, without zarr on the read path.

    float16 stores are served as they are. For int8 stores, `get`, `gather_packed` and `gather_padded` return float16
    dequantized on the CPU; `gather_packed_raw` returns the stored int8 tokens and float32 scales, for a trainer that
    ships them to the device and expands them there with `embedding_cache.codec.dequantize` (with
    `channel_scales`).
    """

    def __init__(self, path: str | Path) -> None:
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
        self.keys = StoreKeys(store)
        self.segment_ids = self.keys.segment_ids
        self._segments: list[_Segment] = []
        lengths = []
        for seg_id in self.segment_ids:
            offsets = store.read_offsets(seg_id)
            where = store.segment_path(seg_id)
            tokens = map_chunks(where / "tokens", self.token_dtype, (self.width,))
            scales = map_chunks(where / "scales", np.dtype(np.float32), ()) if self.codec == "int8" else None
            if scales is not None and scales.chunk_rows != tokens.chunk_rows:
                raise UserError(f"{where}: scales are chunked unlike tokens; the segment was not written by tcjepa")
            self._segments.append(_Segment(offsets, tokens, scales))
            lengths.append(np.diff(offsets).astype(np.int32))
        self._starts = self.keys.starts.tolist()
        self._starts_arr = self.keys.starts
        self._lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.keys)

    def locate(self, keys: np.ndarray) -> np.ndarray:
        """Global row of each 32-byte key (`[n, 32]` uint8), or -1 when the store lacks it."""
        return self.keys.locate(keys)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """Token count of each global row."""
        return self._lengths[np.asarray(rows, dtype=np.int64)]

    def get_raw(self, row: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One caption as stored: tokens `[length, width]` (a read-only view into the mapped shard when possible),
        and its float32 scales `[length]` (int8) or None (float16)."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for a store of {len(self)} captions")
        seg = int(np.searchsorted(self._starts_arr, row, side="right")) - 1
        segment = self._segments[seg]
        local = row - self._starts[seg]
        start, stop = int(segment.offsets[local]), int(segment.offsets[local + 1])
        scales = None if segment.scales is None else segment.scales.rows(start, stop)
        return segment.tokens.rows(start, stop), scales

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

    def _resolve(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segment index and token span (start, stop) of each global row, vectorised."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows out of range for a store of {len(self)} captions")
        segs = np.searchsorted(self._starts_arr, rows, side="right") - 1
        local = rows - self._starts_arr[segs]
        starts = np.empty(len(rows), dtype=np.int64)
        stops = np.empty(len(rows), dtype=np.int64)
        for seg in np.unique(segs).tolist():
            pick = segs == seg
            offsets = self._segments[seg].offsets
            starts[pick] = offsets[local[pick]]
            stops[pick] = offsets[local[pick] + 1]
        return segs, starts, stops

    def gather_packed_raw(
        self,
        rows: np.ndarray,
        max_len: int | None = None,
        out_tokens: np.ndarray | None = None,
        out_scales: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Captions as stored, concatenated: tokens `[sum of lengths, width]` (int8 or float16, `token_dtype`),
        scales float32 `[sum of lengths]` (int8) or None (float16), and CSR offsets int64 `[n + 1]`. Each caption
        keeps at most its first `max_len` tokens.

        Nothing is dequantized: vector = tokens * scales[:, None] * channel_scales, which
        `embedding_cache.codec.dequantize` computes on the device. `out_tokens` / `out_scales` (e.g. the numpy views
        of pinned or shared torch buffers, at least `lengths(rows).sum()` rows) are filled in place, and the views of
        their leading rows returned, so a batch is copied once.
        """
        segs, starts, stops = self._resolve(rows)
        if max_len is not None:
            stops = np.minimum(stops, starts + max_len)
        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=offsets[1:])
        total = int(offsets[-1])
        tokens = _buffer(out_tokens, total, (self.width,), self.token_dtype, "out_tokens")
        scales = None
        if self.codec == "int8":
            scales = _buffer(out_scales, total, (), np.dtype(np.float32), "out_scales")
        segments = self._segments
        for seg, start, stop, lo, hi in zip(
            segs.tolist(), starts.tolist(), stops.tolist(), offsets[:-1].tolist(), offsets[1:].tolist()
        ):
            segment = segments[seg]
            tokens[lo:hi] = segment.tokens.rows(start, stop)
            if scales is not None:
                assert segment.scales is not None
                scales[lo:hi] = segment.scales.rows(start, stop)
        return tokens, scales, offsets

    def gather_packed(self, rows: np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate captions (each cut to `max_len` tokens) into one `[sum of lengths, d]` float16 array plus CSR
        offsets `[n + 1]`."""
        tokens, scales, offsets = self.gather_packed_raw(rows, max_len)
        return dequantize_numpy(tokens, scales, self.channel_scales), offsets

    def gather_padded(self, rows: np.ndarray, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stack captions into `[n, L, d]` float16 zero-padded (L = longest, capped at `max_len`) plus lengths.

        A row of -1 (no caption) yields length 0.
        """
        parts = [self.get(int(r)) if r >= 0 else None for r in rows]
        lengths = np.array([0 if p is None else len(p) for p in parts], dtype=np.int64)
        if max_len is not None:
            lengths = np.minimum(lengths, max_len)
        out = np.zeros((len(rows), int(lengths.max(initial=1)) or 1, self.width), dtype=np.float16)
        for i, p in enumerate(parts):
            if p is not None:
                out[i, : lengths[i]] = p[: lengths[i]]
        return out, lengths


def _buffer(given: np.ndarray | None, rows: int, row_shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    """A new `[rows, *row_shape]` array, or the leading rows of `given` after checking it fits."""
    if given is None:
        return np.empty((rows, *row_shape), dtype=dtype)
    if given.dtype != dtype or given.shape[1:] != row_shape or len(given) < rows:
        raise ValueError(
            f"{name}: {given.dtype}{list(given.shape)} cannot hold {rows} rows of {dtype}{list(row_shape)}"
        )
    return given[:rows]
