"""What both executors of `tcjepa embed` share: the job's config and report, and how a window of captions is
encoded.

The local job (`embedding_cache.job`) and the Ray executor (`embedding_cache.ray_executor`) both import this module
and never each other, so the two executors store the same vectors for the same captions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.encode import NonFiniteEmbedding, T5Encoder, plan_batches, tokenize
from pipeline.core.errors import UserError


@dataclass
class EmbedConfig:
    """What `tcjepa embed` was asked to do; the encoder-recipe fields are `model`, `max_length`, `eos`,
    `compute_dtype`, `store_dtype` and `project_dim`, the rest only say how the work is done."""

    cache: str | Path  # a directory or an fsspec URL (mirrored locally)
    store: str | Path  # a directory or an s3:// URL
    model: str
    recipes: list[str] = field(default_factory=list)
    token_budget: int = 16384
    max_length: int = 128  # what the trainer reads (`max_words`)
    eos: bool = True
    compute_dtype: str = "bfloat16"
    store_dtype: str = "float16"  # the store's codec: float16, or int8 (+ a float32 scale per token)
    project_dim: int | None = None  # a fixed PCA to this width, fitted when the store is made
    device: str = "auto"
    window: int = 8192
    segment_mb: float = 4096.0
    chunk_tokens: int | None = None
    shard_chunks: int | None = None
    dry_run: bool = False
    progress: bool = True
    mirror: Path | None = None  # where an s3:// store's keys are mirrored (default ~/.cache/tcjepa/mirror)
    executor: str = "local"  # local, or ray (a Ray Data actor pool; not part of the encoder recipe)
    ray_address: str | None = None  # an existing cluster; default: RAY_ADDRESS, else a local instance
    ray_actors: int | None = None  # default: one per GPU in the cluster, else 1


@dataclass
class EmbedReport:
    captions_selected: int = 0
    unique_texts: int = 0
    already_stored: int = 0
    encoded: int = 0
    tokens: int = 0
    truncated: int = 0
    segments: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_added: int = 0
    # (seconds since start, captions) of each finished batch
    timeline: list[tuple[float, int]] = field(default_factory=list)
    stored_as: str = ""  # the store's codec, width and projection, in words
    projected_bytes: dict[str, int] = field(default_factory=dict)  # dry run: bytes added, by codec (and width)

    def summary(self, dry_run: bool) -> str:
        head = "would encode" if dry_run else "encoded"
        rate = f", {self.tokens / self.seconds:,.0f} tokens/s" if self.seconds > 0 and not dry_run else ""
        line = (
            f"{self.captions_selected} captions, {self.unique_texts} distinct texts, {self.already_stored} already "
            "stored; "
            f"{head} {self.encoded} captions, {self.tokens} tokens ({self.bytes_added / 2**20:.1f} MiB), "
            f"{self.truncated} truncated to --max-length{rate}; segments published: {len(self.segments)}"
        )
        if self.projected_bytes:
            line += "; bytes on disk: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.projected_bytes.items())
        return line + (f"; {self.stored_as}" if self.stored_as else "")


def encode_window(
    encoder: T5Encoder,
    tokenizer: Any,
    texts: list[str],
    keys: np.ndarray,
    cfg: EmbedConfig,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[np.ndarray], int]:
    """Token embeddings of `texts`, in their order, and how many were truncated; encoder batches grouped by length.

    Both executors encode through here, so their vectors agree. `progress(captions, tokens)` follows each batch.
    """
    ids, truncated = tokenize(tokenizer, texts, cfg.max_length, cfg.eos)
    outputs: list[np.ndarray] = [np.empty(0)] * len(ids)
    if not ids:
        return outputs, truncated
    for batch in plan_batches(np.array([len(x) for x in ids], dtype=np.int64), cfg.token_budget):
        try:
            encoded = encoder.encode([ids[i] for i in batch])
        except NonFiniteEmbedding as exc:
            i = batch[exc.index]
            raise UserError(
                f"caption {keys[i].tobytes().hex()[:16]} ({texts[i][:60]!r}) encodes to non-finite or "
                "float16-overflowing "
                f"values with --dtype {cfg.compute_dtype}; try --dtype float32 or check the model weights"
            ) from None
        for j, out in zip(batch, encoded):
            outputs[j] = out
        if progress is not None:
            progress(len(batch), sum(len(ids[j]) for j in batch))
    return outputs, truncated
