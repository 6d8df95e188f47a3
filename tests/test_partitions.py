"""Canonical partitions: whole files per partition, balanced; every step's batch the same on any node count that divides
P; each partition's images once per pass."""

from __future__ import annotations

import numpy as np
import pytest

from train.partitions import PartitionSchedule, assign_partitions, check_layout, node_partitions


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


def test_every_step_is_the_same_global_batch_on_any_node_count_that_divides_p():
    parts = assign_partitions(_groups(), 8)
    schedule = PartitionSchedule(parts, 8, 64, seed=3)
    for step in (0, 1, 17, 250):
        whole = schedule.images(step)
        assert len(whole) == 64
        for nodes in (1, 2, 4, 8):
            # a fresh schedule per node, as each node builds its own
            served = [
                PartitionSchedule(parts, 8, 64, seed=3).images(step, node_partitions(n, nodes, 8)) for n in range(nodes)
            ]
            assert np.array_equal(np.concatenate(served), whole), (step, nodes)
        rows = whole.reshape(8, 8)
        for part in range(8):
            assert (parts[rows[part]] == part).all(), "row block p holds partition p's images"
    assert not np.array_equal(schedule.images(0), PartitionSchedule(parts, 8, 64, seed=4).images(0)), "seeded"


def test_each_partition_serves_every_image_once_per_pass_in_a_new_order():
    parts = assign_partitions(_groups(), 4)
    schedule = PartitionSchedule(parts, 4, 32, seed=0)
    size = int(np.bincount(parts, minlength=4)[1])
    seen = np.concatenate([schedule.images(step, range(1, 2)) for step in range(2 * size // 8 + 1)])
    first, second = seen[:size], seen[size : 2 * size]
    assert sorted(first.tolist()) == sorted(np.flatnonzero(parts == 1).tolist()), "every image once in a pass"
    assert sorted(second.tolist()) == sorted(first.tolist()) and not np.array_equal(first, second), "a new order"
