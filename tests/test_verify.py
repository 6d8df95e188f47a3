"""`tcjepa cache verify` and `tcjepa store verify` on real caches and stores, whole and damaged in one way each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

from captioning.cache import CAPTION_SCHEMA
from captioning.verify import verify_cache
from embedding_cache.store import EmbeddingStore, array_sha256
from embedding_cache.verify import verify_store
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.recipes import canonical_json, sha256_file
from tests.support.commands import tcjepa


@pytest.fixture
def cache(tmp_path, annotated_cache) -> Path:
    shutil.copytree(annotated_cache, tmp_path / "cache")
    return tmp_path / "cache"


@pytest.fixture
def store(tmp_path, vector_store) -> Path:
    shutil.copytree(vector_store, tmp_path / "store")
    return tmp_path / "store"


@pytest.fixture
def t5_store(tmp_path, annotated_store) -> Path:
    """A store the tiny T5 made, which `--deep` can re-encode."""
    shutil.copytree(annotated_store, tmp_path / "t5-store")
    return tmp_path / "t5-store"


def _shard(cache: Path) -> str:
    return sorted(p.stem for p in (cache / "captions").glob("*.parquet"))[0]


def _segment(store: Path) -> Path:
    return EmbeddingStore(store).segment_path(EmbeddingStore(store).segment_ids()[0])


def _rewrite_manifest(cache: Path, shard: str) -> None:
    """Make the manifest agree with a shard file edited on purpose, so only deeper checks can catch the edit."""
    path = cache / "manifests" / f"{shard}.json"
    doc = json.loads(path.read_text())
    parquet = cache / "captions" / f"{shard}.parquet"
    doc["files"]["captions"].update(
        bytes=parquet.stat().st_size, sha256=sha256_file(parquet), rows=pq.read_metadata(parquet).num_rows
    )
    path.write_bytes(canonical_json(doc))


def test_cache_verify_passes_on_a_whole_cache_and_exits_1_on_damage(cache):
    ok = tcjepa("cache", "verify", cache, "--no-progress")
    info = json.loads(tcjepa("cache", "info", cache, "--json").stdout)
    assert ok.stdout.startswith(f"ok: 1 recipes, 1 shards, {info['captions']} captions")
    parquet = cache / "captions" / f"{_shard(cache)}.parquet"
    data = bytearray(parquet.read_bytes())
    data[len(data) // 2] ^= 0xFF
    parquet.write_bytes(bytes(data))
    bad = tcjepa("cache", "verify", cache, "--no-progress", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("problem: ") and "sha256 does not match" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_cache_verify_finds_missing_manifests_and_missing_shards(cache):
    shard = _shard(cache)
    manifest = cache / "manifests" / f"{shard}.json"
    saved = manifest.read_bytes()
    manifest.unlink()
    with pytest.raises(DataProblem, match="has no manifest"):
        verify_cache(cache, progress=False)
    manifest.write_bytes(saved)
    (cache / "captions" / f"{shard}.parquet").unlink()
    with pytest.raises(DataProblem, match="captions file is missing"):
        verify_cache(cache, progress=False)


def test_cache_verify_finds_a_caption_stored_twice(cache):
    shard = _shard(cache)
    twin = "99999999999999999999-elsewhere-1-00000000"
    shutil.copy(cache / "captions" / f"{shard}.parquet", cache / "captions" / f"{twin}.parquet")
    shutil.copy(cache / "manifests" / f"{shard}.json", cache / "manifests" / f"{twin}.json")
    with pytest.raises(DataProblem, match=f"records shard '{shard}', not '{twin}'"):
        verify_cache(cache, progress=False)
    doc = json.loads((cache / "manifests" / f"{twin}.json").read_text())
    doc["shard"] = twin
    doc["files"]["captions"]["path"] = f"captions/{twin}.parquet"
    (cache / "manifests" / f"{twin}.json").write_bytes(canonical_json(doc))
    with pytest.raises(DataProblem, match="occurs twice"):
        verify_cache(cache, progress=False)


def test_cache_verify_finds_a_text_that_is_not_its_key(cache):
    shard = _shard(cache)
    parquet = cache / "captions" / f"{shard}.parquet"
    table = pq.read_table(parquet)
    texts = table.column("text").to_pylist()
    texts[3] = texts[3] + " (edited)"
    pq.write_table(
        table.set_column(table.schema.get_field_index("text"), CAPTION_SCHEMA.field("text"), pa.array(texts)), parquet
    )
    _rewrite_manifest(cache, shard)
    with pytest.raises(DataProblem, match="row 3: text_sha256 is not the hash of its text"):
        verify_cache(cache, progress=False)


def test_cache_verify_finds_an_edited_recipe(cache):
    recipe = next((cache / "recipes").glob("*.json"))
    doc = json.loads(recipe.read_text())
    doc["recipe"]["edited"] = True
    recipe.write_bytes(canonical_json(doc))
    with pytest.raises(DataProblem, match="disagree"):
        verify_cache(cache, progress=False)


def _edit_manifest(cache: Path, edit) -> None:
    path = cache / "manifests" / f"{_shard(cache)}.json"
    doc = json.loads(path.read_text())
    edit(doc, _shard(cache))
    path.write_bytes(canonical_json(doc))


def _garbage_shard(cache: Path) -> None:
    """Bytes that are not Parquet, with a manifest that agrees with them."""
    shard = _shard(cache)
    parquet = cache / "captions" / f"{shard}.parquet"
    parquet.write_bytes(b"not parquet at all")
    _edit_manifest(cache, lambda doc, _: doc["files"]["captions"].update(bytes=18, sha256=sha256_file(parquet), rows=1))


def _other_schema(cache: Path) -> None:
    """The `num_tokens` column stored as int64, with a manifest that agrees."""
    parquet = cache / "captions" / f"{_shard(cache)}.parquet"
    table = pq.read_table(parquet)
    at = table.schema.get_field_index("num_tokens")
    pq.write_table(table.set_column(at, "num_tokens", table.column(at).cast(pa.int64())), parquet)
    _rewrite_manifest(cache, _shard(cache))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda c: next((c / "recipes").glob("*.json")).write_text("{"), "not a recipe record"),
        (lambda c: (c / "manifests" / f"{_shard(c)}.json").write_text("[]"), "not a shard manifest"),
        (
            lambda c: _edit_manifest(c, lambda doc, shard: doc["files"]["captions"].update(path="captions/x.parquet")),
            "its captions entry does not name captions/",
        ),
        (lambda c: _edit_manifest(c, lambda doc, shard: doc["files"].pop("captions")), "not recorded in manifests/"),
        (
            lambda c: _edit_manifest(c, lambda doc, shard: doc["files"]["captions"].update(bytes=1)),
            "its manifest records 1",
        ),
        (
            lambda c: _edit_manifest(c, lambda doc, shard: doc["files"]["captions"].update(rows=10**6)),
            "rows, its manifest",
        ),
        (_garbage_shard, "unreadable Parquet"),
        (_other_schema, "schema differs from the cache's (column 'num_tokens' is int64"),
    ],
)
def test_cache_verify_names_each_damage_to_its_records_in_one_line(cache, damage, needle):
    damage(cache)
    with pytest.raises(DataProblem) as caught:
        verify_cache(cache, progress=False)
    assert needle in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_store_verify_passes_on_a_whole_store(store):
    report = verify_store(store, progress=False)
    stats = EmbeddingStore(store).stats()
    assert (report.segments, report.captions, report.tokens) == (stats["segments"], stats["captions"], stats["tokens"])
    assert report.bytes_hashed >= stats["tokens"] * EmbeddingStore(store).width * 2
    assert tcjepa("store", "verify", store, "--no-progress").stdout.startswith("ok: ")


def _first_shard_file(segment: Path) -> Path:
    return sorted(p for p in (segment / "tokens").rglob("*") if p.is_file() and p.name != "zarr.json")[0]


def test_store_verify_finds_a_flipped_token_byte(store):
    shard = _first_shard_file(_segment(store))
    data = bytearray(shard.read_bytes())
    data[1] ^= 0x01  # low mantissa bit of the first value: still finite, only the checksum can tell
    shard.write_bytes(bytes(data))
    bad = tcjepa("store", "verify", store, "--no-progress", check=False)
    assert bad.returncode == 1 and "tokens do not match the sha256 recorded" in bad.stderr


def test_store_verify_finds_non_finite_values(store):
    tokens = zarr.open_array(str(_segment(store) / "tokens"), mode="r+")
    tokens[5, 0] = np.float16("nan")
    with pytest.raises(DataProblem, match="non-finite value in token row 5"):
        verify_store(store, progress=False)


def test_store_verify_finds_broken_offsets(store):
    segment = _segment(store)
    offsets = zarr.open_array(str(segment / "offsets"), mode="r+")
    values = offsets[:]
    values[2] = values[1]
    offsets[:] = values
    with pytest.raises(DataProblem, match="offsets do not grow at caption 1"):
        verify_store(store, progress=False)


def test_store_verify_finds_duplicate_keys_and_missing_segments(store):
    segment = _segment(store)
    twin = segment.parent / "99999999999999999999-elsewhere-1-00000000"
    shutil.copytree(segment, twin)
    root = zarr.open_group(str(store), mode="r+", zarr_format=3)
    meta = dict(root.attrs["tcjepa"])
    listed = list(meta["segments"])
    root.attrs["tcjepa"] = {**meta, "segments": [*listed, twin.name]}
    with pytest.raises(DataProblem, match="stored more than once"):
        verify_store(store, progress=False)
    shutil.rmtree(twin)
    with pytest.raises(DataProblem, match="missing on disk"):
        verify_store(store, progress=False)


def test_store_verify_deep_re_encodes_and_catches_vectors_that_lie(t5_store, annotated_cache, tiny_models):
    store = t5_store
    with pytest.raises(UserError, match="--deep needs --cache"):
        verify_store(store, deep=True, progress=False)
    with pytest.raises(UserError, match="pass its directory with --model"):
        verify_store(store, deep=True, cache=annotated_cache, progress=False)
    report = verify_store(
        store, deep=True, cache=annotated_cache, model=str(tiny_models / "t5"), sample=16, device="cpu", progress=False
    )
    assert report.deep_compared == 16 and report.deep_min_cosine > 0.99
    # A writer bug: wrong vectors under correct checksums. Only re-encoding can tell.
    segment = _segment(store)
    tokens = zarr.open_array(str(segment / "tokens"), mode="r+")
    tokens[:] = -tokens[:]
    group = zarr.open_group(str(segment), mode="r+", zarr_format=3)
    group.attrs["sha256"] = {**group.attrs["sha256"], "tokens": array_sha256(tokens[:])}
    assert verify_store(store, progress=False).segments == 1
    with pytest.raises(DataProblem, match="stored vectors differ from re-encoded ones"):
        verify_store(
            store,
            deep=True,
            cache=annotated_cache,
            model=str(tiny_models / "t5"),
            sample=4,
            device="cpu",
            progress=False,
        )
