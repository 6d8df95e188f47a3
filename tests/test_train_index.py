import hashlib
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from captioning.annotations import import_annotations
from captioning.cache import CAPTION_SCHEMA, CaptionCache
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore
from pipeline.core.arrow_pool import USER_CHOICE, bulk_memory_pool
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.recipes import text_key
from pipeline.core.refs import ImageRefs
from pipeline.core.sources import ImageReader, list_images
from tests.support.images import png
from tests.support.repo import REPO
from tests.support.stores import store_keys
from train import data_index
from train.data_index import (
    NEIGHBOURS_COMPARED,
    HexDigests,
    TrainIndex,
    _hex_bytes,
    build_index,
    first_of_each_pair,
    lexsort_unless_sorted,
)

N = 40  # images in the session's synth_dir, 8 captions each
EXTRA = 10  # images that get one extra caption (and one repeated text) in a second recipe


@pytest.fixture(scope="module")
def store(vector_store):
    """A store of every caption of `annotated_cache` (made-up vectors: the index reads only its keys)."""
    return vector_store


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, synth_dir):
    """A cache with the synth captions (recipe "captions"), an "extra" recipe the store has never seen,
    and a failure record for an undecodable image of the folder `odd` (beside 10 images unknown to
    the cache and a dangling link)."""
    root = tmp_path_factory.mktemp("mixed")
    lines = [json.loads(line) for line in (synth_dir / "captions.jsonl").read_text().splitlines()]
    extra = [
        {"image": e["image"], "captions": [e["captions"][0], f"an extra caption for image {i}"]}
        for i, e in enumerate(lines[:EXTRA])
    ]
    (root / "extra.jsonl").write_text("".join(json.dumps(e) + "\n" for e in extra))
    cache = CaptionCache.open_or_create(root / "cache")
    import_annotations(cache, synth_dir / "captions.jsonl")
    extra_recipe = import_annotations(cache, root / "extra.jsonl", synth_dir, "extra").recipe
    odd = root / "odd"
    odd.mkdir()
    for i in range(10):
        (odd / f"new{i}.png").write_bytes(png((20 * i, 50, 200), (32, 32)))
    broken = b"\x89PNG\r\n\x1a\n broken"
    (odd / "broken.png").write_bytes(broken)
    (odd / "gone.png").symlink_to(odd / "nowhere.png")
    cache.commit(
        [],
        [
            {
                "image_sha256": hashlib.sha256(broken).hexdigest(),
                "source_id": "broken.png",
                "recipe": extra_recipe,
                "reason": "corrupt or truncated image (broken data stream)",
            }
        ],
    )
    return root / "cache", odd


def _same(a: TrainIndex, b: TrainIndex) -> None:
    assert a.refs == b.refs and a.sha256 == b.sha256 and a.recipes == b.recipes and a.coverage == b.coverage
    assert a.left_out == b.left_out and a.missing_embeddings == b.missing_embeddings
    assert (
        a.caption_offsets.dtype == b.caption_offsets.dtype == np.int64
        and a.caption_keys.dtype == b.caption_keys.dtype == np.uint8
    )
    np.testing.assert_array_equal(a.caption_offsets, b.caption_offsets)
    np.testing.assert_array_equal(a.caption_keys, b.caption_keys)
    assert a.segments == b.segments
    for index in (a, b):  # columns, not a Python object per image
        assert isinstance(index.refs, ImageRefs) and isinstance(index.sha256, HexDigests)
        assert index.sha256.values.dtype == np.uint8 and index.sha256.values.shape == (len(index), 32)
    for name in ("segment", "start", "length"):
        got, want = getattr(a.caption_spans, name), getattr(b.caption_spans, name)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_synth_images_are_fully_covered_without_rehashing(tmp_path, synth_dir, annotated_cache, store, monkeypatch):
    reads = []

    class CountingReader(ImageReader):
        def read(self, ref):
            reads.append(ref.source_id)
            return super().read(ref)

    monkeypatch.setattr("pipeline.core.sources.ImageReader", CountingReader)  # the index build reads through it
    index = build_index([synth_dir], annotated_cache, store, [], verify_sample=5, progress=False)
    assert len(reads) == 5, "only the verification sample is read; the cache knows every image's sha256"
    assert len(index) == N and index.coverage == {8: N} and index.left_out == {} and index.missing_embeddings == 0
    assert index.coverage_line() == f"{N} images: 0 captions 0, 1–7 0, 8 {N}; 100.0% with at least one"
    reader = ImageReader()
    assert index.sha256 == [hashlib.sha256(reader.read(r)).hexdigest() for r in index.refs]
    assert [r.source_id for r in index.refs] == sorted(f"images/{i:06d}.png" for i in range(N))
    assert (EmbeddingReader(store).locate(index.caption_keys) >= 0).all() and index.caption_keys.shape == (8 * N, 32)

    rows = CaptionCache(annotated_cache).read_captions().to_pylist()
    image0 = sorted(
        (r for r in rows if r["image_sha256"] == index.sha256[0]), key=lambda r: (r["prompt_id"], r["sample"])
    )
    assert [k.tobytes() for k in index.captions_of(0)] == [text_key(r["text"]) for r in image0]

    index.save(tmp_path / "index.parquet")
    _same(index, TrainIndex.load(tmp_path / "index.parquet", keys=True))


