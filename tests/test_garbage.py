"""`tcjepa cache gc` and `tcjepa store gc` on each object storage back-end (S3 on moto, Azure on Azurite): uploads
no log entry names are found, spared while younger than the grace, deleted only with --delete and only after a claim
in the log; a writer paused between its upload and its log entry, with gc run at grace 0 meanwhile, loses nothing (it
reads the claim and uploads again)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.core.errors import UserError
from pipeline.core.garbage import CLAIM, parse_grace
from tests.support.commands import tcjepa

pytestmark = pytest.mark.s3


def _rows(digest: str, count: int, start: int = 0) -> list[dict]:
    from captioning.annotations import PROMPT_ID
    from captioning.cache import caption_row

    return [
        caption_row(f"{i // 4:064x}", f"img{i // 4}", digest, PROMPT_ID, i % 4, f"caption {i}", "stop")
        for i in range(start, start + count)
    ]


def slow_gc(monkeypatch, run):
    """Run `run()` (a gc with --delete) with its deletions held back; returns its report and a function that makes
    them: a gc that claimed, then was slow to delete while writers went on."""
    from pipeline.core.objects import ObjectRoot

    held: list[tuple[ObjectRoot, str]] = []
    with monkeypatch.context() as patched:
        patched.setattr(ObjectRoot, "delete", lambda self, name: held.append((self, name)))
        report = run()

    def finish() -> None:
        for objects, name in held:
            ObjectRoot.delete(objects, name)

    return report, finish


def test_grace_periods_are_read_in_hours_minutes_or_seconds():
    assert [parse_grace(t) for t in ("24h", "90m", "30s", "0", "1.5")] == [86400, 5400, 30, 0, 5400]
    for bad in ("soon", "-1h", ""):
        with pytest.raises(UserError, match="--grace"):
            parse_grace(bad)


def test_gc_spares_what_a_tree_upload_named_between_its_look_and_its_claim(tmp_path):
    """In process, on obstore's in-memory store: two unpublished uploads are found; by the time gc has claimed them,
    a manifest (a tree uploaded whole, which reads no log) names one of them: only the other is deleted, and the
    report counts what was freed, not what was found."""
    from obstore.store import MemoryStore

    from pipeline.core.garbage import collect_garbage
    from pipeline.core.objects import ObjectRoot

    objects = ObjectRoot("memory://bucket/cache", MemoryStore())
    objects.create("captions/a.parquet", b"a" * 300)
    objects.create("captions/b.parquet", b"b" * 700)
    looks = []

    def live(entries):
        looks.append(len(entries))
        return set() if len(looks) == 1 else {"b"}  # b's manifest lands after the first look

    report = collect_garbage(objects, ["captions"], lambda name: name.split("/")[1].split(".")[0], live, 0.0, True)
    assert (report.found, report.found_bytes, report.deleted, report.freed_bytes) == (2, 1000, 1, 300)
    assert objects.names("captions") == ["b.parquet"] and len(looks) == 2
    assert [json.loads(objects.read(f"log/{n}").data)[CLAIM] for n in objects.names("log")] == [
        ["captions/a.parquet", "captions/b.parquet"]
    ]


def test_cache_gc_reports_spares_the_young_and_deletes_only_when_told(tmp_path, object_bucket):
    from captioning.remote_cache import RemoteCaptionCache

    fs, root, name, env = object_bucket
    url = f"{root}/cache"
    cache = RemoteCaptionCache.open_or_create(url, tmp_path / "writer")
    digest = cache.add_recipe({"kind": "annotations", "test": "gc"})
    assert cache.commit(_rows(digest, 40)).captions_added == 40
    published = sorted(fs.ls(f"{name}/cache/captions"))
    for kind in ("captions", "failures"):  # a writer that died after uploading, before its log entry
        fs.pipe_file(f"{name}/cache/{kind}/dead-writer.parquet", b"x" * 1000)

    report = tcjepa("cache", "gc", url, "--delete", env=env).stdout
    assert "0 unpublished objects" in report and "2 younger kept" in report, "the default grace is 24 h"
    report = tcjepa("cache", "gc", url, "--grace", "0", env=env).stdout
    assert "2 unpublished objects" in report and "dry run, nothing deleted" in report, report
    assert fs.exists(f"{name}/cache/captions/dead-writer.parquet")
    report = tcjepa("cache", "gc", url, "--grace", "0", "--delete", env=env).stdout
    assert "deleted 2" in report, report
    fs.invalidate_cache()
    assert sorted(fs.ls(f"{name}/cache/captions")) == published and not fs.exists(f"{name}/cache/failures")
    claims = [json.loads(fs.cat_file(p)) for p in fs.ls(f"{name}/cache/log")]
    assert [c[CLAIM] for c in claims if CLAIM in c] == [
        ["captions/dead-writer.parquet", "failures/dead-writer.parquet"]
    ]
    verified = tcjepa("cache", "verify", url, "--no-progress", env=env).stdout
    assert verified.startswith("ok: 1 recipes, 1 shards, 40 captions"), verified
    assert "0 unpublished objects" in tcjepa("cache", "gc", url, "--grace", "0", env=env).stdout


def test_a_writer_paused_between_upload_and_publish_loses_nothing_to_gc_at_grace_zero(
    tmp_path, object_bucket, monkeypatch
):
    """gc runs (grace 0, --delete) while the writer's shard is uploaded and its entry not yet created: gc claims the
    next log number and deletes the upload, slowly (after the writer went on); the writer's entry loses that number,
    it reads the claim, and uploads its rows again under a new name. Every row is published once; the cache
    verifies."""
    from captioning.remote_cache import RemoteCaptionCache, collect_cache_garbage

    fs, root, name, env = object_bucket
    url = f"{root}/cache"
    writer = RemoteCaptionCache.open_or_create(url, tmp_path / "writer")
    digest = writer.add_recipe({"kind": "annotations", "test": "paused"})
    assert writer.commit(_rows(digest, 20)).captions_added == 20
    append, reports = writer._log.append, []

    def paused_append(doc):
        if not reports:  # the upload is there; the entry is not
            reports.append(slow_gc(monkeypatch, lambda: collect_cache_garbage(url, 0.0, delete=True)))
        return append(doc)

    writer._log.append = paused_append
    result = writer.commit(_rows(digest, 30, start=20))
    report, finish_deleting = reports[0]
    finish_deleting()
    assert report.deleted >= 1, "gc found the paused writer's upload and deleted it"
    assert result.captions_added == 30
    verified = tcjepa("cache", "verify", url, "--no-progress", env=env).stdout
    assert verified.startswith("ok: 1 recipes, 2 shards, 50 captions"), verified
    assert "0 unpublished objects" in collect_cache_garbage(url, 0.0, delete=False).summary()


def test_store_gc_and_a_paused_store_writer(tmp_path, object_bucket, monkeypatch):
    """The store's uploads: a dead writer's segment is found and deleted; a paused writer's segment, claimed by gc at
    grace 0 and deleted after the writer went on, is uploaded again under a new id (the same id would be deleted
    under it), and every caption reads back."""
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import RemoteEmbeddingStore, collect_store_garbage, mirror_store
    from embedding_cache.store import TokenLayout

    fs, root, name, env = object_bucket
    url = f"{root}/store"
    store = RemoteEmbeddingStore.open_or_create(url, {"kind": "test-encoder"}, 4, tmp_path / "writer")
    rng = np.random.default_rng(0)
    keys = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(20)]
    vectors = [rng.standard_normal((1 + i % 3, 4)).astype(np.float16) for i in range(20)]

    def publish(chosen: range) -> str | None:
        segment = store.new_segment(TokenLayout(8, 2))
        for i in chosen:
            segment.append(keys[i], vectors[i])
        segment.finish()
        return store.publish(segment).segment

    first = publish(range(10))
    fs.pipe_file(f"{name}/store/segments/dead-writer/zarr.json", b"{}")
    report = tcjepa("store", "gc", url, "--grace", "0", "--delete", env=env).stdout
    assert "1 unpublished objects" in report and "deleted 1" in report, report
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{name}/store/segments")) == sorted([first, "zarr.json"])

    append, reports = store._log.append, []

    def paused_append(doc):
        if not reports:
            reports.append(slow_gc(monkeypatch, lambda: collect_store_garbage(url, 0.0, delete=True)))
        return append(doc)

    store._log.append = paused_append
    second = publish(range(10, 20))
    report, finish_deleting = reports[0]
    finish_deleting()
    assert report.deleted >= 1 and second is not None
    assert tcjepa("store", "verify", url, "--no-progress", env=env).stdout.startswith("ok: 2 segments, 20 captions")
    reader = EmbeddingReader(mirror_store(url, tmp_path / "reader"))
    for key, vector in zip(keys, vectors):
        np.testing.assert_array_equal(reader.get_key(key), vector)
    assert "0 unpublished objects" in collect_store_garbage(url, 0.0, delete=False).summary()
