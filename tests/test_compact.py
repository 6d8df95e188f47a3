"""`tcjepa cache compact`: few large shards from many small ones, every row readable exactly once throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from captioning.cache import CaptionCache, caption_row
from captioning.compact import compact_cache, plan_groups
from captioning.verify import verify_cache
from pipeline.core.errors import UserError
from tests.support.commands import refused, tcjepa
from tests.support.repo import REPO


def _many_small_shards(root: Path, shards: int = 24, images_per_shard: int = 6) -> CaptionCache:
    """A cache as `tcjepa caption` leaves it: one small shard per chunk, a failure record in every fourth."""
    cache = CaptionCache.open_or_create(root)
    recipe = cache.add_recipe({"kind": "test", "model": "m"}, "mine")
    for k in range(shards):
        images = range(k * images_per_shard, (k + 1) * images_per_shard)
        rows = [
            caption_row(f"{i:064x}", f"img{i}.png", recipe, "p0", s, f"caption {i} {s} " * 4, "stop", 9)
            for i in images
            for s in range(2)
        ]
        fails = [{"image_sha256": None, "source_id": f"bad{k}.png", "recipe": recipe, "reason": "truncated"}]
        cache.commit(rows, fails if k % 4 == 0 else [])
    return cache


def _contents(root: Path) -> tuple[list[tuple], list[tuple]]:
    """Every caption row and failure row a fresh reader sees, sorted (duplicates kept, so a row seen twice shows)."""
    cache = CaptionCache(root)
    captions = sorted(tuple(r.values()) for r in cache.read_captions().to_pylist())
    failures = sorted(tuple(r.values()) for r in cache.read_failures().to_pylist())
    return captions, failures


def _files(root: Path) -> int:
    return sum(1 for kind in ("captions", "failures", "manifests") for _ in (root / kind).iterdir())


def test_plan_groups_cuts_runs_of_small_shards_at_the_target():
    sizes = [("a", 4), ("b", 4), ("c", 20), ("d", 3), ("e", 3), ("f", 3), ("g", 3), ("h", 1)]
    assert plan_groups(sizes, 10) == [["a", "b"], ["d", "e", "f", "g"]]  # a lone small shard (h) stays
    assert plan_groups([("a", 4)], 10) == [] and plan_groups([], 10) == []


def test_compaction_keeps_every_row_once_and_cuts_the_file_count(tmp_path):
    root = tmp_path / "cache"
    _many_small_shards(root)
    before = _contents(root)
    assert len(before[0]) == len(set(before[0])) == 24 * 12
    files_before = _files(root)
    report = compact_cache(root, target_mb=0.012, progress=False)  # ~5 of these shards per compacted one
    assert report.merged > 12 and report.compacted >= 2 and report.shards_after < report.shards_before / 3
    assert _contents(root) == before
    assert _files(root) < files_before / 2
    verify_cache(root, progress=False)
    again = compact_cache(root, target_mb=0.012, progress=False)
    assert again.merged == 0 and _contents(root) == before, "a second run finds nothing to do"
    # Writers dedupe against compacted shards as against any other.
    cache = CaptionCache(root)
    recipe = next(iter(cache.recipes()))
    assert cache.commit([caption_row(f"{0:064x}", "img0.png", recipe, "p0", 0, "other text", "stop", 2)]).shard is None


@pytest.mark.parametrize("crash_at", range(1, 12))
def test_a_compaction_killed_at_any_step_leaves_every_row_once_and_a_rerun_finishes(tmp_path, monkeypatch, crash_at):
    """The process dies at the n-th rename or delete it makes (each file operation of a compaction, in turn)."""
    root = tmp_path / "cache"
    _many_small_shards(root, shards=12)
    before = _contents(root)
    calls = {"n": 0}
    real_rename, real_unlink = os.rename, Path.unlink

    class Killed(BaseException):
        pass

    def count() -> None:
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise Killed

    def rename(src, dst, *args, **kwargs):
        count()
        return real_rename(src, dst, *args, **kwargs)

    def unlink(self, *args, **kwargs):
        count()
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(Path, "unlink", unlink)
    try:
        compact_cache(root, target_mb=0.012, progress=False)
    except Killed:
        pass
    monkeypatch.undo()
    assert _contents(root) == before, f"after a kill at file operation {crash_at}"
    verify_cache(root, progress=False)
    compact_cache(root, target_mb=0.012, progress=False)
    assert _contents(root) == before
    verify_cache(root, progress=False)
    assert len(CaptionCache(root).shard_ids()) <= 12 / 2
    assert not any(
        p.name.endswith(".json") and not (root / "captions" / f"{p.stem}.parquet").exists()
        for p in (root / "manifests").iterdir()
    ), "no manifest left without its shard"


def test_readers_see_every_row_once_while_a_compaction_runs(tmp_path):
    root = tmp_path / "cache"
    _many_small_shards(root, shards=40)
    before = _contents(root)
    seen: list[bool] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read_all_the_time() -> None:
        try:
            while not done.is_set():
                seen.append(_contents(root) == before)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread, which fails on it
            errors.append(exc)

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        compact_cache(root, target_mb=0.004, progress=False)
    finally:
        done.set()
        reader.join()
    assert not errors, f"a read failed while the compaction ran: {errors[0]!r}"
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} reads differed"


def test_cache_compact_cli_survives_sigkill_and_refuses_a_non_cache(tmp_path):
    root = tmp_path / "cache"
    _many_small_shards(root, shards=60)
    before = _contents(root)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "cache", "compact", str(root), "--target-mb", "0.004", "--no-progress"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:  # killed once the first compacted shard is published, mid-run
        while proc.poll() is None and not any("-compacted-" in p.name for p in (root / "captions").iterdir()):
            time.sleep(0.005)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert _contents(root) == before
    out = tcjepa("cache", "compact", root, "--target-mb", "0.004", "--no-progress")
    assert "merged into" in out.stdout and _contents(root) == before
    tcjepa("cache", "verify", root, "--no-progress")
    refusal = refused("cache", "compact", tmp_path)
    assert refusal.returncode == 2 and "is not a caption cache" in refusal.stderr
    with pytest.raises(UserError, match="--target-mb must be positive"):
        compact_cache(root, target_mb=0)


@pytest.mark.s3
def test_a_remote_cache_compacts_through_its_log_and_stale_mirrors_catch_up(tmp_path, s3_env):
    """Two hosts write an s3:// cache; a third compacts it; a mirror made before the compaction and one made after
    both read every row once, and the replaced shards' objects are gone from the bucket."""
    from captioning.remote_cache import RemoteCaptionCache, mirror_cache

    bucket = "compaction"
    _s3fs().mkdir(bucket)
    url = f"s3://{bucket}/compact-me"
    writers = [RemoteCaptionCache.open_or_create(url, tmp_path / f"host-{h}") for h in "ab"]
    recipe = writers[0].add_recipe({"kind": "test", "model": "m"}, "mine")
    writers[1].add_recipe({"kind": "test", "model": "m"}, "mine")
    for k in range(12):
        rows = [
            caption_row(f"{i:064x}", f"img{i}.png", recipe, "p0", s, f"caption {i} {s} " * 4, "stop", 9)
            for i in range(k * 4, k * 4 + 4)
            for s in range(2)
        ]
        writers[k % 2].commit(rows)
    stale = mirror_cache(url, tmp_path / "stale")
    before = _contents(stale)
    assert len(before[0]) == len(set(before[0])) == 96
    fs = _s3fs()
    objects_before = len(fs.find(f"{bucket}/compact-me/captions"))
    report = compact_cache(url, target_mb=0.004, mirror=tmp_path / "compactor", progress=False)
    assert report.merged >= 6 and len(fs.find(f"{bucket}/compact-me/captions")) < objects_before
    assert _contents(mirror_cache(url, tmp_path / "stale")) == before  # the old mirror, synced after
    assert _contents(mirror_cache(url, tmp_path / "fresh")) == before  # a new one never fetches replaced shards
    verify_cache(url, progress=False)
    info = json.loads(
        tcjepa("cache", "info", url, "--json", "--mirror", tmp_path / "info").stdout
    )  # URLs work here too
    assert info["captions"] == 96 and info["shards"] == report.shards_after
    # A writer whose mirror predates the compaction still dedupes against every row.
    assert writers[1].commit(_first_rows(recipe)).shard is None
    assert compact_cache(url, target_mb=0.004, mirror=tmp_path / "compactor", progress=False).merged == 0


