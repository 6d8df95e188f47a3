"""Canonical partitions: whole files per partition, balanced; every step's batch the same on any node count that divides
P; each partition's images once per pass; validation by partition; what a node reads of the store."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.refs import ImageRef
from train.config import TrainConfig
from train.data import StepBatches
from train.data_index import TrainIndex, build_index
from train.partitions import (
    PartitionSchedule,
    assign_partitions,
    check_layout,
    image_groups,
    node_partitions,
    node_segments,
    node_shards,
    partition_run,
    split_partitions,
)
from train.validation import chunks_of


def _groups(seed: int = 0) -> np.ndarray:
    """Images in 37 files of uneven size (5 to 60 images) and 23 images read from no file, shuffled."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 60, size=37)
    files = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)])
    return rng.permutation(np.concatenate([files, np.full(23, -1)]))


def test_a_file_stays_in_one_partition_and_the_partitions_balance():
    groups = _groups()
    parts = assign_partitions(groups, 8)
    for group in np.unique(groups[groups >= 0]):
        assert len(np.unique(parts[groups == group])) == 1, f"file {group} split across partitions"
    load = np.bincount(parts, minlength=8)
    largest = np.bincount(groups[groups >= 0]).max()
    assert load.max() - load.min() <= largest, load
    assert np.array_equal(parts, assign_partitions(groups.copy(), 8)), "the assignment is a pure function"
    loose = parts[groups < 0]
    assert len(np.unique(loose)) > 1, "images without a file spread over the partitions"


def test_too_many_partitions_for_the_files_is_refused():
    with pytest.raises(ValueError, match="has no images"):
        assign_partitions(np.array([0, 0, 1, 1]), 3)
    with pytest.raises(ValueError, match="at least 1"):
        assign_partitions(np.array([0]), 0)
    assert assign_partitions(np.array([0, 0, -1, -1, -1]), 3).tolist() == [0, 0, 1, 2, 1]


def test_layouts_that_cannot_split_evenly_are_refused():
    check_layout(8, 64, 4)
    with pytest.raises(ValueError, match="not divisible by partitions 8"):
        check_layout(8, 60, 2)
    with pytest.raises(ValueError, match="3 nodes cannot share 8 partitions"):
        check_layout(8, 64, 3)


def _members(parts: np.ndarray, count: int) -> list[np.ndarray]:
    return [np.flatnonzero(parts == p) for p in range(count)]


def test_every_step_is_the_same_global_batch_on_any_node_count_that_divides_p():
    parts = assign_partitions(_groups(), 8)
    schedule = PartitionSchedule(_members(parts, 8), 64, seed=3)
    for step in (0, 1, 17, 250):
        whole = schedule.images(step)
        assert len(whole) == 64
        for nodes in (1, 2, 4, 8):
            # a fresh schedule per node, as each node builds its own; a node's rows are its partitions' blocks
            served = []
            for node in range(nodes):
                own = node_partitions(node, nodes, 8)
                rows = slice(own.start * 8, own.stop * 8)
                served.append(PartitionSchedule(_members(parts, 8), 64, seed=3).images(step, rows))
            assert np.array_equal(np.concatenate(served), whole), (step, nodes)
        for part, block in enumerate(whole.reshape(8, 8)):
            assert (parts[block] == part).all(), "row block p holds partition p's images"
    other = PartitionSchedule(_members(parts, 8), 64, seed=4)
    assert not np.array_equal(schedule.images(0), other.images(0)), "seeded"


