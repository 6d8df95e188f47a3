"""`tcjepa embed`: encode every caption of the chosen recipes that the store lacks.

Captions are taken in image order (each image's captions together) and
deduplicated by text hash; a window of them is tokenised, batched by length for
the encoder, and written back in image order, so an image's captions sit next to
each other in the store. A segment is published every `segment_mb`, so a killed
run loses at most one segment of work; before each window the job drops
captions that other writers published meanwhile.

A store whose recipe asks for int8 or a projection is made only after fitting them
on a deterministic sample (`fitting_sample`); later runs reuse what the store holds.
Whether the store accepts this run's recipe (codec, projection, encoder) is decided
first, before the cache is read or anything is encoded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from captioning.cache import CaptionCache
from captioning.remote_cache import local_cache
from embedding_cache.codec import CODECS
from embedding_cache.encode import T5Encoder, encoder_recipe, load_tokenizer, tokenize
from embedding_cache.ray_executor import embed_on_ray
from embedding_cache.remote_store import open_existing_store, open_store_for_writing
from embedding_cache.store import KEY_BYTES, EmbeddingStore, SegmentWriter, TokenLayout, payload_bytes
from embedding_cache.transform import FIT_TOKENS, codec_of, fit_summary, fit_transform, needs_fit
from embedding_cache.work import EmbedConfig, EmbedReport, encode_window
from pipeline.core.errors import UserError

logger = logging.getLogger(__name__)


def stored_as(store: EmbeddingStore) -> str:
    """The store's codec, width and projection, in words (for the summary line)."""
    projection = store.encoder.get("projection")
    pca = ""
    if projection:
        pca = (
            f" (PCA of {projection['source_width']}, keeping {100 * projection['explained_variance']:.1f}% of the "
            "variance)"
        )
    return f"stored as {store.codec}, width {store.width}{pca}"


@dataclass
class Selection:
    """The captions to encode: distinct texts of the chosen recipes in image order, minus those stored."""

    texts: list[str]  # every distinct text, in image order
    keys: np.ndarray  # uint8 [len(texts), 32]: sha256 of each text
    todo: np.ndarray  # int64: positions in `texts` that the store lacks
    caption_rows: int  # caption rows of the chosen recipes (texts repeat across images)


def select_captions(cache: CaptionCache, recipes: list[str], store: EmbeddingStore | None) -> Selection:
    """Distinct caption texts in image order (each image's captions together), and which of them `store` lacks."""
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
    keys = np.frombuffer(b"".join(keep_keys), dtype=np.uint8).reshape(-1, KEY_BYTES)
    todo = np.arange(len(keep_texts)) if store is None else np.flatnonzero(~store.published().contains(keys))
    return Selection(keep_texts, keys, todo, table.num_rows)


def run_embed(cfg: EmbedConfig) -> EmbedReport:
    """Encode every caption of the chosen recipes that the store lacks: select → encode → publish segments.

    The store's verdict on this run's recipe comes first: a store of another codec, projection or encoder is
    refused before the cache is read, even when nothing is left to encode. A dry run then counts captions, tokens
    and the bytes each codec would take, without loading the encoder or creating the store.
    """
    if cfg.token_budget < 1 or cfg.window < 1 or cfg.segment_mb <= 0:
        raise UserError("--token-budget, --window and --segment-mb must be positive")
    request, source_width = encoder_recipe(
        cfg.model, cfg.max_length, cfg.eos, cfg.compute_dtype, cfg.store_dtype, cfg.project_dim
    )
    store = open_existing_store(cfg.store, request, cfg.mirror)
    cache = CaptionCache(local_cache(cfg.cache, cfg.mirror))
    recipes = cache.resolve_recipes(cfg.recipes)
    tokenizer = load_tokenizer(cfg.model)
    selection = select_captions(cache, recipes, store)
    report = EmbedReport(captions_selected=selection.caption_rows, unique_texts=len(selection.texts))
    report.already_stored = len(selection.texts) - len(selection.todo)
    if cfg.dry_run:
        _count_dry_run(cfg, tokenizer, selection, report)
        width = store.width if store is not None else cfg.project_dim or source_width
        report.bytes_added = payload_bytes(codec_of(request), width, report.tokens, report.encoded)
        for codec in CODECS:
            report.projected_bytes[f"{codec} at width {source_width}"] = payload_bytes(
                codec, source_width, report.tokens, report.encoded
            )
        if cfg.project_dim is not None:
            for codec in CODECS:
                report.projected_bytes[f"{codec} at --project-dim {cfg.project_dim}"] = payload_bytes(
                    codec, cfg.project_dim, report.tokens, report.encoded
                )
        return report
    encoder = None
    if store is None:
        store, encoder = create_store(cfg, request, source_width, tokenizer, selection)
    report.stored_as = stored_as(store)
    if len(selection.todo):
        base = store.default_layout()
        layout = TokenLayout(cfg.chunk_tokens or base.chunk_tokens, cfg.shard_chunks or base.shard_chunks)
        if cfg.executor == "ray":
            embed_on_ray(
                cfg, selection.texts, selection.keys, selection.todo, store.encoder, store.width, layout, report
            )
        else:
            _embed_here(cfg, tokenizer, selection, store, layout, report, encoder)
    report.bytes_added = payload_bytes(store.codec, store.width, report.tokens, report.encoded)
    return report


def _count_dry_run(cfg: EmbedConfig, tokenizer: Any, selection: Selection, report: EmbedReport) -> None:
    for start in range(0, len(selection.todo), cfg.window):
        window = selection.todo[start : start + cfg.window]
        ids, truncated = tokenize(tokenizer, [selection.texts[i] for i in window], cfg.max_length, cfg.eos)
        report.encoded += len(ids)
        report.tokens += sum(len(x) for x in ids)
        report.truncated += truncated


