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

import tempfile
import time
from pathlib import Path

import numpy as np

from embedding_cache.remote_store import local_store
from embedding_cache.segment_check import StoreVerifyReport, verify_segment
from embedding_cache.store import KEY_BYTES, EmbeddingStore
from embedding_cache.transform import requested
from pipeline.core.digests import first_repeat
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.recipes import recipe_hash

DEEP_MIN_COSINE = 0.99


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
