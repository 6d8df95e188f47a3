"""`tcjepa store verify`: prove an embedding store is whole before weeks of training read it.

Checks, stopping at the first problem: the root's encoder hash matches its recipe,
and its fitted arrays (projection, int8 channel scales) the sha256s the recipe
records; every listed segment exists, was written for this encoder, and has offsets
that start at 0, grow by at least one token per caption and end at its token count;
its tokens (float16, or int8 with float32 scales and the root's channel scales),
offsets and keys hash to the sha256 recorded when it was written; all token values
(scales, for int8) are finite; and every caption key is stored once in the whole store.
`--deep` also re-encodes a sample of captions (texts from a caption cache) with
the recorded encoder and compares them with the stored vectors.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.reader import shard_index
from embedding_cache.store import KEY_BYTES, EmbeddingStore
from embedding_cache.transform import array_sha256, requested
from pipeline.core.digests import first_repeat
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.recipes import recipe_hash

READ_ROWS = 1 << 18
DEEP_MIN_COSINE = 0.99


@dataclass
class StoreVerifyReport:
    segments: int = 0
    captions: int = 0
    tokens: int = 0
    bytes_hashed: int = 0
    deep_compared: int = 0
    deep_min_cosine: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        deep = ""
        if self.deep_compared:
            deep = f"; deep: {self.deep_compared} captions re-encoded, lowest token cosine {self.deep_min_cosine:.4f}"
        notes = "".join(f"; note: {n}" for n in self.notes)
        return (
            f"ok: {self.segments} segments, {self.captions} captions, {self.tokens} tokens, "
            f"{self.bytes_hashed / 2**20:.1f} MiB hashed in {self.seconds:.1f} s{deep}{notes}"
        )


def check_shard_indexes(array_dir: Path, shards: tuple[int, ...], chunks: tuple[int, ...]) -> None:
    """Every shard file of the array at `array_dir` against its index's crc32c (`embedding_cache.reader.shard_index`):
    a damaged index is named in one line before any of its chunks is read."""
    per_shard = int(np.prod([s // c for s, c in zip(shards, chunks)]))
    for shard in sorted(p for p in (array_dir / "c").rglob("*") if p.is_file()):
        shard_index(shard, np.memmap(shard, dtype=np.uint8, mode="r"), per_shard)


def verify_segment(
    store: EmbeddingStore,
    segment: str,
    path: Path | None = None,
    report: StoreVerifyReport | None = None,
    bar: Any = None,
) -> np.ndarray:
    """Check one segment (at `path`, by default its place in the store); returns its keys, raises DataProblem."""
    import zarr

    path = store.segment_path(segment) if path is None else path

    def problem(what: str) -> DataProblem:
        return DataProblem(f"{path}: {what}")

    if not (path / "zarr.json").is_file():
        raise problem("listed in the store's zarr.json but missing on disk")
    try:
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        attrs = dict(group.attrs)
        tokens = zarr.open_array(str(path / "tokens"), mode="r")
        offsets = zarr.open_array(str(path / "offsets"), mode="r")[:]
        keys = zarr.open_array(str(path / "keys"), mode="r")[:]
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise problem(f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if attrs.get("encoder_hash") != store.encoder_hash:
        raise problem(
            f"written for encoder {str(attrs.get('encoder_hash'))[:12]}, the store's is {store.encoder_hash[:12]}"
        )
    n, n_tokens = int(attrs.get("captions", -1)), int(attrs.get("tokens", -1))
    if offsets.dtype != np.int64 or offsets.shape != (n + 1,):
        raise problem(f"offsets are {offsets.dtype}{list(offsets.shape)}, expected int64[{n + 1}] for {n} captions")
    if offsets[0] != 0 or (np.diff(offsets) < 1).any() or offsets[-1] != n_tokens:
        bad = (
            "do not start at 0"
            if offsets[0] != 0
            else (
                "do not end at the token count"
                if offsets[-1] != n_tokens
                else f"do not grow at caption {int(np.flatnonzero(np.diff(offsets) < 1)[0])}"
            )
        )
        raise problem(f"offsets {bad}")
    if keys.dtype != np.uint8 or keys.shape != (n, KEY_BYTES):
        raise problem(f"keys are {keys.dtype}{list(keys.shape)}, expected uint8[{n}, {KEY_BYTES}]")
    token_dtype = store.transform.token_dtype
    if tokens.dtype != token_dtype or tokens.shape != (n_tokens, store.width):
        raise problem(
            f"tokens are {tokens.dtype}{list(tokens.shape)}, expected {token_dtype}[{n_tokens}, {store.width}] "
            f"(the store's codec is {store.codec})"
        )
    scales = None
    if store.codec == "int8":
        try:
            scales = zarr.open_array(str(path / "scales"), mode="r")
        except (FileNotFoundError, KeyError, ValueError):
            raise problem("has no scales, which an int8 store's segment needs") from None
        if scales.dtype != np.float32 or scales.shape != (n_tokens,):
            raise problem(f"scales are {scales.dtype}{list(scales.shape)}, expected float32[{n_tokens}]")
    expected_channels = store.transform.channel_scales
    if expected_channels is not None:
        try:
            channels = zarr.open_array(str(path / "channel_scales"), mode="r")[:]
        except (FileNotFoundError, KeyError, ValueError):
            raise problem("has no channel_scales, which this store's int8 codec needs") from None
        if channels.dtype != np.float32 or not np.array_equal(channels, expected_channels):
            raise problem("channel_scales differ from the store root's")
    for name, array in (("tokens", tokens), *((("scales", scales),) if scales is not None else ())):
        try:
            check_shard_indexes(path / name, array.shards, array.chunks)
        except UserError as exc:
            raise problem(str(exc).removeprefix(f"{path}/")) from None
    recorded = attrs.get("sha256")
    if not isinstance(recorded, dict):
        raise problem("records no checksums (written by an older tcjepa); re-embed into a new store to verify it")
    digests = {"tokens": hashlib.sha256(), "scales": hashlib.sha256()}
    for start in range(0, n_tokens, READ_ROWS):
        block = tokens[start : start + READ_ROWS]
        values = block if scales is None else scales[start : start + READ_ROWS]
        finite = np.isfinite(values) if values.ndim == 1 else np.isfinite(values).all(axis=1)
        if not finite.all():
            row = start + int(np.flatnonzero(~finite)[0])
            caption = int(np.searchsorted(offsets, row, side="right")) - 1
            raise problem(
                f"non-finite value in token row {row} (caption {caption}, key {keys[caption].tobytes().hex()[:16]})"
            )
        digests["tokens"].update(np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<")).data)
        if scales is not None:
            digests["scales"].update(np.ascontiguousarray(values, dtype="<f4").data)
        if bar is not None:
            bar.update(len(block))
    actual = {"tokens": digests["tokens"].hexdigest(), "offsets": array_sha256(offsets), "keys": array_sha256(keys)}
    if scales is not None:
        actual["scales"] = digests["scales"].hexdigest()
    if expected_channels is not None:
        actual["channel_scales"] = array_sha256(expected_channels)
    for name, digest in actual.items():
        if recorded.get(name) != digest:
            raise problem(
                f"{name} do not match the sha256 recorded when the segment was written (changed or corrupted on disk)"
            )
    if report is not None:
        report.segments += 1
        report.captions += n
        report.tokens += n_tokens
        report.bytes_hashed += n_tokens * store.bytes_per_token + offsets.nbytes + keys.nbytes
    return keys


def _deep_check(
    store: EmbeddingStore,
    all_keys: np.ndarray,
    cache: Path,
    model: str | None,
    sample: int,
    seed: int,
    device: str,
    report: StoreVerifyReport,
) -> None:
    """Re-encode `sample` stored captions found in `cache` and compare token by token."""
    from captioning.cache import CaptionCache
    from embedding_cache.encode import T5Encoder, load_tokenizer, recipe_like, tokenize
    from embedding_cache.reader import EmbeddingReader

    enc = store.encoder
    model = model or enc.get("model")
    if not model or ("weights_sha256" in enc and not Path(model).is_dir()):
        raise UserError(
            f"--deep: the store's encoder is a local model ({enc.get('model')!r}); pass its directory with --model"
        )
    recipe = recipe_like(model, enc)
    if recipe_hash(recipe) != recipe_hash(requested(enc)):
        raise UserError(
            f"--model {model} is not the encoder this store was written with (recipe {recipe_hash(recipe)[:12]} vs "
            f"{recipe_hash(requested(enc))[:12]})"
        )
    table = CaptionCache(cache).read_captions(columns=["text", "text_sha256"])
    texts = dict(zip(table.column("text_sha256").to_pylist(), table.column("text").to_pylist()))
    stored = [k.tobytes().hex() for k in all_keys]
    known = [h for h in stored if h in texts]
    if not known:
        raise UserError(
            f"--deep: none of the store's captions are in --cache {cache}; pass the cache the store was embedded from"
        )
    rng = np.random.default_rng(seed)
    chosen = [known[i] for i in sorted(rng.choice(len(known), size=min(sample, len(known)), replace=False))]
    tokenizer = load_tokenizer(model)
    ids, _ = tokenize(tokenizer, [texts[h] for h in chosen], int(enc["max_length"]), bool(enc["eos"]))
    encoder = T5Encoder.load(model, device, str(enc["compute_dtype"]))
    reader = EmbeddingReader(store.root)
    lowest = 1.0
    for h, x in zip(chosen, ids):
        fresh = store.transform.roundtrip(encoder.encode([x])[0])
        kept = reader.get_key(bytes.fromhex(h)).astype(np.float32)
        if fresh.shape != kept.shape:
            raise DataProblem(
                f"caption {h[:16]} ({texts[h][:40]!r}): stored {kept.shape[0]} tokens, re-encoding gives "
                f"{fresh.shape[0]}"
            )
        cos = (fresh * kept).sum(1) / np.maximum(np.linalg.norm(fresh, axis=1) * np.linalg.norm(kept, axis=1), 1e-12)
        lowest = min(lowest, float(cos.min()))
        if cos.min() < DEEP_MIN_COSINE:
            raise DataProblem(
                f"caption {h[:16]} ({texts[h][:40]!r}): stored vectors differ from re-encoded ones "
                f"(token {int(cos.argmin())} cosine {float(cos.min()):.3f} < {DEEP_MIN_COSINE})"
            )
    report.deep_compared = len(chosen)
    report.deep_min_cosine = lowest


def verify_store(
    location: str | Path,
    deep: bool = False,
    cache: Path | None = None,
    model: str | None = None,
    sample: int = 64,
    seed: int = 0,
    device: str = "auto",
    progress: bool = True,
) -> StoreVerifyReport:
    """Check the store at `location` end to end (a directory, or a URL: every segment fetched afresh and checked);
    raises DataProblem at the first inconsistency."""
    from embedding_cache.remote_store import local_store

    with tempfile.TemporaryDirectory() as fresh:
        return _verify_local_store(
            local_store(location, Path(fresh)), deep, cache, model, sample, seed, device, progress
        )


def _verify_local_store(
    path: Path, deep: bool, cache: Path | None, model: str | None, sample: int, seed: int, device: str, progress: bool
) -> StoreVerifyReport:
    from tqdm import tqdm

    if deep and cache is None:
        raise UserError("--deep needs --cache DIR: the caption texts to re-encode come from the caption cache")
    if sample < 1:
        raise UserError(f"--sample must be at least 1 (got {sample})")
    started = time.perf_counter()
    store = EmbeddingStore(path)
    if recipe_hash(store.encoder) != store.encoder_hash:
        raise DataProblem(
            f"{path}/zarr.json: encoder_hash does not match the recorded encoder recipe (edited by hand?)"
        )
    _ = store.transform  # the fitted root arrays against the sha256s in the recipe (raises DataProblem)
    report = StoreVerifyReport()
    segments = store.segment_ids()
    if len(set(segments)) != len(segments):
        raise DataProblem(f"{path}/zarr.json lists a segment twice")
    unlisted = [p.name for p in (path / "segments").iterdir() if p.is_dir() and p.name not in set(segments)]
    if unlisted:
        report.notes.append(f"{len(unlisted)} unlisted segment directories (unpublished; the next writer removes them)")
    all_keys, owners = [], []
    with tqdm(unit="token", unit_scale=True, disable=not progress, dynamic_ncols=True, desc="verify") as bar:
        for i, segment in enumerate(segments):
            keys = verify_segment(store, segment, report=report, bar=bar)
            all_keys.append(keys)
            owners.append(np.full(len(keys), i))
    keys = np.concatenate(all_keys) if all_keys else np.zeros((0, KEY_BYTES), np.uint8)
    repeat = first_repeat(keys)
    if repeat is not None:
        owner = np.concatenate(owners)
        key, a, b = keys[repeat[0]].tobytes(), int(owner[repeat[0]]), int(owner[repeat[1]])
        where = f"segment {segments[a]}" + (" (twice)" if a == b else f" and segment {segments[b]}")
        raise DataProblem(f"{path}: caption key {key.hex()[:16]} is stored more than once ({where})")
    if deep:
        assert cache is not None
        _deep_check(store, keys, cache, model, sample, seed, device, report)
    report.seconds = time.perf_counter() - started
    return report