def fitting_sample(cfg: EmbedConfig, tokenizer: Any, selection: Selection) -> np.ndarray:
    """Positions in `selection.texts` of the captions a new store's transform is fitted on: those with the smallest
    keys (sha256 of the text: a uniform sample that depends only on which captions there are, not on their order),
    until FIT_TOKENS tokens."""
    first_bytes = np.ascontiguousarray(selection.keys[:, :8]).view(">u8").ravel()
    order = np.argsort(first_bytes, kind="stable")
    chosen: list[np.ndarray] = []
    tokens = 0
    for start in range(0, len(order), 1024):
        part = order[start : start + 1024]
        ids, _ = tokenize(tokenizer, [selection.texts[i] for i in part], cfg.max_length, cfg.eos)
        lengths = np.cumsum([len(x) for x in ids])
        enough = int(np.searchsorted(lengths, FIT_TOKENS - tokens)) + 1
        chosen.append(part[:enough])
        tokens += int(lengths[min(enough, len(lengths)) - 1])
        if tokens >= FIT_TOKENS:
            break
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)


def create_store(
    cfg: EmbedConfig, request: dict[str, Any], source_width: int, tokenizer: Any, selection: Selection
) -> tuple[EmbeddingStore, T5Encoder | None]:
    """Make the store `cfg.store` for `request`, fitting its projection and int8 scaling first when it asks for them
    (the encoder loaded for that is returned, for the rest of the run)."""
    if not needs_fit(request):
        return open_store_for_writing(cfg.store, request, source_width, cfg.mirror), None
    sample = fitting_sample(cfg, tokenizer, selection)
    if not len(sample):
        raise UserError(
            "--store-dtype int8 and --project-dim are fitted on the captions being embedded, and the cache holds "
            "none of the chosen recipes"
        )
    encoder = T5Encoder.load(cfg.model, cfg.device, cfg.compute_dtype)
    vectors, _ = encode_window(encoder, tokenizer, [selection.texts[i] for i in sample], selection.keys[sample], cfg)
    entries, transform = fit_transform(np.concatenate(vectors), cfg.store_dtype, cfg.project_dim, len(sample))
    logger.info(f"fitted on {len(sample)} captions: {fit_summary(entries)}")
    store = open_store_for_writing(
        cfg.store, {**request, **entries}, cfg.project_dim or source_width, cfg.mirror, transform
    )
    return store, encoder


class SegmentPublisher:
    """Appends encoded captions to a staging segment and publishes it every `segment_tokens` tokens (and at the end).

    A kill loses at most the segment being filled; `discard` drops it after an error.
    """

    def __init__(
        self, store: EmbeddingStore, layout: TokenLayout, segment_tokens: int, max_length: int, report: EmbedReport
    ) -> None:
        self.store, self.layout, self.segment_tokens, self.max_length = store, layout, segment_tokens, max_length
        self.report = report
        self.writer: SegmentWriter | None = None
        self.truncated = 0  # captions truncated in the segment being filled

    def add(self, key: bytes, tokens: np.ndarray) -> None:
        if self.writer is None:
            self.writer = self.store.new_segment(self.layout)
        self.writer.append(key, tokens)
        if self.writer.tokens >= self.segment_tokens:
            self.publish()

    def publish(self) -> None:
        if self.writer is None:
            return
        self.writer.finish(truncated=self.truncated, max_length=self.max_length)
        result = self.store.publish(self.writer)
        if result.segment is not None:
            self.report.segments.append(result.segment)
        self.report.encoded += result.captions
        self.report.tokens += result.tokens
        self.writer, self.truncated = None, 0

    def discard(self) -> None:
        if self.writer is not None:
            self.writer.discard()
            self.writer = None


def _embed_here(
    cfg: EmbedConfig,
    tokenizer: Any,
    selection: Selection,
    store: EmbeddingStore,
    layout: TokenLayout,
    report: EmbedReport,
    encoder: T5Encoder | None = None,
) -> None:
    """The local executor: windows of captions encoded in this process, published as segments."""
    from tqdm import tqdm

    if encoder is None:
        encoder = T5Encoder.load(cfg.model, cfg.device, cfg.compute_dtype)
    segment_tokens = max(int(cfg.segment_mb * 2**20) // store.bytes_per_token, 1)
    publisher = SegmentPublisher(store, layout, segment_tokens, cfg.max_length, report)
    started = time.perf_counter()
    bar = tqdm(total=len(selection.todo), unit="caption", disable=not cfg.progress, dynamic_ncols=True)
    encoded_tokens = [0]

    def show(captions: int, tokens: int) -> None:
        encoded_tokens[0] += tokens
        bar.update(captions)
        bar.set_postfix(tokens_per_s=f"{encoded_tokens[0] / (time.perf_counter() - started):,.0f}", refresh=False)

    try:
        for start in range(0, len(selection.todo), cfg.window):
            window = selection.todo[start : start + cfg.window]
            window = window[~store.published().contains(selection.keys[window])]  # other writers may have added some
            texts = [selection.texts[i] for i in window]
            outputs, truncated = encode_window(encoder, tokenizer, texts, selection.keys[window], cfg, show)
            report.truncated += truncated
            publisher.truncated += truncated
            for i, out in zip(window, outputs):
                publisher.add(selection.keys[i].tobytes(), out)
            report.timeline.append((time.perf_counter() - started, len(window)))
        publisher.publish()
    except BaseException:
        publisher.discard()
        raise
    finally:
        bar.close()
    report.seconds = time.perf_counter() - started
