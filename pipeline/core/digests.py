"""A set of 16-byte digests with optional int64 payloads, held as sorted numpy arrays.

The caption cache deduplicates rows and the embedding store finds captions by
key among tens of millions of entries; Python sets of bytes would cost ~90 bytes
an entry, this costs 16 (+8 with a payload). New digests arrive in runs (one
shard or segment at a time); each run is sorted once and runs are merged when
there are many, so adding a run never re-sorts the whole set.
"""

from __future__ import annotations

import numpy as np

DIGEST = np.dtype("V16")
MAX_RUNS = 8


def as_digests(keys: np.ndarray) -> np.ndarray:
    """View `[n, >=16]` uint8 keys (or `[n]` V16) as a 1-D V16 array of their first 16 bytes."""
    if keys.dtype == DIGEST:
        return keys
    keys = np.ascontiguousarray(np.asarray(keys, dtype=np.uint8)[:, :16])
    return keys.view(DIGEST).reshape(-1)


class DigestIndex:
    """Membership and lookup of 16-byte digests; payload -1 means "absent"."""

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def __len__(self) -> int:
        return sum(len(d) for d, _ in self._runs)

    def add(self, keys: np.ndarray, payload: np.ndarray | None = None) -> None:
        """Add digests (and their payloads); a digest already present keeps its first payload."""
        digests = as_digests(keys)
        if len(digests) == 0:
            return
        values = np.arange(len(digests), dtype=np.int64) if payload is None else np.asarray(payload, dtype=np.int64)
        order = np.argsort(digests, kind="stable")
        self._runs.append((digests[order], values[order]))
        if len(self._runs) > MAX_RUNS:
            self._merge()

    def _merge(self) -> None:
        digests = np.concatenate([d for d, _ in self._runs])
        values = np.concatenate([v for _, v in self._runs])
        order = np.argsort(digests, kind="stable")
        self._runs = [(digests[order], values[order])]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Payload of each key, or -1 where the key is absent."""
        digests = as_digests(keys)
        out = np.full(len(digests), -1, dtype=np.int64)
        for run_digests, run_values in self._runs:
            pos = np.searchsorted(run_digests, digests)
            pos_clipped = np.minimum(pos, len(run_digests) - 1)
            hit = (pos < len(run_digests)) & (run_digests[pos_clipped] == digests) & (out < 0)
            out[hit] = run_values[pos_clipped[hit]]
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
