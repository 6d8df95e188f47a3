"""`tcjepa caption IMAGES...`: decode → generate → commit, in chunks, resumable.

Images stream from the sources and are hashed; those outside this process's
`--shard i/n` or already captioned under this recipe are skipped before the
engine starts. The rest are decoded and normalised in a worker pool one chunk
ahead of the engine, so decoding overlaps generation. Each finished chunk is
committed to the cache as one shard (captions and failure rows together): a
killed run loses at most the chunk in flight, and a rerun captions only what
is missing.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from captioning.backends import get_backend
from captioning.cache import CaptionCache
from captioning.engines import CaptionEngine, load_processor
from captioning.prompts import Prompt, load_prompts, samples_per_prompt
from captioning.ray_executor import caption_on_ray
from captioning.remote_cache import open_cache_for_writing
from captioning.work import SEED_POLICY, CaptionConfig, CaptionReport, caption_images, in_shard, make_engine
from pipeline.core.devices import usable_cpus
from pipeline.core.errors import UserError
from pipeline.core.images import ImagePolicy, decode
from pipeline.core.model_identity import load_config, model_identity
from pipeline.core.recipes import sha256_bytes
from pipeline.core.sources import count_images, iter_images, list_images


def default_decode_workers() -> int:
    """Decode processes beside the engine: on a GPU machine up to 8; on CPU one thread, since vLLM's
    CPU workers keep every core busy and extra processes only slow generation down (measured)."""
    import torch

    return min(8, max(usable_cpus() // 2, 1)) if torch.cuda.is_available() else 0


def parse_shard(spec: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise UserError(f"--shard {spec!r}: expected i/n, e.g. 0/8") from None
    if count < 1 or not 0 <= index < count:
        raise UserError(f"--shard {spec!r}: need 0 <= i < n")
    return index, count


def caption_recipe(
    cfg: CaptionConfig,
    prompts: list[Prompt],
    counts: list[int],
    engine_name: str,
    engine_version: str,
    chat_template: str,
) -> dict[str, Any]:
    """Everything that changes the captions (not: executor, shard, chunking, devices)."""
    config = load_config(cfg.model, "--model")
    affecting = get_backend(cfg.backend).output_affecting_args
    engine_args = {k: cfg.engine_args[k] for k in sorted(cfg.engine_args) if k in affecting}
    return {
        "kind": "vlm-captions",
        **model_identity(cfg.model, config, "--model"),
        "engine": engine_name,
        "engine_version": engine_version,
        "engine_args": engine_args,
        "chat_template_sha256": sha256_bytes(chat_template.encode("utf-8")),
        "prompts": [{"id": p.id, "text": p.text, "samples": n} for p, n in zip(prompts, counts) if n],
        "sampling": cfg.sampling.recipe(),
        "seed": cfg.seed,
        "seed_policy": SEED_POLICY,
        "image_preprocessing": cfg.image_policy.recipe(),
    }


@dataclass
class _Pending:
    """An image to caption: its identity and raw bytes, before decoding."""

    image_sha256: str
    source_id: str
    data: bytes


def _decode_one(item: _Pending, policy: ImagePolicy) -> tuple[_Pending, Any, str | None]:
    image, error = decode(item.data, policy)
    return _Pending(item.image_sha256, item.source_id, b""), image, error


class Selection:
    """The images this run captions, streamed from the sources in their order; the others are counted as they pass.

    Iterate it once; its counts are final when the iteration ends.
    """

    def __init__(self, entries: Iterator[Any], shard: tuple[int, int], done: set[str]) -> None:
        self._entries, self._shard, self._done = entries, shard, done
        self.seen = self.other_shards = self.already_cached = 0
        self.unreadable: list[tuple[str, str]] = []  # (source id, reason) of listed images that could not be read

    def __iter__(self) -> Iterator[_Pending]:
        index, count = self._shard
        chosen: set[str] = set()
        for entry in self._entries:
            self.seen += 1
            if entry.data is None:  # unreadable: sharded by its source id, since it has no content hash
                if in_shard(sha256_bytes(entry.source_id.encode()), index, count):
                    self.unreadable.append((entry.source_id, entry.error or "unreadable"))
                else:
                    self.other_shards += 1
                continue
            digest = sha256_bytes(entry.data)
            if not in_shard(digest, index, count):
                self.other_shards += 1
            elif digest in self._done or digest in chosen:
                self.already_cached += 1
            else:
                chosen.add(digest)
                yield _Pending(digest, entry.source_id, entry.data)


def run_caption(cfg: CaptionConfig, engine: CaptionEngine | None = None) -> CaptionReport:
    """Caption every image of `cfg.inputs` missing from the cache under this recipe: select → caption → publish.

    An engine passed in is used and left open; one started here is closed at the end.
    """
    shard = parse_shard(cfg.shard)
    if cfg.chunk_images < 1:
        raise UserError("--chunk-images must be positive")
    prompts = load_prompts(cfg.prompts_file)
    counts = samples_per_prompt(cfg.captions_per_image, len(prompts))
    backend = get_backend(cfg.backend)
    cache = open_cache_for_writing(cfg.cache, cfg.mirror)
    template = load_processor(cfg.model, cfg.trust_remote_code).chat_template
    if engine is not None and (engine.name != backend.engine or engine.engine_args != cfg.engine_args):
        raise ValueError(
            f"the engine given ({engine.name}, {engine.engine_args}) does not match the config ({cfg.backend}, "
            f"{cfg.engine_args})"
        )
    recipe = caption_recipe(cfg, prompts, counts, backend.engine, backend.version(), template)
    recipe_id = cache.add_recipe(recipe, cfg.recipe_name)
    report = CaptionReport(recipe=recipe_id)
    done = cache.complete_images(recipe_id, sum(counts))
    if cfg.executor == "ray":
        if not cfg.dry_run:
            refs = list_images(cfg.inputs, cfg.image_column, cfg.split)
            caption_on_ray(cfg, refs, shard, done, prompts, counts, report)
            return _checked(report)
    selection = Selection(iter_images(cfg.inputs, cfg.image_column, cfg.split), shard, done)
    if cfg.dry_run:
        report.captioned = sum(1 for _ in selection)
        for _, reason in selection.unreadable:
            report.count_failure(reason)
    else:
        LocalCaptioning(cfg, cache, recipe_id, prompts, counts, engine, report).run(selection)
    report.images_seen, report.other_shards = selection.seen, selection.other_shards
    report.already_cached = selection.already_cached
    return report if cfg.dry_run else _checked(report)


class LocalCaptioning:
    """Caption selected images in this process, chunk by chunk: decode (a chunk ahead) → generate → commit.

    Each chunk is committed as one shard, captions and failures together, so a killed run
    loses at most the chunk in flight. The engine starts at the first image to caption.
    """

    def __init__(
        self,
        cfg: CaptionConfig,
        cache: CaptionCache,
        recipe_id: str,
        prompts: list[Prompt],
        counts: list[int],
        engine: CaptionEngine | None,
        report: CaptionReport,
    ) -> None:
        self.cfg, self.cache, self.recipe_id, self.prompts, self.counts = cfg, cache, recipe_id, prompts, counts
        self.engine, self.owns_engine = engine, engine is None
        self.report = report

    def run(self, selection: Selection) -> None:
        from tqdm import tqdm

        cfg, report = self.cfg, self.report
        started = time.perf_counter()
        workers = default_decode_workers() if cfg.decode_workers is None else cfg.decode_workers
        pool: Executor = (
            ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            if workers > 0
            else ThreadPoolExecutor(1)
        )
        total = count_images(cfg.inputs, cfg.image_column) if cfg.progress else None
        bar = tqdm(total=total, unit="image", dynamic_ncols=True, disable=not cfg.progress)
        try:
            for chunk in _decode_ahead(pool, _chunked(iter(selection), cfg.chunk_images), cfg.image_policy):
                failures = [self._failure(None, source_id, reason) for source_id, reason in selection.unreadable]
                selection.unreadable.clear()
                images = []
                for item, image, error in chunk:
                    if image is None:
                        failures.append(self._failure(item.image_sha256, item.source_id, error or "undecodable"))
                    else:
                        images.append((item.image_sha256, item.source_id, image))
                rows = self._caption(images, started) if images else []
                self.cache.commit(rows, failures)
                report.captioned += len({r["image_sha256"] for r in rows})
                report.captions += len(rows)
                report.timeline.append((time.perf_counter() - started, len(rows)))
                bar.update(selection.seen - bar.n)  # images looked at, captioned or not: the ETA covers the input
                busy = time.perf_counter() - started - report.engine_start_s
                bar.set_postfix(captions_per_s=f"{report.captions / busy:.1f}", failed=report.failed, refresh=False)
            bar.update(selection.seen - bar.n)
            if selection.unreadable:  # unreadable files after the last image to caption
                self.cache.commit([], [self._failure(None, s, r) for s, r in selection.unreadable])
                selection.unreadable.clear()
        finally:
            pool.shutdown(cancel_futures=True)
            bar.close()
            if self.owns_engine and self.engine is not None:
                self.engine.close()
        report.seconds = time.perf_counter() - started

    def _caption(self, images: list[tuple[str, str, Any]], started: float) -> list[dict[str, Any]]:
        if self.engine is None:  # only once there is work: a finished cache never starts one
            t0 = time.perf_counter()
            self.engine = make_engine(self.cfg)
            self.report.engine_start_s = time.perf_counter() - t0
        return caption_images(self.engine, self.cfg, self.prompts, self.counts, self.recipe_id, images)

    def _failure(self, image_sha256: str | None, source_id: str, reason: str) -> dict[str, Any]:
        """A failure row for the cache, counted in the report."""
        self.report.count_failure(reason)
        return {"image_sha256": image_sha256, "source_id": source_id, "reason": reason, "recipe": self.recipe_id}


def _checked(report: CaptionReport) -> CaptionReport:
    """Refuse a run where every image failed (a wrong input, not a few bad files); a rerun with only bad files left is
    fine."""
    if report.failed and report.captioned == 0 and report.already_cached == 0:
        raise UserError(f"every image failed ({report.failed}); first reasons: {report.failure_reasons}")
    return report


def _chunked(items: Iterator[_Pending], size: int) -> Iterator[list[_Pending]]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _decode_ahead(
    pool: Executor, chunks: Iterator[list[_Pending]], policy: ImagePolicy
) -> Iterator[list[tuple[_Pending, Any, str | None]]]:
    """Decoded chunks, the next one already decoding in `pool` while the caller works on this one."""
    from functools import partial

    decode_with = partial(_decode_one, policy=policy)
    ahead = None
    for chunk in chunks:
        futures = [pool.submit(decode_with, item) for item in chunk]
        if ahead is not None:
            yield [f.result() for f in ahead]
        ahead = futures
    if ahead is not None:
        yield [f.result() for f in ahead]
