import json
import multiprocessing as mp
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from captioning.cache import CacheInfo, CaptionCache, caption_row
from captioning.verify import verify_cache
from pipeline.core.errors import UserError
from pipeline.core.recipes import recipe_hash
from tests.support.commands import refused, tcjepa

RECIPE = {"kind": "test", "model": "m"}


def _rows(recipe, images, samples=2, prefix="cap"):
    return [
        caption_row(f"{i:064x}", f"img{i}.png", recipe, "p0", s, f"{prefix} {i} {s}", "stop", 5)
        for i in images
        for s in range(samples)
    ]


def _keys(cache):
    table = cache.read_captions(columns=["image_sha256", "recipe", "prompt_id", "sample"])
    return [tuple(r.values()) for r in table.to_pylist()]


def test_commit_dedupes_and_is_readable_by_datasets(tmp_path):
    import datasets

    cache = CaptionCache.open_or_create(tmp_path / "c")
    recipe = cache.add_recipe(RECIPE, "mine")
    first = cache.commit(_rows(recipe, range(5)))
    again = cache.commit(_rows(recipe, range(3, 8)) + _rows(recipe, range(3, 8)))
    assert (first.captions_added, again.captions_added, again.captions_duplicate) == (10, 6, 4)
    nothing = cache.commit(_rows(recipe, range(8)))
    assert nothing.shard is None and nothing.captions_added == 0
    keys = _keys(cache)
    assert len(keys) == len(set(keys)) == 16
    ds = datasets.load_dataset("parquet", data_files=cache.caption_files(), split="train")
    assert len(ds) == 16 and set(ds.column_names) >= {
        "image_sha256",
        "recipe",
        "prompt_id",
        "sample",
        "text",
        "finish_reason",
    }
    # a fresh handle (another process) sees the same keys and dedupes against them
    other = CaptionCache(tmp_path / "c")
    assert other.commit(_rows(recipe, range(2))).captions_added == 0
    manifests = sorted((tmp_path / "c" / "manifests").glob("*.json"))
    assert len(manifests) == len(cache.shard_ids()) == 2
    doc = json.loads(manifests[0].read_text())
    assert doc["files"]["captions"]["rows"] == 10 and doc["recipes"] == {recipe: 10}


def test_failures_are_their_own_table(tmp_path):
    cache = CaptionCache.open_or_create(tmp_path / "c")
    recipe = cache.add_recipe(RECIPE)
    fail = {"image_sha256": None, "source_id": "broken.png", "recipe": recipe, "reason": "truncated file"}
    cache.commit(_rows(recipe, [1]), [fail])
    cache.commit([], [fail])
    assert cache.read_failures().num_rows == 1
    assert cache.read_captions().num_rows == 2
    assert cache.info().failures == 1


def test_unknown_recipe_rows_are_refused(tmp_path):
    cache = CaptionCache.open_or_create(tmp_path / "c")
    with pytest.raises(ValueError, match="not stored"):
        cache.commit(_rows("0" * 64, [1]))


def test_missing_manifest_is_rebuilt_and_stray_temporaries_removed(tmp_path):
    cache = CaptionCache.open_or_create(tmp_path / "c")
    recipe = cache.add_recipe(RECIPE)
    shard = cache.commit(_rows(recipe, [1])).shard
    (tmp_path / "c" / "manifests" / f"{shard}.json").unlink()  # as if killed between rename and manifest
    (tmp_path / "c" / "tmp" / "captions-dead.parquet").write_bytes(b"half a parquet file")
    (tmp_path / "c" / "failures" / "orphan.parquet").write_bytes(b"x")
    cache.commit(_rows(recipe, [2]))
    assert (tmp_path / "c" / "manifests" / f"{shard}.json").exists()
    assert not any((tmp_path / "c" / "tmp").iterdir())
    assert not (tmp_path / "c" / "failures" / "orphan.parquet").exists()