@pytest.fixture
def mimalloc_default(monkeypatch):
    """pyarrow's own default (mimalloc) as the process's pool, whatever this process was started with."""
    monkeypatch.delenv(USER_CHOICE, raising=False)
    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.mimalloc_memory_pool())
    yield pa.default_memory_pool()
    pa.set_memory_pool(before)


def test_the_join_and_the_load_allocate_on_jemalloc_and_give_the_default_pool_back(
    tmp_path, synth_dir, annotated_cache, store, mimalloc_default
):
    """pyarrow's default (mimalloc) costs the join several times the kernel time at 10⁷ captions (arrow_pool.py)."""
    jemalloc = pa.jemalloc_memory_pool()
    made, made_by_default = jemalloc.total_bytes_allocated(), mimalloc_default.total_bytes_allocated()
    index = build_index([synth_dir], annotated_cache, store, [], verify_sample=1, progress=False)
    assert len(index) == N and pa.default_memory_pool().backend_name == "mimalloc"
    # the join's own Arrow work went to jemalloc; Parquet's readers take some from Arrow's C++ default regardless
    assert jemalloc.total_bytes_allocated() - made > mimalloc_default.total_bytes_allocated() - made_by_default
    index.save(tmp_path / "index.parquet")  # every rank loads it (the save: rank 0 once, faster on mimalloc)
    made = jemalloc.total_bytes_allocated()
    _same(index, TrainIndex.load(tmp_path / "index.parquet", keys=True))
    assert jemalloc.total_bytes_allocated() > made  # the Parquet reads' buffers that pyarrow's default pool serves
    assert pa.default_memory_pool().backend_name == "mimalloc"


def test_an_index_saved_in_many_row_groups_loads_as_one(tmp_path, synth_dir, annotated_cache, store):
    """At ImageNet sizes the index's Parquet has several row groups (1 M rows each), read as chunks: each column's
    chunks are laid end to end, every chunk's offsets from its own first row."""
    index = build_index([synth_dir], annotated_cache, store, [], verify_sample=1, progress=False)
    index.save(tmp_path / "one.parquet")
    table = pq.read_table(tmp_path / "one.parquet")
    pq.write_table(table, tmp_path / "many.parquet", row_group_size=7)  # 40 images: 6 groups, the last of 5
    assert pq.ParquetFile(tmp_path / "many.parquet").metadata.num_row_groups == 6
    loaded = TrainIndex.load(tmp_path / "many.parquet", keys=True)
    _same(index, loaded)
    assert all(column.flags.owndata for column in (loaded.caption_keys, loaded.caption_offsets, loaded.sha256.values))


