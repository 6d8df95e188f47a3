"""A set of 16-byte digests with optional int64 payloads, held as sorted numpy arrays.

The caption cache deduplicates rows and the embedding store finds captions by
key among tens of millions of entries; Python sets of bytes would cost ~90 bytes
an entry, this costs 16 (+8 with a payload). New digests arrive in runs (one
shard or segment at a time); each run is sorted once, and a run is merged into the
one before it while that one is not more than twice its size, as a log-structured
merge does: every digest is merged O(log n) times, the runs' sizes fall
geometrically (at most log2 n of them to search), and building an index of n keys
from many small runs costs O(n log n) whatever the number of runs. (Merging
everything every 8 runs cost 0.51 µs a key at 25 segments and 1.03 µs at 400.)
"""

from __future__ import annotations

import binascii
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.core.devices import usable_cpus

DIGEST = np.dtype("V16")
SHA256_BYTES = 32  # a sha256 digest: an image's, or a caption's key (of its text) in the embedding store
# Keys per part of a lookup, at most: numpy's sorts, searches and gathers release the GIL, so rank 0's join of 10⁷
# caption keys runs its parts on every CPU while the other ranks wait (1.5x on 2 CPUs at 10⁷ keys), and a part's
# temporaries (~100 bytes a key) stay ~100 MB a thread however many keys there are (at 10⁸, 10 GB in one part).
KEYS_PER_LOOKUP_PART = 1 << 20


def as_digests(keys: np.ndarray) -> np.ndarray:
    """View `[n, >=16]` uint8 keys (or `[n]` V16) as a 1-D V16 array of their first 16 bytes."""
    if keys.dtype == DIGEST:
        return keys
    keys = np.ascontiguousarray(np.asarray(keys, dtype=np.uint8)[:, :16])
    return keys.view(DIGEST).reshape(-1)


def hex_to_bytes(values: pa.Array, width: int) -> np.ndarray:
    """uint8 `[n, width]` from an Arrow array of hex strings, its character buffer decoded in one `binascii.unhexlify`
    call (no object per value). Raises ValueError when a value is missing, or is not `2 * width` hex digits."""
    if values.null_count:
        raise ValueError(f"{values.null_count} values are missing")
    if not pa.types.is_string(values.type) and not pa.types.is_large_string(values.type):
        values = values.cast(pa.large_string())
    n = len(values)
    if not n:
        return np.zeros((0, width), dtype=np.uint8)
    offset = np.dtype(np.int64 if pa.types.is_large_string(values.type) else np.int32)
    offsets = np.frombuffer(values.buffers()[1], dtype=offset, count=n + 1, offset=values.offset * offset.itemsize)
    if (np.diff(offsets) != 2 * width).any():
        raise ValueError(f"a value is not {2 * width} hex digits")
    try:
        raw = binascii.unhexlify(memoryview(values.buffers()[2] or b"")[offsets[0] : offsets[-1]])
    except binascii.Error:
        raise ValueError(f"a value is not {2 * width} hex digits") from None
    return np.frombuffer(raw, dtype=np.uint8).reshape(n, width)


def bytes_to_arrow(values: np.ndarray) -> pa.FixedSizeBinaryArray:
    """uint8 `[n, width]` as an Arrow fixed-width binary array over the same bytes (copied only if not contiguous)."""
    data = pa.py_buffer(np.ascontiguousarray(values, dtype=np.uint8))
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(values.shape[1]), len(values), [None, data])


def arrow_to_bytes(values: pa.FixedSizeBinaryArray) -> np.ndarray:
    """uint8 `[n, width]` over an Arrow fixed-width binary array's buffer (no copy, no object per value)."""
    width = values.type.byte_width
    return np.frombuffer(
        values.buffers()[1] or b"", dtype=np.uint8, count=len(values) * width, offset=values.offset * width
    ).reshape(-1, width)


