import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from captioning.annotations import import_annotations
from captioning.cache import CaptionCache
from embedding_cache.reader import EmbeddingReader
from pipeline.core.errors import UserError
from pipeline.core.recipes import text_key
from pipeline.core.sources import ImageReader
from tests.support.images import png
from tests.support.repo import REPO
from train.data_index import HexDigests, ImageRefs, TrainIndex, build_index

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
    _same(index, TrainIndex.load(tmp_path / "index.parquet"))


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
    _same(index, TrainIndex.load(tmp_path / "index.parquet"))


def test_without_a_cache_every_image_trains_without_text(tmp_path, synth_dir, store):
    index = build_index([synth_dir], None, None, [], progress=False)
    assert len(index) == N and index.coverage == {0: N} and index.caption_keys.shape == (0, 32) and index.recipes == []
    assert index.coverage_line() == f"{N} images: 0 captions {N}; 0.0% with at least one"
    index.save(tmp_path / "index.parquet")
    _same(index, TrainIndex.load(tmp_path / "index.parquet"))
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


def test_a_file_that_is_not_an_index_is_refused(tmp_path, synth_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"source_id": ["a"]}), tmp_path / "index.parquet")
    with pytest.raises(UserError, match="is not a tcjepa train index v2; delete it to rebuild the index"):
        TrainIndex.load(tmp_path / "index.parquet")


def test_images_of_no_caption_and_left_out_images_survive_a_round_trip(tmp_path, synth_dir, mixed, store):
    cache, odd = mixed
    index = build_index([synth_dir, odd], cache, store, ["captions", "extra"], min_coverage=0, progress=False)
    assert index.coverage == {0: 10, 8: N} and index.missing_embeddings == EXTRA and sum(index.left_out.values()) == 2
    assert [len(index.captions_of(i)) for i in range(len(index))] == [8] * N + [0] * 10
    index.save(tmp_path / "index.parquet")
    loaded = TrainIndex.load(tmp_path / "index.parquet")
    _same(index, loaded)
    assert loaded.coverage_line() == index.coverage_line()