def test_overlapping_bulk_blocks_give_the_pool_back_when_the_last_ends(mimalloc_default, monkeypatch):
    first, second = bulk_memory_pool(), bulk_memory_pool()
    assert first.__enter__().backend_name == "jemalloc"
    assert second.__enter__().backend_name == "jemalloc"
    first.__exit__(None, None, None)  # ended before the block it overlaps, as another thread's may
    assert pa.default_memory_pool().backend_name == "jemalloc"
    second.__exit__(None, None, None)
    assert pa.default_memory_pool().backend_name == "mimalloc"
    # A pool the user chose is kept: by the environment variable, or set in the process.
    monkeypatch.setenv(USER_CHOICE, "mimalloc")
    with bulk_memory_pool() as pool:
        assert pool.backend_name == pa.default_memory_pool().backend_name == "mimalloc"
    monkeypatch.delenv(USER_CHOICE)
    pa.set_memory_pool(pa.system_memory_pool())
    with bulk_memory_pool() as pool:
        assert pool.backend_name == pa.default_memory_pool().backend_name == "system"
    pa.set_memory_pool(mimalloc_default)

    def not_built() -> pa.MemoryPool:
        raise NotImplementedError("jemalloc disabled")  # as pyarrow's Windows wheels answer

    monkeypatch.setattr(pa, "jemalloc_memory_pool", not_built)
    with bulk_memory_pool() as pool:
        assert pool.backend_name == pa.default_memory_pool().backend_name == "mimalloc"


def test_same_names_different_images_are_rehashed(tmp_path, annotated_cache, capsys):
    (tmp_path / "images").mkdir()
    for i in range(N):
        (tmp_path / "images" / f"{i:06d}.png").write_bytes(png((5 * i, 100, 30), (32, 32)))
    index = build_index([tmp_path], annotated_cache, None, [], min_coverage=0, verify_sample=3, progress=False)
    assert "hashing every image" in capsys.readouterr().err
    reader = ImageReader()
    assert index.sha256 == [hashlib.sha256(reader.read(r)).hexdigest() for r in index.refs]
    assert index.coverage == {0: N}


def test_coverage_below_the_threshold_is_refused(synth_dir, mixed):
    cache, odd = mixed
    with pytest.raises(
        UserError, match=r"50 images: 0 captions 10, 1–7 0, 8 40; 80\.0% with at least one.*lower --min-coverage"
    ):
        build_index([synth_dir, odd], cache, None, ["captions"], progress=False)
    index = build_index([synth_dir, odd], cache, None, ["captions"], min_coverage=0, progress=False)
    assert index.coverage == {0: 10, 8: N}
    assert index.left_out == {
        "corrupt or truncated image": 1,
        "unreadable": 1,
    }  # recorded as undecodable; dangling link
    assert "2 images left out (corrupt or truncated image 1, unreadable 1)" in index.coverage_line()
    assert [r.source_id for r in index.refs[N:]] == [f"new{i}.png" for i in range(10)]


def test_captions_the_store_lacks_are_dropped_and_counted(tmp_path, synth_dir, mixed, store):
    cache, _ = mixed
    with pytest.raises(UserError, match="several recipes; choose with --recipe"):
        build_index([synth_dir], cache, store, [], progress=False)
    loose = build_index([synth_dir], cache, None, ["extra", "captions"], progress=False)
    assert loose.coverage == {8: N - EXTRA, 9: EXTRA}, "the repeated text counts once per image"
    first = json.loads((synth_dir / "captions.jsonl").read_text().splitlines()[0])
    assert first["image"] == loose.refs[0].source_id
    # recipes in the order asked
    expected = [
        first["captions"][0],
        "an extra caption for image 0",
        *first["captions"][1:],
    ]
    assert [k.tobytes() for k in loose.captions_of(0)] == [text_key(t) for t in expected]

    index = build_index([synth_dir], cache, store, ["captions", "extra"], progress=False)
    assert index.coverage == {8: N} and index.missing_embeddings == EXTRA
    assert f"{EXTRA} captions not in the embedding store were dropped (run `tcjepa embed`" in index.coverage_line()
    assert (EmbeddingReader(store).locate(index.caption_keys) >= 0).all()
    index.save(tmp_path / "index.parquet")
    _same(index, TrainIndex.load(tmp_path / "index.parquet", keys=True))


def test_without_a_cache_every_image_trains_without_text(tmp_path, synth_dir, store):
    index = build_index([synth_dir], None, None, [], progress=False)
    assert len(index) == N and index.coverage == {0: N} and index.caption_keys.shape == (0, 32) and index.recipes == []
    assert index.coverage_line() == f"{N} images: 0 captions {N}; 0.0% with at least one"
    index.save(tmp_path / "index.parquet")
    _same(index, TrainIndex.load(tmp_path / "index.parquet", keys=True))
    with pytest.raises(UserError, match="--store needs --cache"):
        build_index([synth_dir], None, store, [], progress=False)


