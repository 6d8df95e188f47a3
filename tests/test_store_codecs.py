"""Compact stores: int8 with per-token scales (and fitted channel pre-scaling), a fixed PCA, versions, layout size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from embedding_cache.codec import dequantize, dequantize_numpy, fit_channel_scales, quantize_int8, token_cosines
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore, TokenLayout, payload_bytes
from embedding_cache.transform import fit_pca, fit_transform
from embedding_cache.verify import verify_store
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.recipes import recipe_hash, text_key
from tests.support.commands import refused, tcjepa

ENC = {"kind": "t5-encoder", "model": "fake", "max_length": 64}
SMALL = ["--chunk-tokens", "64", "--shard-chunks", "4", "--window", "64", "--no-progress"]
LAYOUT = TokenLayout(chunk_tokens=16, shard_chunks=4)  # captions cross chunks and shards


def planted(n: int, d: int, seed: int) -> np.ndarray:
    """float16 `[n, d]` vectors whose three channels are 50, 75 and 100× larger than the rest, as T5's are."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, [3, d // 2, d - 5]] *= np.array([50.0, 75.0, 100.0], dtype=np.float32)
    return x.astype(np.float16)


def _int8_store(path: Path, vectors: np.ndarray, project_dim: int | None = None) -> EmbeddingStore:
    entries, transform = fit_transform(vectors, "int8", project_dim, captions=len(vectors))
    recipe = {**ENC, "storage_dtype": "int8", **entries}
    return EmbeddingStore.open_or_create(path, recipe, project_dim or vectors.shape[1], transform=transform)


def _fill(store: EmbeddingStore, vectors: np.ndarray, lengths: list[int], layout: TokenLayout | None = None) -> None:
    writer = store.new_segment(layout)
    start = 0
    for i, n in enumerate(lengths):
        writer.append(text_key(f"caption {i}"), vectors[start : start + n])
        start += n
    writer.finish()
    store.publish(writer)


