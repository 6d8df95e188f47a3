"""Embedding stores in tests: the settings of the session's `annotated_store`, comparing stores, and stores of
made-up vectors written through the store's Python API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.store import TokenLayout

# The embedding settings of `annotated_store`: small chunks and shards, so captions cross both.
SMALL_STORE = ["--chunk-tokens", "64", "--shard-chunks", "4", "--window", "64", "--no-progress"]


def store_keys(store: Path) -> list[bytes]:
    """Every caption key of a local store, segment by segment."""
    from embedding_cache.store import EmbeddingStore

    opened = EmbeddingStore(store)
    return [k.tobytes() for segment in opened.segment_ids() for k in opened.read_keys(segment)]


def assert_same_embeddings(got: Path, want: Path) -> None:
    """Two local stores hold the same captions, each once, with vectors equal up to bfloat16 rounding: another batch
    composition changes the last bits of every layer's sums, a few units in the last place of a token's values
    after a few layers. So each token's vector is compared as a whole, relative to its length (a caption's vectors
    swapped with another's differ by ~140%)."""
    from embedding_cache.reader import EmbeddingReader

    keys = store_keys(got)
    assert len(keys) == len(set(keys)), "a caption is stored twice"
    assert set(keys) == set(store_keys(want)), "captions lost or added"
    a, b = EmbeddingReader(got), EmbeddingReader(want)
    for key in keys:
        ours, theirs = a.get_key(key).astype(np.float32), b.get_key(key).astype(np.float32)
        assert ours.shape == theirs.shape, f"caption {key.hex()[:12]}: {ours.shape} tokens against {theirs.shape}"
        error = np.linalg.norm(ours - theirs, axis=-1) / np.maximum(np.linalg.norm(theirs, axis=-1), 1e-6)
        assert error.max() <= 0.02, f"caption {key.hex()[:12]}: a token's vector is {error.max():.1%} off"


# A store of made-up vectors: `numbered_caption(i)` is caption i (its key, `[length, TEST_WIDTH]` float16 vectors).
TEST_ENCODER = {"kind": "t5-encoder", "model": "fake", "max_length": 64}
TEST_WIDTH = 8


TEST_LAYOUT = TokenLayout(chunk_tokens=16, shard_chunks=4)  # 64-token shards: captions cross chunks and shards


def numbered_caption(i: int, length: int | None = None) -> tuple[bytes, np.ndarray]:
    from pipeline.core.recipes import text_key

    rng = np.random.default_rng(i)
    n = int(rng.integers(0, 40)) if length is None else length
    return text_key(f"caption {i}"), rng.standard_normal((n, TEST_WIDTH)).astype(np.float16)


def publish_captions(store: Any, ids: Any) -> Any:
    """Write `numbered_caption(i)` for each of `ids` into a new segment of `store` and publish it."""
    writer = store.new_segment(TEST_LAYOUT)
    for i in ids:
        writer.append(*numbered_caption(i))
    writer.finish()
    return store.publish(writer)


# The vectors of `vector_store`: `caption_vector(key, text)` for each caption.
VECTOR_WIDTH = 16


def caption_vector(key: bytes, text: str) -> np.ndarray:
    """A stand-in caption embedding, a function of the caption: one row per word and one for EOS."""
    rng = np.random.default_rng(list(key[:8]))
    return rng.standard_normal((len(text.split()) + 1, VECTOR_WIDTH)).astype(np.float16)