@pytest.mark.s3
def test_a_mirror_two_compactions_behind_holds_each_row_once(tmp_path, s3_env):
    """Shards A and B are compacted into C1, then C1 (with D) into C2, while a mirror holding A and B does not sync:
    when it does, C1 is skipped (replaced) and C2 fetched, and A and B must go, though no shard it holds names them
    (before, they stayed beside C2 and their rows were read twice)."""
    from captioning.compact import _read_group
    from captioning.remote_cache import RemoteCaptionCache, mirror_cache

    _s3fs().mkdir("chained")
    url = "s3://chained/cache"
    writer = RemoteCaptionCache.open_or_create(url, tmp_path / "writer")
    recipe = writer.add_recipe({"kind": "test", "model": "m"}, "mine")
    for k in range(3):
        writer.commit([caption_row(f"{k:064x}", f"img{k}.png", recipe, "p0", 0, f"caption {k}", "stop", 2)])
    stale = mirror_cache(url, tmp_path / "stale")
    before = _contents(stale)
    a, b, d = writer.shard_ids()
    first = writer.replace_shards([a, b], *_read_group(writer, [a, b]))
    assert first is not None
    second = writer.replace_shards([first, d], *_read_group(writer, [first, d]))
    assert second is not None and writer.shard_ids() == [second]
    assert _contents(mirror_cache(url, tmp_path / "stale")) == before
    assert CaptionCache(stale).shard_ids() == [second]


def _first_rows(recipe: str) -> list[dict]:
    return [caption_row(f"{0:064x}", "img0.png", recipe, "p0", 0, "another text", "stop", 2)]


def _s3fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)