def test_resolve_recipes(tmp_path):
    cache = CaptionCache.open_or_create(tmp_path / "c")
    with pytest.raises(UserError, match="no recipes"):
        cache.resolve_recipes([])
    a = cache.add_recipe({"kind": "a"}, "alpha")
    assert cache.resolve_recipes([]) == [a]
    b = cache.add_recipe({"kind": "b"}, "beta")
    with pytest.raises(UserError, match="several recipes.*alpha.*beta|several recipes.*beta.*alpha"):
        cache.resolve_recipes([])
    assert cache.resolve_recipes(["beta", a[:8]]) == [b, a]
    with pytest.raises(UserError, match="matches no recipe"):
        cache.resolve_recipes(["gamma"])


def test_not_a_cache(tmp_path):
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(UserError, match="not a caption cache"):
        CaptionCache.open_or_create(tmp_path)
    with pytest.raises(UserError, match="no CACHE.json"):
        CaptionCache(tmp_path)


def _writer(root, start, stop, chunk, also: dict | None = None):
    """One writer process: stores the recipe itself (as each `tcjepa caption` does), then commits in chunks."""
    cache = CaptionCache(root)
    recipes = [cache.add_recipe(RECIPE, f"writer {start}"), *([cache.add_recipe(also)] if also else [])]
    for lo in range(start, stop, chunk):
        cache.commit([row for r in recipes for row in _rows(r, range(lo, min(lo + chunk, stop)), samples=3)])


def _assert_each_key_once(root, per_recipe: dict[str, int]) -> None:
    cache = CaptionCache(root)
    keys = _keys(cache)
    assert len(keys) == len(set(keys)) == sum(per_recipe.values())
    assert sum(pq.read_metadata(f).num_rows for f in cache.caption_files()) == len(keys)
    assert {r["hash"]: r["captions"] for r in cache.info().recipes} == per_recipe
    verify_cache(root, progress=False)