def _prefix(digests: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each digest as a big-endian uint64: sorting and searching on it is native-speed, and it
    orders digests as their bytes do. One copy: the strided big-endian view is converted straight into it."""
    return np.ascontiguousarray(digests).view(np.uint8).reshape(-1, 16)[:, :8].view(">u8").reshape(-1).astype(np.uint64)


@dataclass
class _Run:
    """Digests sorted (by their 64-bit prefix, ties in insertion order), their payloads, and the longest streak of
    equal prefixes (1 unless two different digests share their first 8 bytes, which is rare but handled)."""

    prefix: np.ndarray  # uint64 [n]
    digests: np.ndarray  # V16 [n]
    values: np.ndarray  # int64 [n]
    streak: int

    @classmethod
    def of(cls, prefix: np.ndarray, digests: np.ndarray, values: np.ndarray | None = None) -> _Run:
        """The run of `digests` (payloads `values`; None: each digest's position, which the sort's order is)."""
        # Unstable first (numpy's SIMD quicksort, ~1.7x timsort on random keys): with no prefix twice, the order is
        # the same; with ties, sorted again stably, so that equal prefixes keep their insertion order.
        order = np.argsort(prefix)
        ordered = prefix[order]
        if len(prefix) > 1 and (ordered[1:] == ordered[:-1]).any():
            order = np.argsort(prefix, kind="stable")
            ordered = prefix[order]
        prefix, digests, values = ordered, digests[order], order if values is None else values[order]
        streak = 1
        if len(prefix) > 1 and (same := prefix[1:] == prefix[:-1]).any():
            edges = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])))
            streak = int((edges[1::2] - edges[::2]).max()) + 1
        return cls(prefix, digests, values, streak)


class DigestIndex:
    """Membership and lookup of 16-byte digests; payload -1 means "absent"."""

    def __init__(self) -> None:
        self._runs: list[_Run] = []

    def __len__(self) -> int:
        return sum(len(r.prefix) for r in self._runs)

    def add(self, keys: np.ndarray, payload: np.ndarray | None = None) -> None:
        """Add digests (and their payloads); a digest already present keeps its first payload."""
        digests = as_digests(keys)
        if len(digests) == 0:
            return
        values = None if payload is None else np.asarray(payload, dtype=np.int64)
        self._runs.append(_Run.of(_prefix(digests), digests, values))
        while len(self._runs) > 1 and len(self._runs[-2].prefix) <= 2 * len(self._runs[-1].prefix):
            self._merge_last_two()

    def _merge_last_two(self) -> None:
        """One sorted run from the last two; older entries first among equal digests (the first payload wins)."""
        older, newer = self._runs[-2], self._runs[-1]
        self._runs[-2:] = [
            _Run.of(
                np.concatenate([older.prefix, newer.prefix]),  # two sorted runs: a stable (tim)sort merges them
                np.concatenate([older.digests, newer.digests]),
                np.concatenate([older.values, newer.values]),
            )
        ]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Payload of each key, or -1 where the key is absent; a large lookup in contiguous parts on every CPU."""
        digests = as_digests(keys)
        if len(digests) <= KEYS_PER_LOOKUP_PART:
            return self._lookup(digests)
        bounds = [*range(0, len(digests), KEYS_PER_LOOKUP_PART), len(digests)]
        found = np.empty(len(digests), dtype=np.int64)

        def part(lo: int, hi: int) -> None:
            found[lo:hi] = self._lookup(digests[lo:hi])

        with ThreadPoolExecutor(min(usable_cpus(), len(bounds) - 1), thread_name_prefix="tcjepa-lookup") as pool:
            list(pool.map(part, bounds[:-1], bounds[1:]))
        return found

    def _lookup(self, unsorted: np.ndarray) -> np.ndarray:
        """`lookup` of V16 digests on this thread."""
        # Keys searched in sorted order: each run is then walked front to back (cache-friendly), not at random.
        unsorted_prefix = _prefix(unsorted)
        order = np.argsort(unsorted_prefix)  # any order of equal keys: each is looked up on its own
        digests, prefix = unsorted[order], unsorted_prefix[order]
        found = np.full(len(digests), -1, dtype=np.int64)
        for run in self._runs:
            start = np.searchsorted(run.prefix, prefix, side="left")
            for offset in range(run.streak):  # the entries sharing a key's prefix, oldest first
                pos = np.minimum(start + offset, len(run.prefix) - 1)
                hit = (start + offset < len(run.prefix)) & (run.digests[pos] == digests) & (found < 0)
                found[hit] = run.values[pos[hit]]
        out = np.empty_like(found)
        out[order] = found
        return out

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean mask: which keys are present."""
        return self.lookup(keys) >= 0


def first_occurrence(keys: np.ndarray) -> np.ndarray:
    """Boolean mask keeping the first of each repeated digest, in the original order."""
    digests = as_digests(keys)
    _, first = np.unique(digests, return_index=True)
    keep = np.zeros(len(digests), dtype=bool)
    keep[first] = True
    return keep


def first_repeat(keys: np.ndarray) -> tuple[int, int] | None:
    """Positions of two equal digests (the first pair in sorted order), or None when all differ."""
    digests = as_digests(keys)
    order = np.argsort(digests, kind="stable")
    same = np.flatnonzero(digests[order][1:] == digests[order][:-1])
    if not len(same):
        return None
    return int(order[same[0]]), int(order[same[0] + 1])