def test_each_partition_serves_every_image_once_per_pass_in_a_new_order():
    parts = assign_partitions(_groups(), 4)
    schedule = PartitionSchedule(_members(parts, 4), 32, seed=0)
    size = int(np.bincount(parts, minlength=4)[1])
    seen = np.concatenate([schedule.images(step, slice(8, 16)) for step in range(2 * size // 8 + 1)])
    first, second = seen[:size], seen[size : 2 * size]
    assert sorted(first.tolist()) == np.flatnonzero(parts == 1).tolist(), "every image once in a pass"
    assert sorted(second.tolist()) == sorted(first.tolist()) and not np.array_equal(first, second), "a new order"


def test_validation_is_held_out_evenly_per_partition():
    parts = assign_partitions(_groups(), 4)
    split = split_partitions(parts, 4, 10, seed=1)
    assert np.diff(split.val_bounds).tolist() == [3, 3, 2, 2]
    for p in range(4):
        held = split.val_ids[split.val_bounds[p] : split.val_bounds[p + 1]]
        assert (parts[held] == p).all() and np.array_equal(held, np.sort(held))
    assert not set(split.train_ids.tolist()) & set(split.val_ids.tolist())
    assert len(split.train_ids) + len(split.val_ids) == len(parts)
    again = split_partitions(parts.copy(), 4, 10, seed=1)
    assert np.array_equal(again.val_ids, split.val_ids), "a function of the assignment and the seed"
    assert not np.array_equal(split_partitions(parts, 4, 10, seed=2).val_ids, split.val_ids)
    with pytest.raises(ValueError, match="partition 0 holds 2 images, too few to hold out 2"):
        split_partitions(np.array([0, 0, 1, 1, 1]), 2, 4, seed=0)


@pytest.mark.parametrize(("bounds", "chunk", "world", "nodes"), [([0, 5, 9, 9, 14], 3, 4, 2), ([0, 4, 8], 16, 2, 1)])
def test_validation_chunks_stay_in_one_partition_and_on_its_node(bounds, chunk, world, nodes):
    count, per_node = len(bounds) - 1, world // nodes
    shares = [chunks_of(bounds, chunk, rank, world, nodes) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1, "FSDP's forwards are collective"
    counted = np.zeros(bounds[-1])
    for rank, share in enumerate(shares):
        own = node_partitions(rank // per_node, nodes, count)
        for part in share:
            p = int(np.searchsorted(bounds, part.rows.start, side="right")) - 1
            assert part.within == slice(bounds[p], bounds[p + 1]) and part.rows.stop <= part.within.stop
            assert p in own, "a node validates only its partitions' images"
            counted[part.rows] += part.weight
    assert counted.tolist() == [1.0] * bounds[-1]


def _tar_index() -> TrainIndex:
    """12 images without captions: 4 loose files and two tar shards of 4."""
    refs = [ImageRef(f"f{i}", "file", f"/d/f{i}.png") for i in range(4)]
    refs += [ImageRef(f"t{i}", "tar", f"/d/shard-{i // 4}.tar", 512 * i, 100) for i in range(8)]
    return TrainIndex(refs, ["0" * 64] * 12, np.zeros(13, np.int64), np.zeros((0, 32), np.uint8), [], {})


def test_images_without_text_are_grouped_by_their_tar_shard():
    groups = image_groups(_tar_index(), by_segment=False)
    assert (groups[:4] < 0).all() and len(set(groups[4:8])) == 1 and len(set(groups[8:])) == 1
    assert groups[4] != groups[8]
    parts = assign_partitions(groups, 2)
    assert len(set(parts[4:8])) == 1 and len(set(parts[8:])) == 1 and parts[4] != parts[8]
    assert np.bincount(parts).tolist() == [6, 6], "the loose files even the partitions out"


def test_a_node_fetches_the_remote_shards_its_images_lie_in_and_counts_the_shared_ones():
    """Partitions drawn across shards (as store segments draw them, with text): a node's shards are those holding any
    of its images; loose files and local shards are never fetched."""
    refs = [ImageRef(f"f{i}", "file", f"/d/f{i}.png") for i in range(2)]
    refs += [ImageRef(f"l{i}", "tar", "/d/local.tar", 512 * i, 100) for i in range(2)]
    refs += [ImageRef(f"r{i}", "tar", f"s3://b/p/shard-{i // 4}.tar", 512 * i, 100) for i in range(12)]
    index = TrainIndex(refs, ["0" * 64] * 16, np.zeros(17, np.int64), np.zeros((0, 32), np.uint8), [], {})
    # partition 0: shard-0 whole and half of shard-1; partition 1: the other half of shard-1 and shard-2 whole
    parts = np.array([0, 1, 0, 1, *([0] * 4), 0, 0, 1, 1, *([1] * 4)])
    split = split_partitions(parts, 2, 2, seed=0)
    first = node_shards(index, split, range(0, 1))
    assert first.urls == ["s3://b/p/shard-0.tar", "s3://b/p/shard-1.tar"] and first.total == 3
    assert [r.tolist() for r in first.rows] == [[4, 5, 6, 7], [8, 9]] and first.shared == 1
    second = node_shards(index, split, range(1, 2))
    assert second.urls == ["s3://b/p/shard-1.tar", "s3://b/p/shard-2.tar"] and second.shared == 1
    both = node_shards(index, split, range(0, 2))
    assert len(both.urls) == 3 and both.shared == 0 and sum(len(r) for r in both.rows) == 12


@pytest.fixture(scope="module")
def index(synth_dir, annotated_cache, vector_store):
    """The session's images and captions joined with the two-segment `vector_store`."""
    return build_index([synth_dir / "images"], annotated_cache, vector_store, [], progress=False)


def test_a_node_reads_its_partitions_segments_and_counts_the_shared_ones(index):
    groups = image_groups(index, by_segment=True)
    assert set(groups.tolist()) <= {0, 1} and (groups >= 0).all(), "every image by its first caption's segment"
    split = partition_run(index, 2, 4, 0, by_segment=True)
    assert (split.partition_of == groups).all() or (split.partition_of == 1 - groups).all(), "one segment each"
    whole = node_segments(index, split, range(0, 2))
    assert whole.names == index.segments and whole.shared == 0
    for part in (0, 1):
        reads = node_segments(index, split, range(part, part + 1))
        own = index.segments[int(groups[split.partition_of == part][0])]
        assert own in reads.names
        mine = np.repeat(split.partition_of == part, np.diff(index.caption_offsets))
        shares = len(set(index.caption_spans.segment[mine].tolist())) > 1
        assert reads.shared == int(shares) and len(reads.names) == 1 + int(shares)


def test_a_rank_takes_its_rows_from_its_partitions_and_replaces_within_them(index, synth_dir, vector_store):
    cfg = TrainConfig(
        images=[str(synth_dir / "images")],
        conditioning="none",
        model="vit_tiny",
        patch_size=8,
        image_size=32,
        batch_size=8,
        steps=10,
        partitions=2,
        min_context=2,
        seed=2,
    )
    split = partition_run(index, 2, 4, cfg.seed, by_segment=True)
    made = [StepBatches(index, split.train_ids, cfg, (4, 4), r, 2, partition_of=split.partition_of) for r in (0, 1)]
    for step in (0, 3, 9):
        for rank, data in enumerate(made):
            ids = data.images_of_step(step)
            assert (split.partition_of[ids] == rank).all(), "rank r of 2 (one per node) serves partition r"
            assert not set(ids.tolist()) & set(split.val_ids.tolist())
    pools = made[1]._pools
    assert all((split.partition_of[pool] == 1).all() for pool in pools), "a stand-in comes from the same partition"
