"""Canonical partitions: the run's images split once into P partitions along the files they are read from, and a
seeded schedule that fills every global batch evenly from all of them.

A global batch is laid out partition by partition (B / P rows each), so with N nodes dividing P node n's rows are
those of partitions [n·P/N, (n+1)·P/N): a node reads, and mirrors, only its partitions' files, and the samples of a
step (which image in which row, and so its crop and masks, keyed by the row) are the same on any such N. The held-out
validation images are drawn per partition too, so validating reads nothing outside a node's partitions either. This is
the idea of MosaicML Streaming's canonical nodes, over store segments instead of MDS shards.

The assignment is a pure function of the run index and P (each image's file: the store segment of its first caption,
or, without text, its tar shard or Parquet file), so every process computes the same one from the saved index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.core.refs import ImageRefs
from train.data_index import TrainIndex

_PASS_STREAM = 0x9A27  # keeps each partition's pass orders apart from the other seeded streams of a run
_SPLIT_STREAM = 0x73706C69  # "spli": which images of a partition are held out for validation


def image_groups(index: TrainIndex, by_segment: bool) -> np.ndarray:
    """The file each image of `index` is read from, as a number (negative: none that it shares with others).

    With text (`by_segment`), the store segment of the image's first caption: captions are most of what a node
    reads (2–8 MB per image against ~0.1 MB of JPEG). Otherwise its tar shard or Parquet file; loose image files
    have none.
    """
    if by_segment:
        spans = index.caption_spans
        offsets = index.caption_offsets
        has = offsets[1:] > offsets[:-1]
        first = np.where(has, offsets[:-1], 0)
        return np.where(has, spans.segment[first] if len(spans.segment) else -1, -1).astype(np.int64)
    table = ImageRefs.of(index.refs).table
    kinds = pc.dictionary_encode(table.column("kind").cast(pa.string()).combine_chunks())
    paths = pc.dictionary_encode(table.column("path").cast(pa.string()).combine_chunks())
    numbers = paths.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    loose = kinds.dictionary.to_pylist().index("file") if "file" in kinds.dictionary.to_pylist() else -1
    return np.where(kinds.indices.to_numpy(zero_copy_only=False) == loose, -1, numbers)


def assign_partitions(groups: np.ndarray, count: int) -> np.ndarray:
    """Partition of each image from its group (the file it is read from; negative: none).

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
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], ids)
    for k in np.lexsort((ids, -sizes)).tolist():
        target = int(np.argmin(load))
        out[order[bounds[k] : bounds[k] + sizes[k]]] = target
        load[target] += int(sizes[k])
    for image in np.flatnonzero(groups < 0).tolist():
        target = int(np.argmin(load))
        out[image] = target
        load[target] += 1
    if len(groups) and (load == 0).any():
        empty = int(np.flatnonzero(load == 0)[0])
        raise ValueError(
            f"partition {empty} of {count} has no images: {len(ids)} files and {int((groups < 0).sum())} loose images "
            f"cannot fill {count} partitions; use fewer partitions"
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


@dataclass(frozen=True)
class PartitionSplit:
    """The run's images by partition: training ids with their partitions, and the held-out validation ids laid out
    partition by partition."""

    count: int
    partition_of: np.ndarray  # int32 [n]: the partition of each image of the index
    train_ids: np.ndarray  # sorted index ids held for training
    val_ids: np.ndarray  # validation ids, partition-major, sorted within a partition
    val_bounds: np.ndarray  # int64 [P+1]: partition p's validation rows are val_ids[val_bounds[p]:val_bounds[p+1]]


def split_partitions(partition_of: np.ndarray, count: int, val_images: int, seed: int) -> PartitionSplit:
    """Hold out `val_images` images, as evenly as the partitions allow (the first `val_images mod P` partitions one
    more), each partition's by a seeded draw; the rest train. Depends only on the arguments."""
    partition_of = np.asarray(partition_of, dtype=np.int32)
    n = len(partition_of)
    if n <= val_images:
        raise ValueError(f"only {n} images: cannot hold out {val_images} for validation (lower val_images)")
    held: list[np.ndarray] = []
    for p in range(count):
        members = np.flatnonzero(partition_of == p)
        want = val_images // count + (p < val_images % count)
        if want >= len(members):
            raise ValueError(
                f"partition {p} holds {len(members)} images, too few to hold out {want} for validation and train on "
                "the rest; use fewer partitions or lower val_images"
            )
        order = np.random.default_rng([seed, p, _SPLIT_STREAM]).permutation(len(members))
        held.append(np.sort(members[order[:want]]))
    val_ids = np.concatenate(held) if held else np.empty(0, np.int64)
    keep = np.ones(n, dtype=bool)
    keep[val_ids] = False
    bounds = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([len(h) for h in held], out=bounds[1:])
    return PartitionSplit(count, partition_of, np.flatnonzero(keep), val_ids.astype(np.int64), bounds)


class PartitionSchedule:
    """Which training images fill each global batch: B / P from each partition, partition-major.

    Each partition's images come in a new seeded order on every pass over it, passes back to back (small partitions
    wrap sooner than large ones). The order of the pass in use is kept per partition, so a step costs O(B) after the
    first of each pass.
    """

    def __init__(self, members: list[np.ndarray], batch_size: int, seed: int) -> None:
        self.count = len(members)
        if batch_size % self.count:
            raise ValueError(f"batch_size {batch_size} is not divisible by partitions {self.count}")
        self.per_partition = batch_size // self.count
        self.seed = seed
        self.members = members
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # partition -> (pass, its order)

    def partition_of_row(self, rows: slice) -> np.ndarray:
        """The partition each row of `rows` (global batch rows) is drawn from."""
        return np.arange(rows.start, rows.stop) // self.per_partition

    def _order(self, part: int, number: int) -> np.ndarray:
        kept = self._orders.get(part)
        if kept is None or kept[0] != number:
            rng = np.random.default_rng([self.seed, number, part, _PASS_STREAM])
            kept = (number, rng.permutation(len(self.members[part])))
            self._orders[part] = kept
        return kept[1]

    def images(self, step: int, rows: slice | None = None) -> np.ndarray:
        """Index ids of the images in rows `rows` (default all) of `step`'s global batch."""
        rows = rows if rows is not None else slice(0, self.count * self.per_partition)
        row = np.arange(rows.start, rows.stop)
        parts, positions = row // self.per_partition, step * self.per_partition + row % self.per_partition
        out = np.empty(len(row), dtype=np.int64)
        for part in np.unique(parts).tolist():
            members = self.members[part]
            here = parts == part
            numbers = positions[here] // len(members)
            picked = np.empty(int(here.sum()), dtype=np.int64)
            for number in np.unique(numbers).tolist():
                pick = numbers == number
                picked[pick] = members[self._order(part, number)[positions[here][pick] % len(members)]]
            out[here] = picked
        return out


def node_count(world: int, per_node: int) -> int:
    """The number of nodes of a run of `world` processes, `per_node` on each (torchrun's LOCAL_WORLD_SIZE)."""
    if per_node < 1 or world % per_node:
        raise ValueError(f"{world} processes are not whole nodes of {per_node}")
    return world // per_node


def partition_run(index: TrainIndex, count: int, val_images: int, seed: int, by_segment: bool) -> PartitionSplit:
    """The run's partitions and split: a function of the index and these settings only."""
    return split_partitions(assign_partitions(image_groups(index, by_segment), count), count, val_images, seed)


@dataclass(frozen=True)
class NodeSegments:
    """The store segments one node reads: those holding a caption of an image of its partitions."""

    names: list[str]
    shared: int  # of them, segments grouped to another node's partitions, read for captions its images share


def node_segments(index: TrainIndex, split: PartitionSplit, partitions: range) -> NodeSegments:
    """What the node serving `partitions` reads of the store (the store keeps a caption text once, so an image may
    have a caption in a segment of another partition: such reads are counted)."""
    mine = (split.partition_of >= partitions.start) & (split.partition_of < partitions.stop)
    per_image = np.diff(index.caption_offsets)
    used = np.unique(index.caption_spans.segment[np.repeat(mine, per_image)])
    used = used[used >= 0]
    ours = np.unique(image_groups(index, by_segment=True)[mine])
    return NodeSegments([index.segments[s] for s in used.tolist()], int(np.isin(used, ours, invert=True).sum()))


@dataclass(frozen=True)
class NodeShards:
    """The tar shards on object storage one node reads: those holding an image of its partitions."""

    urls: list[str]
    rows: list[np.ndarray]  # for each, the index ids of the node's images in it (training and validation)
    total: int  # remote shards the whole run reads
    shared: int  # of the node's, shards that also hold other partitions' images (with text, partitions follow segments)


def node_shards(index: TrainIndex, split: PartitionSplit, partitions: range) -> NodeShards:
    """The remote tar shards the node serving `partitions` reads, each with its images there (without text the
    partitions follow the shards, so these are exactly its partitions' shards)."""
    from pipeline.core.remote import is_remote

    paths = ImageRefs.of(index.refs).table.column("path").combine_chunks()
    remote = np.array([is_remote(p) for p in paths.dictionary.to_pylist()], dtype=bool)
    codes = paths.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    on_remote = remote[codes] if len(remote) else np.zeros(len(codes), bool)
    mine = (split.partition_of >= partitions.start) & (split.partition_of < partitions.stop)
    ids = np.flatnonzero(mine & on_remote)
    order = np.argsort(codes[ids], kind="stable")
    used, starts = np.unique(codes[ids][order], return_index=True)
    groups = np.split(ids[order], starts[1:]) if len(ids) else []
    others = np.unique(codes[~mine & on_remote])
    return NodeShards(
        [paths.dictionary[int(c)].as_py() for c in used.tolist()],
        groups,
        len(np.unique(codes[on_remote])),
        int(np.isin(used, others).sum()),
    )