def test_the_index_needs_no_deep_learning_libraries():
    code = "import sys, train.data_index; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        == "[]"
    )


@pytest.mark.parametrize(
    "content", ["another table", "metadata not JSON", "JSON not an object", "not Parquet", "empty"]
)
def test_a_file_that_is_not_an_index_is_refused(tmp_path, content):
    path = tmp_path / "index.parquet"
    if content == "not Parquet" or content == "empty":
        path.write_bytes(b"" if content == "empty" else b"PAR1 not really")
    else:
        metadata = {"another table": None, "metadata not JSON": b"{oops", "JSON not an object": b"[1]"}[content]
        table = pa.table({"source_id": ["a"]})
        pq.write_table(table.replace_schema_metadata({"tcjepa": metadata} if metadata else None), path)
    for read in (TrainIndex.load, TrainIndex.read_meta, lambda p: TrainIndex.stale_segments(p, [])):
        with pytest.raises(UserError, match="is not a tcjepa train index v2; delete it to rebuild the index"):
            read(path)


def test_an_index_is_written_straight_to_its_file_and_a_failed_save_leaves_the_old_one(
    tmp_path, synth_dir, monkeypatch
):
    """The Parquet file is written to a temporary sibling as it is made (at 10^8 captions it is GBs; it was made in
    memory first), then renamed into place: a save that fails half-way keeps the index there before, whole."""
    index = build_index([synth_dir], None, None, [], progress=False)
    path = tmp_path / "index.parquet"
    index.save(path)
    before = path.read_bytes()
    written: list[object] = []

    def half(table: pa.Table, where: object, **kwargs: object) -> None:
        written.append(where)
        where.write(before[: len(before) // 2])  # type: ignore[attr-defined]
        raise OSError("No space left on device")

    monkeypatch.setattr(data_index.pq, "write_table", half)
    with pytest.raises(OSError, match="No space left"):
        index.save(path)
    assert getattr(written[0], "name", "").endswith(".tmp"), "an open file, not a buffer in memory"
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["index.parquet"]


def test_images_of_no_caption_and_left_out_images_survive_a_round_trip(tmp_path, synth_dir, mixed, store):
    cache, odd = mixed
    index = build_index([synth_dir, odd], cache, store, ["captions", "extra"], min_coverage=0, progress=False)
    assert index.coverage == {0: 10, 8: N} and index.missing_embeddings == EXTRA and sum(index.left_out.values()) == 2
    assert [len(index.captions_of(i)) for i in range(len(index))] == [8] * N + [0] * 10
    index.save(tmp_path / "index.parquet")
    loaded = TrainIndex.load(tmp_path / "index.parquet", keys=True)
    _same(index, loaded)
    assert loaded.coverage_line() == index.coverage_line()
    lean = TrainIndex.load(tmp_path / "index.parquet")  # as training loads it: spans, no keys
    assert lean.caption_keys is None and np.array_equal(lean.caption_offsets, index.caption_offsets)
    for name in ("segment", "start", "length"):
        assert np.array_equal(getattr(lean.caption_spans, name), getattr(index.caption_spans, name))
    with pytest.raises(ValueError, match="keys=True"):
        lean.captions_of(0)


def _plain_join(refs, cache: CaptionCache, store, chosen: list[str]) -> dict:
    """The run index's join written the plain way, a dict per image: what `build_index` must equal."""
    reader = ImageReader()
    rows = cache.read_captions().to_pylist()
    failures = [f for f in cache.read_failures().to_pylist() if f["image_sha256"] is not None]
    recorded: dict[str, set[str]] = {}
    for r in rows + failures:
        recorded.setdefault(r["source_id"], set()).add(r["image_sha256"])
    listed = [r.source_id for r in refs]
    shas = []
    for ref in refs:
        known = recorded.get(ref.source_id, set())
        if len(known) == 1 and listed.count(ref.source_id) == 1:
            shas.append(next(iter(known)))
            continue
        try:
            shas.append(hashlib.sha256(reader.read(ref)).hexdigest())
        except OSError:
            shas.append(None)
    chosen_rows = [r for r in rows if r["recipe"] in chosen]
    ordered = sorted(chosen_rows, key=lambda r: (chosen.index(r["recipe"]), r["prompt_id"], r["sample"]))
    captions: dict[str, list[str]] = {}
    for r in ordered:
        if r["text_sha256"] not in captions.setdefault(r["image_sha256"], []):
            captions[r["image_sha256"]].append(r["text_sha256"])
    rejected: dict[str, str] = {}
    for f in sorted(failures, key=lambda f: (f["image_sha256"], f["reason"])):
        if f["image_sha256"] not in captions:
            rejected.setdefault(f["image_sha256"], f["reason"].split(" (")[0])
    held = {k.hex() for k in store_keys(store)}
    kept, left_out, per_image = [], {}, []
    for ref, sha in zip(refs, shas):
        reason = "unreadable" if sha is None else rejected.get(sha)
        if reason:
            left_out[reason] = left_out.get(reason, 0) + 1
            continue
        kept.append((ref, sha))
        per_image.append(captions.get(sha, []))
    missing = {k for keys in per_image for k in keys} - held
    per_image = [[k for k in keys if k in held] for keys in per_image]
    coverage: dict[int, int] = {}
    for keys in per_image:
        coverage[len(keys)] = coverage.get(len(keys), 0) + 1
    return {
        "refs": [ref for ref, _ in kept],
        "sha256": [sha for _, sha in kept],
        "captions": [keys for keys in per_image],
        "left_out": left_out,
        "missing": len(missing),
        "coverage": dict(sorted(coverage.items())),
    }


@pytest.mark.parametrize("seed, in_order", [(0, False), (1, False), (2, True)])
def test_the_columnar_join_equals_the_plain_join_on_a_random_cache(tmp_path, seed, in_order, monkeypatch):
    """A cache and folders drawn at random: two folders with some of the same file names (a repeated source id is
    hashed), images with the same bytes under two names, ids the cache recorded with two different sha256s, two
    recipes with texts repeated within and across them, prompts and samples out of order, failures of captioned
    and uncaptioned images, a store missing some texts, an unreadable file. The index equals the plain join.
    `in_order`: each image's rows as a caption job writes them, by recipe, prompt and sample, so that the join takes
    them as they are for the recipes in that order, and sorts them for the recipes reversed."""

    rng = np.random.default_rng(seed)
    folders = [tmp_path / "one" / "images", tmp_path / "two" / "images"]  # one source id names two images
    colours = rng.integers(0, 256, size=(30, 3))
    for folder, names in zip(folders, (range(0, 24), range(18, 30))):
        folder.mkdir(parents=True)
        for i in names:  # the folders share 18–23 by name; in two, image i has the bytes of i - 12 in one
            colour = colours[i % 12 if folder.parent.name == "two" else i]
            (folder / f"{i:03d}.png").write_bytes(png(tuple(colour), (8, 8)))
    (folders[1] / "999.png").symlink_to(folders[1] / "gone.png")
    refs = list_images(folders)
    shas = {r.source_id: hashlib.sha256(ImageReader().read(r)).hexdigest() for r in refs if "999" not in r.source_id}
    cache = CaptionCache.open_or_create(tmp_path / "cache")
    recipes = [cache.add_recipe({"kind": "test", "n": k}, f"r{k}") for k in range(2)]
    vocabulary = [f"a caption of kind {k}" for k in range(25)]
    rows, failures = [], []
    for source_id, sha in shas.items():
        if rng.random() < 0.4:  # a failure record: of an image no recipe captioned (rejected), or of one it did
            reason = ["too small (3 x 3)", "corrupt or truncated image (bad data)"][len(failures) % 2]
            failures.append({"image_sha256": sha, "source_id": source_id, "recipe": recipes[1], "reason": reason})
            if rng.random() < 0.6:
                continue
        first = len(rows)
        for recipe in recipes:
            for sample in rng.permutation(int(rng.integers(0, 5))).tolist():
                text = vocabulary[int(rng.integers(len(vocabulary)))]
                prompt = f"p{int(rng.integers(3))}"
                rows.append(_row(sha, source_id, recipe, prompt, sample, text))
        if rng.random() < 0.15:  # another sha256 for the id, least, before or after its own rows: ambiguous, so hashed
            at = first if rng.random() < 0.5 else len(rows)
            rows.insert(at, _row("0" * 64, source_id, recipes[0], "p9", 0, "a caption of a different image"))
    if in_order:
        first_seen = {sha: k for k, sha in reversed(list(enumerate(row["image_sha256"] for row in rows)))}
        rows.sort(
            key=lambda r: (first_seen[r["image_sha256"]], recipes.index(r["recipe"]), r["prompt_id"], r["sample"])
        )
    cache.commit(rows, failures)
    store = EmbeddingStore.open_or_create(tmp_path / "store", {"kind": "test"}, 4)
    writer = store.new_segment()
    for text in vocabulary[::2]:
        writer.append(text_key(text), np.ones((2, 4), np.float32))
    writer.finish()
    store.publish(writer)

    sorted_or_not = []  # per build: whether the join took the rows as they were
    monkeypatch.setattr(
        data_index,
        "lexsort_unless_sorted",
        lambda columns: sorted_or_not.append(order := lexsort_unless_sorted(columns)) or order,
    )
    reasons = set()
    for chosen in (recipes, recipes[::-1], recipes[1:]):
        index = build_index(folders, tmp_path / "cache", tmp_path / "store", chosen, 0, verify_sample=0, progress=False)
        plain = _plain_join(refs, cache, tmp_path / "store", chosen)
        assert index.refs == plain["refs"] and index.sha256 == plain["sha256"]
        assert [[k.tobytes().hex() for k in index.captions_of(i)] for i in range(len(index))] == plain["captions"]
        assert index.left_out == plain["left_out"] and index.missing_embeddings == plain["missing"]
        assert index.coverage == plain["coverage"] and index.recipes == chosen
        reasons |= plain["left_out"].keys()
    assert {"unreadable"} < reasons <= {"unreadable", "too small", "corrupt or truncated image"}, "rejections drawn"
    assert plain["missing"] > 0 and 0 in plain["coverage"]
    assert [order is None for order in sorted_or_not[:2]] == [in_order, False]


def _row(sha: str, source_id: str, recipe: str, prompt: str, sample: int, text: str) -> dict:
    return {
        "image_sha256": sha,
        "source_id": source_id,
        "recipe": recipe,
        "prompt_id": prompt,
        "sample": sample,
        "text": text,
        "text_sha256": text_key(text).hex(),
        "finish_reason": "stop",
        "num_tokens": None,
    }


@pytest.mark.parametrize("bad", ["zz" * 32, "ab" * 31])
def test_a_cache_key_that_is_not_a_hex_digest_is_refused_in_one_line(tmp_path, synth_dir, bad):
    """Not hex, or too short: the build stops with one line naming the column and the command that finds it."""
    cache = CaptionCache.open_or_create(tmp_path / "cache")
    recipe = cache.add_recipe({"kind": "test"}, "r")
    first = list_images([synth_dir / "images"])[0]
    row = _row(hashlib.sha256(ImageReader().read(first)).hexdigest(), first.source_id, recipe, "p0", 0, "a caption")
    cache.commit([{**row, "text_sha256": bad}])
    line = r"^a text_sha256 value is not a 64-digit hex digest; run `tcjepa cache verify`$"
    with pytest.raises(DataProblem, match=line):
        build_index([synth_dir / "images"], tmp_path / "cache", None, [], 0, verify_sample=0, progress=False)

    # another recipe's good rows in the same shard as a bad one: a run on that recipe alone is not stopped
    other = cache.add_recipe({"kind": "test", "n": 2}, "other")
    good = {**row, "recipe": other}
    table = pa.Table.from_pylist([{**row, "text_sha256": bad, "sample": 1}, good], schema=CAPTION_SCHEMA)
    pq.write_table(table, tmp_path / "cache" / "captions" / "zz-mixed.parquet")
    index = build_index([synth_dir / "images"], tmp_path / "cache", None, ["other"], 0, verify_sample=0)
    assert index.coverage[1] == 1 and index.caption_keys.tobytes() == bytes.fromhex(good["text_sha256"])
    with pytest.raises(DataProblem, match=line):
        build_index([synth_dir / "images"], tmp_path / "cache", None, ["r", "other"], 0, verify_sample=0)


def test_lexsort_unless_sorted_is_numpys_lexsort_or_none_for_rows_in_order():
    rng = np.random.default_rng(0)
    sorted_seen = 0
    for _ in range(300):
        n, k = int(rng.integers(0, 12)), int(rng.integers(1, 4))
        columns = [rng.integers(0, 3, n) for _ in range(k)]
        if rng.random() < 0.5:  # rows put in order, ties included
            order = np.lexsort(columns)
            columns = [c[order] for c in columns]
        got, expected = lexsort_unless_sorted(columns), np.lexsort(columns)
        if got is None:
            sorted_seen += 1
            np.testing.assert_array_equal(expected, np.arange(n))  # numpy's sort is stable: in order, it moves nothing
        else:
            np.testing.assert_array_equal(got, expected)
            assert (expected != np.arange(n)).any()
    assert 100 < sorted_seen < 250


@pytest.mark.parametrize("string", [pa.string(), pa.large_string()])
def test_hex_digests_are_decoded_chunk_by_chunk(string):
    """Chunks of either string type, an empty one, one sliced from a longer array (its buffers start before it)."""
    digests = [bytes([i]) * 32 for i in range(7)]
    hexes = [d.hex() for d in digests]
    chunks = [pa.array(hexes[:3], string), pa.array([], string), pa.array(hexes[2:], string)[1:]]
    got = _hex_bytes(pa.chunked_array(chunks), 32, "text_sha256")
    np.testing.assert_array_equal(got, np.frombuffer(b"".join(digests), np.uint8).reshape(7, 32))
    short = pa.chunked_array([pa.array(hexes[:2], string), pa.array(["ab" * 31], string)])
    with pytest.raises(DataProblem, match="^a text_sha256 value is not a 64-digit hex digest"):
        _hex_bytes(short, 32, "text_sha256")
    missing = pa.chunked_array([pa.array([None, *hexes[:2]], string), pa.array([None], string)])
    with pytest.raises(DataProblem, match="^2 text_sha256 values are missing"):  # counted over every chunk
        _hex_bytes(missing, 32, "text_sha256")


@pytest.mark.parametrize("grouped", ["no", "yes", "yes, one image too large to compare pairwise"])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_first_of_each_pair_keeps_the_first_row_of_every_image_and_key(shared_prefix, grouped):
    """Against a set walked in row order; with `shared_prefix`, keys of an image share their first 8 bytes and differ
    in the next 8, interleaved, so sorting by the first 8 alone would miss repeats. Grouped rows (images
    non-decreasing, as the index has them) take the pairwise comparison, unless an image has too many rows."""
    rng = np.random.default_rng(1)
    n = 2000
    image = rng.integers(0, 50 if grouped == "no" else 600, n)
    if grouped != "no":
        image.sort()
    if grouped.startswith("yes,"):
        image[: NEIGHBOURS_COMPARED + 1] = image[0]
    texts = rng.integers(0, 6, n)  # few texts per image: many repeats
    head = np.zeros((n, 16), dtype=np.uint8)
    head[:, 8 if shared_prefix else 0] = texts
    seen: set[tuple[int, bytes]] = set()
    expected = []
    for i in range(n):
        pair = (int(image[i]), head[i].tobytes())
        if pair not in seen:
            seen.add(pair)
            expected.append(i)
    got = first_of_each_pair(image, head)
    np.testing.assert_array_equal(got, expected)


def test_the_cache_s_repeated_strings_are_read_as_codes_into_one_dictionary(tmp_path):
    """Shards whose Parquet dictionaries differ (an image captioned in two shards, in another order; failures naming
    one captioned image and one not), one shard past Parquet's dictionary page limit, so its later pages are plainly
    encoded: the repeated columns arrive as codes, and every row's code, captions then failures, names its own
    image sha256 in the one dictionary the join uses."""
    from captioning.cache import caption_row
    from train.data_index import _CacheRows, _RecordedSha256

    cache = CaptionCache.open_or_create(tmp_path / "cache")
    first, second = cache.add_recipe({"kind": "test", "n": 1}), cache.add_recipe({"kind": "test", "n": 2})
    many = 17_000  # 64-character sha256s: past the 1 MiB dictionary page
    cache.commit([caption_row(f"{i:064x}", f"img{i}.png", first, "p0", 0, f"caption {i}", "stop") for i in range(many)])
    cache.commit(
        [
            caption_row(f"{i:064x}", f"img{i}.png", second, "p1", s, f"other {i} {s}", "stop")
            for i in (7, 3, 5)
            for s in (0, 1)
        ],
        [
            {"image_sha256": f"{3:064x}", "source_id": "img3.png", "recipe": second, "reason": "too small"},
            {"image_sha256": f"{many + 1:064x}", "source_id": "gone.png", "recipe": second, "reason": "unreadable"},
        ],
    )
    rows = _CacheRows.read(cache)
    assert rows.captions.column_names == ["source_id", "recipe", "prompt_id", "sample"], "image_sha256: its codes"
    assert all(pa.types.is_dictionary(field.type) for field in rows.captions.schema if field.name != "sample")
    plain = cache.read_captions(columns=["image_sha256", "source_id", "text_sha256"])
    assert rows.keys.tobytes() == b"".join(bytes.fromhex(h) for h in plain.column("text_sha256").to_pylist())
    want = plain.column("image_sha256").to_pylist() + rows.failures.column("image_sha256").to_pylist()
    assert len(rows.shas) == many + 1 and rows.shas.take(pa.array(rows.sha)).to_pylist() == want
    recorded = _RecordedSha256.of(rows).of_listed(
        pa.array(["img3.png", "img7.png", "gone.png", "img9999.png", "new.png"])
    )
    assert recorded.to_pylist() == [f"{3:064x}", f"{7:064x}", f"{many + 1:064x}", f"{9999:064x}", None]


def _six_images(root):
    """Six small PNGs in `root/imgs`, and their sha256s."""
    images = root / "imgs"
    images.mkdir()
    shas = []
    for i in range(6):
        data = png((30 * i, 10, 200), (32, 32))
        (images / f"img{i}.png").write_bytes(data)
        shas.append(hashlib.sha256(data).hexdigest())
    return images, shas


@pytest.mark.parametrize("chosen", ["both", "second"])
def test_rows_out_of_image_order_give_each_image_its_own_captions_in_recipe_prompt_sample_order(tmp_path, chosen):
    """A second recipe's shard captions earlier images again, its rows in no image order and no text repeated: the
    rows are sorted, so each image's keys must be its own captions, ordered (recipe, prompt_id, sample)."""
    from captioning.cache import caption_row

    images, shas = _six_images(tmp_path)
    cache = CaptionCache.open_or_create(tmp_path / "cache")
    first, second = cache.add_recipe({"kind": "test", "n": 1}), cache.add_recipe({"kind": "test", "n": 2})
    rows = [caption_row(shas[i], f"img{i}.png", first, "p0", 0, f"cap {i}", "stop") for i in range(6)]
    later = [(i, p, s) for i in (4, 1, 2, 0, 3, 5) for p in ("pb", "pa") for s in (1, 0)]
    rows2 = [caption_row(shas[i], f"img{i}.png", second, p, s, f"other {i} {p} {s}", "stop") for i, p, s in later]
    cache.commit(rows)
    cache.commit(rows2)
    recipes = [first, second] if chosen == "both" else [second]
    index = build_index([images], tmp_path / "cache", None, recipes, progress=False)
    rank = {r: k for k, r in enumerate(recipes)}
    for i in range(len(index)):
        own = sorted(
            (r for r in rows + rows2 if r["image_sha256"] == index.sha256[i] and r["recipe"] in rank),
            key=lambda r: (rank[r["recipe"]], r["prompt_id"], r["sample"]),
        )
        assert [k.tobytes().hex() for k in index.captions_of(i)] == [r["text_sha256"] for r in own], i


@pytest.mark.parametrize("failures", [False, True])
def test_a_cache_with_no_captions_is_refused_in_one_line(tmp_path, failures):
    """An empty cache, or one holding only failure records, leaves every image uncaptioned: the coverage refusal,
    not an IndexError from the join."""
    images, shas = _six_images(tmp_path)
    cache = CaptionCache.open_or_create(tmp_path / "cache")
    recipe = cache.add_recipe({"kind": "test"})
    if failures:
        cache.commit([], [{"image_sha256": shas[2], "source_id": "img2.png", "recipe": recipe, "reason": "too small"}])
    with pytest.raises(UserError, match="caption coverage below --min-coverage"):
        build_index([images], tmp_path / "cache", None, [recipe] if failures else [], progress=False)
    index = build_index([images], tmp_path / "cache", None, [recipe], min_coverage=0, progress=False)
    assert index.coverage == {0: 6 - failures} and len(index.caption_keys) == 0
