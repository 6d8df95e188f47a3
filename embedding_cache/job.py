"""`tcjepa embed`: encode every caption of the chosen recipes that the store lacks.

Captions are taken in image order (each image's captions together) and
deduplicated by text hash; a window of them is tokenised, batched by length for
the encoder, and written back in image order, so an image's captions sit next to
each other in the store. A segment is published every `segment_mb`, so a killed
run loses at most one segment of work; before each window the job drops
captions that other writers published meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from captioning.cache import CaptionCache
from captioning.remote_cache import local_cache
from embedding_cache.encode import NonFiniteEmbedding, T5Encoder, encoder_recipe, load_tokenizer, plan_batches, tokenize
from embedding_cache.remote_store import open_existing_store, open_store_for_writing
from embedding_cache.store import SegmentWriter, TokenLayout
from pipeline.core.errors import UserError


@dataclass
class EmbedConfig:
    cache: str | Path  # a directory or an fsspec URL (mirrored locally)
    store: str | Path  # a directory or an s3:// URL
    model: str
    recipes: list[str] = field(default_factory=list)
    token_budget: int = 16384
    max_length: int = 512
    eos: bool = True
    compute_dtype: str = "bfloat16"
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
    num_workers: int | None = None  # Ray actors; default: one per GPU in the cluster, else 1


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
    timeline: list[tuple[float, int]] = field(
        default_factory=list
    )  # (seconds since start, captions) of each finished batch

    def summary(self, dry_run: bool) -> str:
        head = "would encode" if dry_run else "encoded"
        rate = f", {self.tokens / self.seconds:,.0f} tokens/s" if self.seconds > 0 and not dry_run else ""
        return (
            f"{self.captions_selected} captions, {self.unique_texts} distinct texts, {self.already_stored} already "
            "stored; "
            f"{head} {self.encoded} captions, {self.tokens} tokens ({self.bytes_added / 2**20:.1f} MiB), "
            f"{self.truncated} truncated to --max-length{rate}; segments published: {len(self.segments)}"
        )


def _texts_to_encode(cache: CaptionCache, recipes: list[str]) -> tuple[list[str], np.ndarray, int]:
    """Distinct caption texts in image order, their 32-byte keys, and the number of caption rows."""
    table = cache.read_captions(columns=["image_sha256", "prompt_id", "sample", "text", "text_sha256"], recipes=recipes)
    table = table.sort_by([("image_sha256", "ascending"), ("prompt_id", "ascending"), ("sample", "ascending")])
    hexes = table.column("text_sha256").to_pylist()
    texts = table.column("text").to_pylist()
    seen: set[str] = set()
    keep_texts, keep_keys = [], []
    for h, t in zip(hexes, texts):
        if h not in seen:
            seen.add(h)
            keep_texts.append(t)
            keep_keys.append(bytes.fromhex(h))
    keys = np.frombuffer(b"".join(keep_keys), dtype=np.uint8).reshape(-1, 32)
    return keep_texts, keys, table.num_rows


def run_embed(cfg: EmbedConfig) -> EmbedReport:
    from tqdm import tqdm

    cache = CaptionCache(local_cache(cfg.cache, cfg.mirror))
    recipes = cache.resolve_recipes(cfg.recipes)
    if cfg.token_budget < 1 or cfg.window < 1 or cfg.segment_mb <= 0:
        raise UserError("--token-budget, --window and --segment-mb must be positive")
    recipe, d_model = encoder_recipe(cfg.model, cfg.max_length, cfg.eos, cfg.compute_dtype)
    tokenizer = load_tokenizer(cfg.model)
    texts, keys, n_rows = _texts_to_encode(cache, recipes)
    report = EmbedReport(captions_selected=n_rows, unique_texts=len(texts))

    # A dry run creates nothing, but refuses a mismatched store all the same.
    store = (
        open_existing_store(cfg.store, recipe, cfg.mirror)
        if cfg.dry_run
        else open_store_for_writing(cfg.store, recipe, d_model, cfg.mirror)
    )
    todo = np.arange(len(texts)) if store is None else np.flatnonzero(~store.published().contains(keys))
    report.already_stored = len(texts) - len(todo)

    if cfg.dry_run:
        for start in range(0, len(todo), cfg.window):
            ids, truncated = tokenize(
                tokenizer, [texts[i] for i in todo[start : start + cfg.window]], cfg.max_length, cfg.eos
            )
            report.encoded += len(ids)
            report.tokens += sum(len(x) for x in ids)
            report.truncated += truncated
        report.bytes_added = report.tokens * d_model * 2 + report.encoded * (8 + 32)
        return report

    assert store is not None
    layout = TokenLayout.for_bytes(d_model)
    layout = TokenLayout(cfg.chunk_tokens or layout.chunk_tokens, cfg.shard_chunks or layout.shard_chunks)
    segment_tokens = max(int(cfg.segment_mb * 2**20) // (2 * d_model), 1)
    if len(todo) == 0:
        return report
    if cfg.executor == "ray":
        from embedding_cache.ray_executor import embed_on_ray

        embed_on_ray(cfg, texts, keys, todo, recipe, d_model, layout, report)
        report.bytes_added = report.tokens * d_model * 2 + report.encoded * (8 + 32)
        return report
    encoder = T5Encoder.load(cfg.model, cfg.device, cfg.compute_dtype)
    started = time.perf_counter()
    tokens_done = 0
    writer: SegmentWriter | None = None
    truncated_in_segment = 0

    def publish() -> None:
        nonlocal writer, truncated_in_segment
        if writer is None:
            return
        writer.finish(truncated=truncated_in_segment, max_length=cfg.max_length)
        result = store.publish(writer)
        if result.segment is not None:
            report.segments.append(result.segment)
        report.encoded += result.captions
        report.tokens += result.tokens
        writer, truncated_in_segment = None, 0

    bar = tqdm(total=len(todo), unit="caption", disable=not cfg.progress, dynamic_ncols=True)

    def progress(captions: int, tokens: int) -> None:
        nonlocal tokens_done
        tokens_done += tokens
        bar.update(captions)
        bar.set_postfix(tokens_per_s=f"{tokens_done / (time.perf_counter() - started):,.0f}", refresh=False)

    try:
        for start in range(0, len(todo), cfg.window):
            window = todo[start : start + cfg.window]
            window = window[~store.published().contains(keys[window])]
            outputs, truncated = encode_window(
                encoder, tokenizer, [texts[i] for i in window], keys[window], cfg, progress
            )
            report.truncated += truncated
            truncated_in_segment += truncated
            for j, out in enumerate(outputs):
                if writer is None:
                    writer = store.new_segment(layout)
                writer.append(keys[window[j]].tobytes(), out)
                if writer.tokens >= segment_tokens:
                    publish()
            report.timeline.append((time.perf_counter() - started, len(window)))
        publish()
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        bar.close()
    report.seconds = time.perf_counter() - started
    report.bytes_added = report.tokens * d_model * 2 + report.encoded * (8 + 32)
    return report


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