@pytest.mark.distributed
def test_concurrent_writer_processes_with_overlapping_inputs(tmp_path):
    """Five processes store the same recipe at once (two of them a second one too) and commit images [0, 40) in
    different chunkings; every caption ends up in the cache once, and the cache verifies."""
    CaptionCache.open_or_create(tmp_path / "c")
    other = {"kind": "test", "model": "other"}
    ctx = mp.get_context("spawn")
    specs = [(0, 40, 3, None), (4, 40, 4, other), (7, 40, 5, None), (9, 40, 6, other), (0, 40, 7, None)]
    procs = [ctx.Process(target=_writer, args=(tmp_path / "c", *spec)) for spec in specs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    _assert_each_key_once(tmp_path / "c", {recipe_hash(RECIPE): 120, recipe_hash(other): 3 * 36})
    assert CaptionCache(tmp_path / "c").recipes()[recipe_hash(RECIPE)].name.startswith("writer "), "one name wins"


def test_concurrent_writers_in_threads(tmp_path):
    """The same protocol in process: handles of their own, committing overlapping chunks at the same moments."""
    CaptionCache.open_or_create(tmp_path / "c")
    start = threading.Barrier(4)

    def write(first: int, chunk: int) -> None:
        start.wait()
        _writer(tmp_path / "c", first, 40, chunk)

    threads = [threading.Thread(target=write, args=spec) for spec in ((0, 3), (2, 4), (5, 5), (0, 40))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _assert_each_key_once(tmp_path / "c", {recipe_hash(RECIPE): 120})


def test_cache_info_summary_is_a_line_of_counts_then_a_row_per_recipe():
    recipes = [
        {"hash": "ab" * 32, "name": "coco", "kind": "annotations", "images": 2, "captions": 3},
        {"hash": "cd" * 32, "name": None, "kind": "vlm", "images": 1, "captions": 8},
    ]
    assert CacheInfo(shards=1, captions=11, images=2, failures=4, recipes=recipes).summary("s3://b/c") == (
        "s3://b/c: 2 images, 11 captions, 1 shards, 4 failures\n"
        f"  recipe {'ab' * 6}  annotations  coco                             2 images          3 captions\n"
        f"  recipe {'cd' * 6}  vlm          -                                1 images          8 captions"
    )


def test_cache_info_cli(annotated_cache):
    out = json.loads(tcjepa("cache", "info", annotated_cache, "--json").stdout)
    assert out["images"] == 40 and out["captions"] == 320 and out["shards"] == 1
    (recipe,) = out["recipes"]
    assert recipe["kind"] == "annotations" and recipe["name"] == "captions" and recipe["captions"] == 320
    table = tcjepa("cache", "info", annotated_cache).stdout
    assert "40 images, 320 captions" in table and recipe["hash"][:12] in table
    bad = refused("cache", "info", annotated_cache / "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


def test_shards_read_at_once_come_back_in_shard_order(tmp_path, monkeypatch):
    """`read_captions` reads its shards on a thread pool; the table is the one a shard-by-shard read gives."""
    import captioning.cache as cache_module

    cache = CaptionCache.open_or_create(tmp_path / "c")
    recipe = cache.add_recipe(RECIPE, "mine")
    for start in range(0, 40, 5):  # 8 shards, each with later rows than the one before, and a failure
        fail = {"image_sha256": None, "source_id": f"bad{start}.png", "recipe": recipe, "reason": "truncated file"}
        cache.commit(_rows(recipe, range(start, start + 5), samples=1), [fail])
    assert len(cache.shard_ids()) == 8
    monkeypatch.setattr(cache_module, "READ_THREADS", 1)
    one_at_a_time = cache.read_captions(), cache.read_failures()
    monkeypatch.setattr(cache_module, "READ_THREADS", 8)
    at_once = cache.read_captions(), cache.read_failures()
    assert at_once[0].equals(one_at_a_time[0]) and at_once[1].equals(one_at_a_time[1])
    assert at_once[0].column("source_id").to_pylist() == [f"img{i}.png" for i in range(40)]
    assert at_once[1].column("source_id").to_pylist() == [f"bad{i}.png" for i in range(0, 40, 5)]


def test_digest_columns_are_read_as_32_bytes_shard_by_shard(tmp_path):
    """`digests=`: each shard's hex column decoded as it is read; the bytes are the hex's, rows in shard order,
    another recipe's rows filtered out first; an empty cache has the binary column too; a bad value reads as null."""
    cache = CaptionCache.open_or_create(tmp_path / "c")
    mine, other = cache.add_recipe(RECIPE, "mine"), cache.add_recipe({**RECIPE, "model": "n"}, "other")
    empty = cache.read_captions(columns=["text_sha256", "sample"], digests=["text_sha256"])
    assert empty.num_rows == 0 and empty.schema.field("text_sha256").type == pa.binary(32)
    for start in range(0, 12, 4):
        cache.commit(_rows(mine, range(start, start + 4)) + _rows(other, range(start, start + 2), prefix="o"))
    hexes = cache.read_captions(columns=["text_sha256", "image_sha256"], recipes=[mine])
    got = cache.read_captions(columns=["text_sha256", "image_sha256"], recipes=[mine], digests=["text_sha256"])
    assert got.num_rows == 24 and got.column("text_sha256").num_chunks == 3
    assert got.column("text_sha256").to_pylist() == [bytes.fromhex(h) for h in hexes.column("text_sha256").to_pylist()]
    assert got.column("image_sha256").equals(hexes.column("image_sha256"))

    bad = tmp_path / "c" / "captions" / "zz-bad.parquet"
    rows = _rows(mine, [99], samples=4)
    wrong = ["ab" * 31, "zz" * 32, "ab" * 31 + " a", rows[3]["text_sha256"]]  # short, not hex, a space, good
    pq.write_table(pa.Table.from_pylist([{**r, "text_sha256": w} for r, w in zip(rows, wrong)]), bad)
    read = CaptionCache(tmp_path / "c").read_captions(columns=["text_sha256"], digests=["text_sha256"])
    assert read.column("text_sha256").to_pylist()[-4:] == [None, None, None, bytes.fromhex(wrong[3])], "bad: null"