def _lengths(total: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < total:
        out.append(int(rng.integers(0, 40)))
    out[-1] -= sum(out) - total
    return out


def test_int8_round_trip_needs_and_gets_channel_scaling_on_planted_outlier_channels():
    """Per-token absmax alone loses the quiet channels to the loud ones; the fitted pre-scaling keeps every token of
    vectors it was not fitted on above cosine 0.999, as the goal asks (at a T5-large width)."""
    fit, held_out = planted(4000, 1024, seed=0), planted(4000, 1024, seed=1)
    tokens, scales = quantize_int8(held_out, None)
    alone = token_cosines(held_out, dequantize_numpy(tokens, scales, None, np.float32))
    assert alone.min() < 0.999, "the planted channels must defeat per-token absmax alone (else the test is moot)"

    chosen = fit_channel_scales(fit.astype(np.float32))
    assert chosen.scales is not None and chosen.alpha > 0 and chosen.min_cosine >= 0.999
    tokens, scales = quantize_int8(held_out, chosen.scales)
    assert tokens.dtype == np.int8 and scales.dtype == np.float32 and np.abs(tokens).max() == 127
    back = dequantize_numpy(tokens, scales, chosen.scales, np.float32)
    assert token_cosines(held_out, back).min() >= 0.999

    zero = np.zeros((2, 1024), dtype=np.float16)  # an all-zero token stays zero, with scale 0
    tokens, scales = quantize_int8(zero, chosen.scales)
    assert not tokens.any() and not scales.any()


def test_channel_fit_keeps_plain_absmax_when_it_is_enough():
    x = np.random.default_rng(2).standard_normal((3000, 64)).astype(np.float32)
    chosen = fit_channel_scales(x)
    assert chosen.scales is None and chosen.alpha == 0 and chosen.min_cosine >= 0.9995


def test_an_int8_segment_reads_with_plain_zarr_and_agrees_with_the_reader(tmp_path):
    vectors = planted(3000, 768, seed=3)
    store = _int8_store(tmp_path / "s", vectors)
    lengths = _lengths(len(vectors), seed=4)
    _fill(store, vectors, lengths, LAYOUT)

    root = zarr.open_group(str(tmp_path / "s"), mode="r")
    (segment,) = root.attrs["tcjepa"]["segments"]
    group = root["segments"][segment]
    tokens, scales, channels = group["tokens"][:], group["scales"][:], group["channel_scales"][:]
    assert tokens.dtype == np.int8 and tokens.shape == (3000, 768) and scales.shape == (3000,)
    assert channels.dtype == np.float32 and np.array_equal(channels, root["channel_scales"][:])
    plain = tokens.astype(np.float32) * scales[:, None] * channels[None, :]
    assert token_cosines(vectors, plain).min() >= 0.999

    reader = EmbeddingReader(tmp_path / "s")
    assert reader.codec == "int8" and reader.token_dtype == np.int8 and np.array_equal(reader.channel_scales, channels)
    offsets = group["offsets"][:]
    for i in range(len(lengths)):
        got = reader.get_key(text_key(f"caption {i}"))
        assert got.dtype == np.float16
        np.testing.assert_allclose(got, plain[offsets[i] : offsets[i + 1]].astype(np.float16), rtol=1e-3, atol=1e-3)


def test_reader_int8_agrees_with_float16_and_raw_gathers_dequantize_on_torch(tmp_path):
    vectors = planted(2500, 768, seed=5)
    lengths = _lengths(len(vectors), seed=6)
    f16 = EmbeddingStore.open_or_create(tmp_path / "f16", ENC, 768)
    _fill(f16, vectors, lengths, LAYOUT)
    _fill(_int8_store(tmp_path / "i8", vectors), vectors, lengths, LAYOUT)
    a, b = EmbeddingReader(tmp_path / "f16"), EmbeddingReader(tmp_path / "i8")
    assert b.channel_scales is not None, "at this width the planted channels need pre-scaling"
    keys = np.stack([np.frombuffer(text_key(f"caption {i}"), dtype=np.uint8) for i in range(len(lengths))])
    rows = np.random.default_rng(7).permutation(len(lengths))[:60]
    ra, rb = a.locate(keys[rows]), b.locate(keys[rows])

    packed_a, offsets_a = a.gather_packed(ra)
    packed_b, offsets_b = b.gather_packed(rb)
    assert packed_b.dtype == np.float16 and np.array_equal(offsets_a, offsets_b)
    assert token_cosines(packed_a, packed_b).min() >= 0.999

    tokens, scales, offsets = b.gather_packed_raw(rb)
    assert tokens.dtype == np.int8 and scales.dtype == np.float32 and np.array_equal(offsets, offsets_b)
    on_device = dequantize(torch.from_numpy(tokens), torch.from_numpy(scales), torch.from_numpy(b.channel_scales))
    np.testing.assert_allclose(on_device.numpy(), packed_b.astype(np.float32), rtol=1e-3, atol=1e-3)
    assert dequantize(torch.from_numpy(tokens), torch.from_numpy(scales), None, torch.bfloat16).dtype == torch.bfloat16

    capped, capped_scales, capped_offsets = b.gather_packed_raw(rb, max_len=5)
    assert np.array_equal(np.diff(capped_offsets), np.minimum(np.diff(offsets), 5))
    firsts = np.concatenate([np.arange(lo, min(lo + 5, hi)) for lo, hi in zip(offsets[:-1], offsets[1:])])
    assert np.array_equal(capped, tokens[firsts]) and np.array_equal(capped_scales, scales[firsts])

    raw_a, no_scales, _ = a.gather_packed_raw(ra)
    assert no_scales is None and a.channel_scales is None and np.array_equal(raw_a, packed_a)
    assert torch.equal(dequantize(torch.from_numpy(raw_a)), torch.from_numpy(raw_a).float())

    # into caller's buffers (e.g. pinned or shared torch memory): filled in place, copied once
    buf_t, buf_s = torch.zeros(len(tokens) + 5, 768, dtype=torch.int8), torch.zeros(len(tokens) + 5)
    got_t, got_s, _ = b.gather_packed_raw(rb, out_tokens=buf_t.numpy(), out_scales=buf_s.numpy())
    assert np.shares_memory(got_t, buf_t.numpy()) and np.array_equal(buf_t[: len(tokens)].numpy(), tokens)
    assert np.shares_memory(got_s, buf_s.numpy()) and np.array_equal(buf_s[: len(tokens)].numpy(), scales)
    with pytest.raises(ValueError, match="out_tokens"):
        b.gather_packed_raw(rb, out_tokens=np.zeros((len(tokens) - 1, 768), dtype=np.int8))

    padded_a, lengths_a = a.gather_padded(ra, max_len=16)
    padded_b, lengths_b = b.gather_padded(rb, max_len=16)
    assert np.array_equal(lengths_a, lengths_b) and padded_b.dtype == np.float16
    live = padded_a.reshape(-1, 768).any(axis=1)
    assert token_cosines(padded_a.reshape(-1, 768)[live], padded_b.reshape(-1, 768)[live]).min() >= 0.999


def _set_root(path: Path, **changes) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["tcjepa"].update(changes)
    (path / "zarr.json").write_text(json.dumps(doc))


def test_versions_newer_refused_older_read_and_int8_never_read_as_float16(tmp_path):
    vectors = planted(400, 32, seed=8)
    lengths = _lengths(400, seed=9)
    f16 = EmbeddingStore.open_or_create(tmp_path / "v1", ENC, 32)
    _fill(f16, vectors, lengths)
    _set_root(tmp_path / "v1", version=1)  # what tcjepa wrote before codecs: still read, as float16
    assert EmbeddingReader(tmp_path / "v1").codec == "float16"
    assert np.array_equal(EmbeddingReader(tmp_path / "v1").get_key(text_key("caption 0")), vectors[: lengths[0]])

    _fill(_int8_store(tmp_path / "i8", vectors), vectors, lengths)
    newer = tmp_path / "newer"
    shutil.copytree(tmp_path / "i8", newer)
    _set_root(newer, version=3)
    with pytest.raises(UserError, match="version 3 is newer than this tcjepa reads"):
        EmbeddingReader(newer)
    proc = refused("store", "info", newer)
    assert proc.returncode == 2 and "newer than this tcjepa reads" in proc.stderr and proc.stderr.count("\n") == 1

    as_v1 = tmp_path / "as-v1"
    shutil.copytree(tmp_path / "i8", as_v1)
    _set_root(as_v1, version=1)
    with pytest.raises(UserError, match="version 1 store must hold float16"):
        EmbeddingReader(as_v1)

    # a root that claims float16 over int8 segments (hand-edited, hash made to match): refused at the first read
    # (segments are opened lazily), not misread
    lying = tmp_path / "lying"
    shutil.copytree(tmp_path / "i8", lying)
    encoder = {k: v for k, v in EmbeddingStore(lying).encoder.items() if k != "int8"}
    encoder["storage_dtype"] = "float16"
    _set_root(lying, encoder=encoder, encoder_hash=recipe_hash(encoder))
    with pytest.raises(UserError, match="holds int8, but the store's codec stores float16"):
        EmbeddingReader(lying).get(0)
    with pytest.raises(DataProblem, match="written for encoder"):
        verify_store(lying, progress=False)


def test_store_info_names_codec_projection_counts_and_size(tmp_path):
    """`EmbeddingStore.info()`, what `tcjepa store info` prints: a projected int8 store, made through the API."""
    vectors = planted(400, 64, seed=5)
    lengths = _lengths(len(vectors), seed=6)
    _fill(_int8_store(tmp_path / "s", vectors, project_dim=16), vectors, lengths)
    info = EmbeddingStore(tmp_path / "s").info()
    assert (info.codec, info.version, info.d_model, info.bytes_per_token) == ("int8", 2, 16, 20)
    assert (info.segments, info.captions, info.tokens) == (1, len(lengths), 400)
    assert info.encoder["model"] == "fake" and info.encoder_hash == recipe_hash(info.encoder)
    assert set(info.projection) == {"dim", "source_width", "explained_variance"}
    assert (info.projection["dim"], info.projection["source_width"]) == (16, 64)
    assert info.bytes_on_disk == sum(p.stat().st_size for p in (tmp_path / "s").rglob("*") if p.is_file())
    variance = 100 * info.projection["explained_variance"]
    assert info.summary() == (
        f"1 segments, {len(lengths)} captions, 400 tokens; int8, width 16 (PCA 64 -> 16, {variance:.1f}% of the "
        f"variance), 20 bytes per token; {info.bytes_on_disk / 2**20:.2f} MiB on disk; encoder "
        f"{info.encoder_hash[:12]} (fake, max length 64)"
    )


def test_small_stores_stay_small_on_disk(tmp_path):
    """The last chunk is no longer padded to 16 MiB: a ~2 MiB store takes about its payload, in either codec, and
    so does a segment of several full shards plus a partial one."""
    d = 512
    vectors = planted(2100, d, seed=10)  # ~2 MiB of float16
    lengths = _lengths(len(vectors), seed=11)
    cases = {
        "f16": (EmbeddingStore.open_or_create(tmp_path / "f16", ENC, d), None),
        "i8": (_int8_store(tmp_path / "i8", vectors), None),
        "shards": (EmbeddingStore.open_or_create(tmp_path / "shards", ENC, d), TokenLayout(256, 2)),
    }
    for name, (store, layout) in cases.items():
        _fill(store, vectors, lengths, layout)
        payload = payload_bytes(store.codec, d, len(vectors), len(lengths))
        on_disk = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
        assert on_disk <= 1.2 * payload + (64 << 10), (name, on_disk, payload)
    i8 = sum(p.stat().st_size for p in (tmp_path / "i8").rglob("*") if p.is_file())
    f16 = sum(p.stat().st_size for p in (tmp_path / "f16").rglob("*") if p.is_file())
    assert i8 <= 0.55 * f16
    assert TokenLayout(1 << 14, 64).fitted(2100) == TokenLayout(2100, 1)
    assert TokenLayout(256, 2).fitted(300) == TokenLayout(150, 2)
    reader = EmbeddingReader(tmp_path / "shards")
    assert np.array_equal(reader.get_key(text_key(f"caption {len(lengths) - 1}")), vectors[-lengths[-1] :])


def test_pca_is_deterministic_orthonormal_and_agrees_with_scikit_learn():
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(12)
    sample = (rng.standard_normal((5000, 48)) @ rng.standard_normal((48, 48))).astype(np.float16)
    first, second = fit_pca(sample, 12), fit_pca(sample.copy(), 12)
    assert np.array_equal(first.components, second.components) and np.array_equal(first.mean, second.mean)
    np.testing.assert_allclose(first.components @ first.components.T, np.eye(12), atol=1e-5)
    reference = PCA(12, svd_solver="full").fit(sample.astype(np.float64))
    assert first.explained_variance == pytest.approx(reference.explained_variance_ratio_.sum(), rel=1e-5)
    overlap = np.abs(first.components @ reference.components_.T)  # same axes, up to sign
    np.testing.assert_allclose(np.diag(overlap), 1.0, atol=1e-4)
    assert first.apply(sample).shape == (5000, 12)


@pytest.fixture(scope="module")
def int8_store(tmp_path_factory, annotated_cache, tiny_models) -> Path:
    path = tmp_path_factory.mktemp("int8") / "store"
    out = tcjepa(
        "embed", "--cache", annotated_cache, "--store", path, "--model", tiny_models / "t5", "--store-dtype", "int8"
    )
    assert "stored as int8, width 64" in out.stdout and "int8 with" in out.stderr
    return path


def test_embed_int8_matches_float16_of_the_same_t5_and_verifies(tmp_path, int8_store, annotated_store):
    """int8 against the float16 store of the same captions and T5: every token at cosine ≥ 0.999, ≤ 0.55× the
    bytes on disk; `store verify` passes, and catches one changed byte of tokens or scales."""
    f16, i8 = EmbeddingReader(annotated_store), EmbeddingReader(int8_store)
    assert len(f16) == len(i8) == 320 and i8.codec == "int8"
    keys = np.concatenate([EmbeddingStore(int8_store).read_keys(s) for s in i8.segment_ids])
    a, _ = f16.gather_packed(f16.locate(keys))
    b, _ = i8.gather_packed(i8.locate(keys))
    assert token_cosines(a, b).min() >= 0.999

    def disk(path: Path) -> int:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    assert disk(int8_store) <= 0.55 * disk(annotated_store)
    info = json.loads(tcjepa("store", "info", int8_store, "--json").stdout)
    assert (info["codec"], info["bytes_per_token"], info["projection"], info["version"]) == ("int8", 68, None, 2)
    assert "int8, width 64, 68 bytes per token" in tcjepa("store", "info", int8_store).stdout

    assert tcjepa("store", "verify", int8_store, "--no-progress").stdout.startswith("ok: 1 segments, 320 captions")
    for array, needle in (("tokens", "tokens do not match"), ("scales", "scales do not match")):
        damaged = tmp_path / f"damaged-{array}"
        shutil.copytree(int8_store, damaged)
        (shard,) = [p for p in (damaged / "segments" / i8.segment_ids[0] / array / "c").rglob("*") if p.is_file()]
        data = bytearray(shard.read_bytes())
        data[10] ^= 0x01
        shard.write_bytes(bytes(data))
        bad = tcjepa("store", "verify", damaged, "--no-progress", check=False)
        assert bad.returncode == 1 and needle in bad.stderr, bad.stderr


def test_a_store_keeps_one_codec_and_refuses_another_first(tmp_path, int8_store, annotated_store, tiny_models):
    """In one line, changing nothing, even with nothing left to encode, and before the cache is read (here it does
    not exist)."""
    missing_cache = tmp_path / "no-cache"
    for store, extra, head, needle in [
        (annotated_store, ["--store-dtype", "int8"], "error: --store-dtype int8: ", "holds float16 vectors"),
        (annotated_store, ["--store-dtype", "int8", "--dry-run"], "error: --store-dtype int8: ", "float16"),
        (int8_store, [], "error: --store-dtype float16: ", "holds int8 vectors"),
        (int8_store, ["--store-dtype", "int8", "--project-dim", "16"], "error: --project-dim 16: ", "unprojected"),
    ]:
        before = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
        proc = refused("embed", "--cache", missing_cache, "--store", store, "--model", tiny_models / "t5", *extra)
        assert proc.returncode == 2 and proc.stderr.startswith(head) and needle in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1
        assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == before and not missing_cache.exists()


def test_projection_is_fitted_once_deterministically_and_sets_the_width(tmp_path, annotated_cache, tiny_models):
    args = ["--cache", annotated_cache, "--model", tiny_models / "t5", "--project-dim", "16", *SMALL]
    dry = tcjepa("embed", "--store", tmp_path / "a", *args, "--dry-run").stdout
    tokens = int(dry.split(" tokens (")[0].rsplit(" ", 1)[1])
    for codec, width in (("float16", 64), ("int8", 64)):
        mib = payload_bytes(codec, width, tokens, 320) / 2**20
        assert f"{codec} at width 64 {mib:.2f} MiB" in dry
    for codec in ("float16", "int8"):
        assert f"{codec} at --project-dim 16 {payload_bytes(codec, 16, tokens, 320) / 2**20:.2f} MiB" in dry
    assert not (tmp_path / "a").exists()

    first = tcjepa("embed", "--store", tmp_path / "a", *args)
    assert "stored as float16, width 16 (PCA of 64, keeping" in first.stdout and "PCA 64 -> 16 keeps" in first.stderr
    tcjepa("embed", "--store", tmp_path / "b", *args, fresh=True)  # another process, another string-hash seed
    a, b = EmbeddingStore(tmp_path / "a"), EmbeddingStore(tmp_path / "b")
    assert a.encoder_hash == b.encoder_hash and a.width == 16 and a.source_width == 64
    assert np.array_equal(a.transform.projection.components, b.transform.projection.components)
    components = zarr.open_array(str(tmp_path / "a" / "projection" / "components"), mode="r")[:]
    assert components.shape == (16, 64) and components.dtype == np.float32
    assert zarr.open_array(str(tmp_path / "a" / "projection" / "mean"), mode="r").shape == (64,)
    info = json.loads(tcjepa("store", "info", tmp_path / "a", "--json").stdout)
    assert info["d_model"] == 16 and info["bytes_per_token"] == 32 and info["projection"]["dim"] == 16
    assert 0 < info["projection"]["explained_variance"] < 1
    reader = EmbeddingReader(tmp_path / "a")
    assert reader.width == 16 and reader.gather_packed(np.arange(3))[0].shape[1] == 16
    assert tokens == info["tokens"]

    again = tcjepa("embed", "--store", tmp_path / "a", *args)
    assert "320 already stored" in again.stdout and "fitted" not in again.stderr
    for extra, needle in (
        (["--project-dim", "8"], "--project-dim 8: "),
        ([], "no --project-dim: "),
    ):
        base = [a for a in args if a not in ("--project-dim", "16")]
        proc = refused("embed", "--store", tmp_path / "a", *base, *extra)
        assert proc.returncode == 2 and needle in proc.stderr and "holds a --project-dim 16 projection" in proc.stderr

    # a damaged projection is caught, not used
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "a", damaged)
    (chunk,) = [p for p in (damaged / "projection" / "mean" / "c").rglob("*") if p.is_file()]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    bad = tcjepa("store", "verify", damaged, "--no-progress", check=False)
    assert bad.returncode == 1 and "projection/mean: does not match the sha256" in bad.stderr
