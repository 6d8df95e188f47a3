"""Canonical partitions: the training images split once into P partitions along the files they are read from, and a
seeded schedule that fills every global batch evenly from all of them.

A global batch is laid out partition by partition (B / P rows each), so with N nodes dividing P node n's rows are
those of partitions [n·P/N, (n+1)·P/N): a node reads, and mirrors, only its partitions' files, and the samples of a
step (which image in which row, and so its crop and masks, keyed by the row) are the same on any such N. This is the
idea of MosaicML Streaming's canonical nodes, over store segments instead of MDS shards.
"""

from __future__ import annotations

import numpy as np

_PASS_STREAM = 0x9A27  # keeps each partition's pass orders apart from the other seeded streams of a run


def assign_partitions(groups: np.ndarray, count: int) -> np.ndarray:
    """Partition of each image from its group (the store segment or tar shard it is read from; negative: none).

    Whole groups go to a partition, largest first to the one holding the fewest images (ties to the lowest index), so
    that a partition's images come from as few files as possible; images without a group fill the partitions round
    robin from the lightest. Depends only on `groups` and `count`: every node computes the same assignment.
    """
    if count < 1:
        raise ValueError(f"partitions must be at least 1, got {count}")
    groups = np.asarray(groups, dtype=np.int64)
    out = np.empty(len(groups), dtype=np.int32)
    load = np.zeros(count, dtype=np.int64)
    ids, sizes = np.unique(groups[groups >= 0], return_counts=True)
    for group in ids[np.lexsort((ids, -sizes))].tolist():
        members = groups == group
        target = int(np.argmin(load))
        out[members] = target
        load[target] += int(members.sum())
    loose = np.flatnonzero(groups < 0)
    for image in loose.tolist():
        target = int(np.argmin(load))
        out[image] = target
        load[target] += 1
    if len(groups) and (load == 0).any():
        empty = int(np.flatnonzero(load == 0)[0])
        raise ValueError(
            f"partition {empty} of {count} has no images: {len(ids)} files and {len(loose)} loose images cannot fill "
            f"{count} partitions; use fewer partitions"
        )
    return out


def check_layout(count: int, batch_size: int, nodes: int) -> None:
    """Refuse a layout whose batches or nodes cannot split evenly along the partitions."""
    if batch_size % count:
        raise ValueError(f"batch_size {batch_size} is not divisible by partitions {count} (each gives B / P rows)")
    if count % nodes:
        raise ValueError(f"{nodes} nodes cannot share {count} partitions evenly: use a node count that divides it")


def node_partitions(node: int, nodes: int, count: int) -> range:
    """The partitions node `node` of `nodes` serves: a contiguous range, so its ranks' rows are contiguous too."""
    per_node = count // nodes
    return range(node * per_node, (node + 1) * per_node)


class PartitionSchedule:
    """Which training images fill each global batch: B / P from each partition, partition-major.

    Each partition's images come in a new seeded order on every pass over it, passes back to back (small partitions
    wrap sooner than large ones). The members of each partition are sorted once and the order of the pass in use is
    kept, so a step costs O(B) after the first of each pass.
    """

    def __init__(self, partition_of: np.ndarray, count: int, batch_size: int, seed: int) -> None:
        self.count = count
        self.per_partition = batch_size // count
        self.seed = seed
        by_partition = np.argsort(partition_of, kind="stable")
        bounds = np.searchsorted(partition_of[by_partition], np.arange(count + 1))
        self.members = [by_partition[bounds[p] : bounds[p + 1]] for p in range(count)]
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # partition -> (pass, its order)

    def _order(self, part: int, number: int) -> np.ndarray:
        kept = self._orders.get(part)
        if kept is None or kept[0] != number:
            rng = np.random.default_rng([self.seed, number, part, _PASS_STREAM])
            kept = (number, rng.permutation(len(self.members[part])))
            self._orders[part] = kept
        return kept[1]

    def images(self, step: int, partitions: range | None = None) -> np.ndarray:
        """Indices into the partition assignment of the images of `step`'s global batch (default) or of its rows
        from `partitions` (a node's), partition-major."""
        parts = range(self.count) if partitions is None else partitions
        positions = step * self.per_partition + np.arange(self.per_partition)
        out = np.empty((len(parts), self.per_partition), dtype=np.int64)
        for row, part in enumerate(parts):
            members = self.members[part]
            for number in np.unique(positions // len(members)).tolist():
                pick = positions // len(members) == number
                out[row, pick] = members[self._order(part, number)[positions[pick] % len(members)]]
        return out.reshape(-1)
