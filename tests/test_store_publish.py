"""Segment publication in a local embedding store (`EmbeddingStore.publish`): under the store's lock a staged
segment loses the captions others published meanwhile, is renamed into `segments/` and listed; what a dead writer
left (an unlisted segment, a staging directory) is cleaned, what a live one is writing is not.

The protocol's multi-process test is `test_four_concurrent_writer_processes`; the embed job's kill/resume test
(test_embed.py) runs it through the CLI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import threading

import numpy as np
import pytest
import zarr

from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import STAGING, EmbeddingStore
from tests.support.stores import TEST_ENCODER, TEST_LAYOUT, TEST_WIDTH, numbered_caption, publish_captions


def _staged(store: EmbeddingStore, ids, **attrs):
    writer = store.new_segment(TEST_LAYOUT)
    for i in ids:
        writer.append(*numbered_caption(i))
    writer.finish(**attrs)
    return writer


def _assert_holds_each_once(path, ids) -> None:
    store = EmbeddingStore(path)
    keys = [k.tobytes() for s in store.segment_ids() for k in store.read_keys(s)]
    assert len(keys) == len(set(keys)), "a caption is in two segments"
    reader = EmbeddingReader(path)
    assert len(reader) == len(ids)
    for i in ids:
        key, vectors = numbered_caption(i)
        assert np.array_equal(reader.get_key(key), vectors)


def test_publish_drops_keys_another_writer_published(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    other = EmbeddingStore(tmp_path / "s")  # a second writer process's view
    assert len(other.published()) == 0, "its index of published keys is already built (and now stale)"
    w1, w2 = _staged(store, range(0, 30)), _staged(other, range(20, 45))
    assert store.publish(w1).captions == 30
    second = other.publish(w2)
    assert (second.captions, second.duplicates_dropped) == (15, 10)
    _assert_holds_each_once(tmp_path / "s", range(45))
    assert not (tmp_path / "s" / STAGING).exists()
    w3 = _staged(store, [3])
    result = store.publish(w3)
    assert result.segment is None and result.duplicates_dropped == 1, "nothing new: no empty segment is published"
    assert len(store.segment_ids()) == 2 and not (tmp_path / "s" / STAGING).exists()


def test_a_deduplicated_segment_keeps_its_attributes_and_vectors(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    publish_captions(store, range(0, 10, 2))
    result = store.publish(_staged(store, range(10), truncated=3, max_length=64))
    assert (result.captions, result.duplicates_dropped) == (5, 5)
    group = zarr.open_group(str(store.segment_path(result.segment)), mode="r")
    assert group.attrs["truncated"] == 3 and group.attrs["max_length"] == 64 and group.attrs["captions"] == 5
    assert [k.tobytes() for k in store.read_keys(result.segment)] == [numbered_caption(i)[0] for i in range(1, 10, 2)]
    _assert_holds_each_once(tmp_path / "s", range(10))


def test_unlisted_segments_are_invisible_and_cleaned(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    first = publish_captions(store, range(5)).segment
    # as if a writer died after renaming its segment but before listing it
    shutil.copytree(tmp_path / "s" / "segments" / first, tmp_path / "s" / "segments" / "orphan")
    # and a dead writer's staging directory (pid that cannot exist)
    dead = tmp_path / "s" / STAGING / f"0-{socket.gethostname()}-999999999-abcd"
    dead.mkdir(parents=True)
    assert len(EmbeddingReader(tmp_path / "s")) == 5
    publish_captions(store, range(5, 8))
    assert not (tmp_path / "s" / "segments" / "orphan").exists() and not dead.exists()
    assert len(EmbeddingReader(tmp_path / "s")) == 8


def test_a_new_segment_beside_a_writer_removing_the_empty_staging_directory(tmp_path, monkeypatch):
    """Two writers on one host (Ray's embedding actors): one removes `.staging`, empty, just as the other looks for
    dead writers' leftovers in it; the second goes on (it once failed there with FileNotFoundError)."""
    from pathlib import Path

    store = EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    publish_captions(store, range(2))
    staging = tmp_path / "s" / STAGING
    staging.mkdir(exist_ok=True)
    iterdir = Path.iterdir

    def removed_first(path: Path):
        if path == staging:
            EmbeddingStore(tmp_path / "s").drop_empty_staging()  # the other writer's removal lands first
        return iterdir(path)

    monkeypatch.setattr(Path, "iterdir", removed_first)
    writing = _staged(store, range(2, 4))
    monkeypatch.undo()
    assert store.publish(writing).captions == 2
    _assert_holds_each_once(tmp_path / "s", range(4))


def test_what_live_writers_and_other_hosts_stage_is_left_alone(tmp_path):
    store = EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    staging = tmp_path / "s" / STAGING
    live = staging / f"0-{socket.gethostname()}-{os.getppid()}-live"
    elsewhere = staging / "0-another-host-999999999-away"
    for d in (live, elsewhere):
        d.mkdir(parents=True)
    writing = _staged(store, range(3))  # a writer of this process, staged and not yet published
    publish_captions(store, range(3, 6))
    assert live.exists() and elsewhere.exists() and writing.staging.exists(), "only dead writers' staging is removed"
    assert store.publish(writing).captions == 3
    assert staging.exists(), "other writers still stage here"
    _assert_holds_each_once(tmp_path / "s", range(6))


def test_concurrent_publishers_in_threads_store_each_caption_once(tmp_path):
    """Writers holding their own store handles stage overlapping captions, then publish at the same moment."""
    EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    ranges = [range(0, 40), range(10, 50), range(20, 60), range(0, 60, 3)]
    stores = [EmbeddingStore(tmp_path / "s") for _ in ranges]
    writers = [_staged(store, ids) for store, ids in zip(stores, ranges)]
    start, results = threading.Barrier(len(writers)), [None] * len(writers)

    def publish(k: int) -> None:
        start.wait()
        results[k] = stores[k].publish(writers[k])

    threads = [threading.Thread(target=publish, args=(k,)) for k in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.captions for r in results) == 60
    assert sum(r.captions + r.duplicates_dropped for r in results) == sum(len(r) for r in ranges)
    assert len(EmbeddingStore(tmp_path / "s").segment_ids()) == sum(r.segment is not None for r in results)
    _assert_holds_each_once(tmp_path / "s", range(60))
    assert not (tmp_path / "s" / STAGING).exists()


def test_stores_created_at_once_are_one_store(tmp_path):
    """Creators racing for one path: one root is made, every creator opens it, and a creator's leftovers (the lock,
    staging) do not make the directory look foreign."""
    path = tmp_path / "s"
    start, opened, errors = threading.Barrier(4), [], []

    def create() -> None:
        start.wait()
        try:
            opened.append(EmbeddingStore.open_or_create(path, TEST_ENCODER, TEST_WIDTH))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(opened) == 4
    publish_captions(opened[0], range(3))
    assert [s.segment_ids() for s in opened] == [opened[0].segment_ids()] * 4


def _concurrent_writer(path, lo, hi):
    store = EmbeddingStore(path)
    for start in range(lo, hi, 7):
        publish_captions(store, range(start, min(start + 7, hi)))


@pytest.mark.distributed
def test_four_concurrent_writer_processes(tmp_path):
    EmbeddingStore.open_or_create(tmp_path / "s", TEST_ENCODER, TEST_WIDTH)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_concurrent_writer, args=(tmp_path / "s", lo, lo + 40)) for lo in (0, 10, 20, 30)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    _assert_holds_each_once(tmp_path / "s", range(70))
