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

import hashlib
import itertools
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.cache import caption_row
from captioning.engines import CaptionEngine, CaptionRequest, SamplingConfig
from captioning.prompts import Prompt, load_prompts, samples_per_prompt
from captioning.remote_cache import open_cache_for_writing
from pipeline.core.errors import UserError
from pipeline.core.images import ImagePolicy, decode
from pipeline.core.model_identity import load_config, model_identity
from pipeline.core.recipes import sha256_bytes
from pipeline.core.sources import iter_images, list_images

SEED_POLICY = "request seed = int(sha256('{seed}:{image_sha256}:{prompt_id}')[:8], 16) % 2**31; sample k gets seed + k"


@dataclass
class CaptionConfig:
    inputs: list[Path]
    cache: str | Path  # a directory or an s3:// URL
    model: str
    captions_per_image: int = 8
    prompts_file: Path | None = None
    recipe_name: str | None = None
    seed: int = 0
    shard: str = "0/1"
    backend: str = "vllm"
    engine_args: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    image_policy: ImagePolicy = field(default_factory=ImagePolicy)
    image_column: str | None = None
    chunk_images: int = 256
    decode_workers: int | None = None
    device: str = "auto"
    trust_remote_code: bool = False
    dry_run: bool = False
    mirror: Path | None = None  # where an s3:// cache is mirrored (default ~/.cache/tcjepa/mirror)
    executor: str = "local"  # local, or ray (Ray tasks decode, Ray actors caption; not part of the recipe)
    ray_address: str | None = None  # an existing cluster; default: RAY_ADDRESS, else a local instance
    num_workers: int | None = None  # Ray engine actors; default: one per GPU (per tensor_parallel_size GPUs), else 1


@dataclass
class CaptionReport:
    recipe: str = ""
    images_seen: int = 0
    other_shards: int = 0
    already_cached: int = 0
    captioned: int = 0
    captions: int = 0
    failed: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    engine_start_s: float = 0.0
    timeline: list[tuple[float, int]] = field(
        default_factory=list
    )  # (seconds since start, captions) of each finished chunk

    def summary(self, dry_run: bool) -> str:
        head = (
            f"would caption {self.captioned} images"
            if dry_run
            else f"captioned {self.captioned} images ({self.captions} captions)"
        )
        busy = self.seconds - self.engine_start_s
        rate = (
            f", {self.captions / busy:.1f} captions/s after a {self.engine_start_s:.0f} s engine start"
            if self.captions and busy > 0
            else ""
        )
        reasons = "; ".join(f"{k}: {v}" for k, v in sorted(self.failure_reasons.items()))
        return (
            f"recipe {self.recipe[:12]}: {self.images_seen} images seen, {head}, {self.already_cached} already cached, "
            f"{self.failed} failed{f' ({reasons})' if reasons else ''}, {self.other_shards} in other shards{rate}"
        )


def default_decode_workers() -> int:
    """Decode processes beside the engine: on a GPU machine up to 8; on CPU one thread, since vLLM's
    CPU workers keep every core busy and extra processes only slow generation down (measured)."""
    import torch

    return min(8, max((os.cpu_count() or 2) // 2, 1)) if torch.cuda.is_available() else 0


def parse_shard(spec: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise UserError(f"--shard {spec!r}: expected i/n, e.g. 0/8") from None
    if count < 1 or not 0 <= index < count:
        raise UserError(f"--shard {spec!r}: need 0 <= i < n")
    return index, count


def in_shard(image_sha256: str, index: int, count: int) -> bool:
    """Deterministic partition of images by content hash."""
    return int(image_sha256[:16], 16) % count == index


def request_seed(seed: int, image_sha256: str, prompt_id: str) -> int:
    return int(hashlib.sha256(f"{seed}:{image_sha256}:{prompt_id}".encode()).hexdigest()[:8], 16) % 2**31


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
    engine_args = {k: cfg.engine_args[k] for k in sorted(cfg.engine_args) if k in _output_affecting(cfg.backend)}
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


def _output_affecting(backend: str) -> tuple[str, ...]:
    if backend == "vllm":
        from captioning.vllm_engine import OUTPUT_AFFECTING_ARGS

        return OUTPUT_AFFECTING_ARGS
    return ("dtype",)


def make_engine(cfg: CaptionConfig) -> CaptionEngine:
    if cfg.backend == "vllm":
        from captioning.vllm_engine import VLLMEngine

        return VLLMEngine(cfg.model, cfg.engine_args, cfg.trust_remote_code)
    if cfg.backend == "hf":
        from captioning.hf_engine import HFEngine

        unknown = set(cfg.engine_args) - {"dtype"}
        if unknown:
            raise UserError(f"--backend hf takes only dtype among engine options, not {sorted(unknown)}")
        return HFEngine(cfg.model, cfg.device, str(cfg.engine_args.get("dtype", "auto")), cfg.trust_remote_code)
    raise UserError(f"--backend {cfg.backend!r}: choose vllm or hf")


@dataclass
class _Pending:
    """An image to caption: its identity and raw bytes, before decoding."""

    image_sha256: str
    source_id: str
    data: bytes


def _decode_one(item: _Pending, policy: ImagePolicy) -> tuple[_Pending, Any, str | None]:
    image, error = decode(item.data, policy)
    return _Pending(item.image_sha256, item.source_id, b""), image, error


def run_caption(cfg: CaptionConfig, engine: CaptionEngine | None = None) -> CaptionReport:
    """Caption every image of `cfg.inputs` missing from the cache under this recipe.

    An engine passed in is used and left open; one started here is closed at the end.
    """
    from tqdm import tqdm

    index, count = parse_shard(cfg.shard)
    if cfg.chunk_images < 1:
        raise UserError("--chunk-images must be positive")
    prompts = load_prompts(cfg.prompts_file)
    counts = samples_per_prompt(cfg.captions_per_image, len(prompts))
    entries = iter_images(cfg.inputs, cfg.image_column)
    cache = open_cache_for_writing(cfg.cache, cfg.mirror)
    name, version, template = engine_identity(cfg)
    if engine is not None and (engine.name != name or engine.engine_args != cfg.engine_args):
        raise ValueError(
            f"the engine given ({engine.name}, {engine.engine_args}) does not match the config ({cfg.backend}, "
            f"{cfg.engine_args})"
        )
    recipe_id = cache.add_recipe(caption_recipe(cfg, prompts, counts, name, version, template), cfg.recipe_name)
    report = CaptionReport(recipe=recipe_id)
    done = cache.complete_images(recipe_id, sum(counts))
    failures_out: list[dict[str, Any]] = []

    def todo() -> Iterator[_Pending]:
        seen: set[str] = set()
        for entry in entries:
            report.images_seen += 1
            if entry.data is None:
                if in_shard(sha256_bytes(entry.source_id.encode()), index, count):
                    _fail(report, failures_out, None, entry.source_id, entry.error or "unreadable")
                else:
                    report.other_shards += 1
                continue
            digest = sha256_bytes(entry.data)
            if not in_shard(digest, index, count):
                report.other_shards += 1
            elif digest in done or digest in seen:
                report.already_cached += 1
            else:
                seen.add(digest)
                yield _Pending(digest, entry.source_id, entry.data)

    started = time.perf_counter()
    if cfg.dry_run:
        report.captioned = sum(1 for _ in todo())
        return report
    if cfg.executor == "ray":
        from captioning.ray_executor import caption_on_ray

        caption_on_ray(cfg, list_images(cfg.inputs, cfg.image_column), (index, count), done, prompts, counts, report)
        return _checked(report)

    owns_engine = engine is None
    bar = tqdm(unit="image", dynamic_ncols=True)
    workers = default_decode_workers() if cfg.decode_workers is None else cfg.decode_workers
    pool: Executor = (
        ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        if workers > 0
        else ThreadPoolExecutor(1)
    )
    try:
        chunks = _chunked(todo(), cfg.chunk_images)
        decoded = _decode_ahead(pool, chunks, cfg.image_policy)
        for chunk in decoded:
            decoded_ok = []
            for item, image, error in chunk:
                if image is None:
                    _fail(report, failures_out, item.image_sha256, item.source_id, error or "undecodable")
                else:
                    decoded_ok.append((item.image_sha256, item.source_id, image))
            if decoded_ok and engine is None:
                t0 = time.perf_counter()
                engine = make_engine(cfg)  # only once there is work: a finished cache never starts one
                report.engine_start_s = time.perf_counter() - t0
            rows = caption_images(engine, cfg, prompts, counts, recipe_id, decoded_ok) if decoded_ok else []
            fails = [{**f, "recipe": recipe_id} for f in failures_out]
            cache.commit(rows, fails)
            failures_out.clear()
            images = len({r["image_sha256"] for r in rows})
            report.captioned += images
            report.captions += len(rows)
            bar.update(len(chunk))
            report.timeline.append((time.perf_counter() - started, len(rows)))
            busy = time.perf_counter() - started - report.engine_start_s
            bar.set_postfix(captions_per_s=f"{report.captions / busy:.1f}", failed=report.failed, refresh=False)
        if failures_out:
            cache.commit([], [{**f, "recipe": recipe_id} for f in failures_out])
    finally:
        pool.shutdown(cancel_futures=True)
        bar.close()
        if owns_engine and engine is not None:
            engine.close()
    report.seconds = time.perf_counter() - started
    return _checked(report)


def _checked(report: CaptionReport) -> CaptionReport:
    """Refuse a run where every image failed (a wrong input, not a few bad files); a rerun with only bad files left is
    fine."""
    if report.failed and report.captioned == 0 and report.already_cached == 0:
        raise UserError(f"every image failed ({report.failed}); first reasons: {report.failure_reasons}")
    return report


def caption_images(
    engine: CaptionEngine,
    cfg: CaptionConfig,
    prompts: list[Prompt],
    counts: list[int],
    recipe_id: str,
    images: list[tuple[str, str, Any]],
) -> list[dict[str, Any]]:
    """Cache rows for decoded `(image_sha256, source_id, image)`s: each prompt's samples, seeded per (image, prompt).

    Both executors caption through here, so a recipe's captions do not depend on how the work was cut.
    """
    requests, owners = [], []
    for image_sha256, source_id, image in images:
        for prompt, n in zip(prompts, counts):
            if n:
                requests.append(CaptionRequest(image, prompt, n, request_seed(cfg.seed, image_sha256, prompt.id)))
                owners.append((image_sha256, source_id))
    rows = []
    for request, (image_sha256, source_id), samples in zip(requests, owners, engine.generate(requests, cfg.sampling)):
        for k, g in enumerate(samples):
            rows.append(
                caption_row(
                    image_sha256, source_id, recipe_id, request.prompt.id, k, g.text, g.finish_reason, g.num_tokens
                )
            )
    return rows


def engine_identity(cfg: CaptionConfig) -> tuple[str, str, str]:
    """Engine name, version and the model's chat template, without starting an engine."""
    from captioning.engines import load_processor

    template = load_processor(cfg.model, cfg.trust_remote_code).chat_template
    if cfg.backend == "vllm":
        import vllm

        return "vllm", vllm.__version__, template
    if cfg.backend == "hf":
        import transformers

        return "transformers", transformers.__version__, template
    raise UserError(f"--backend {cfg.backend!r}: choose vllm or hf")


def _fail(
    report: CaptionReport, out: list[dict[str, Any]], image_sha256: str | None, source_id: str, reason: str
) -> None:
    report.failed += 1
    key = reason.split(" (")[0]
    report.failure_reasons[key] = report.failure_reasons.get(key, 0) + 1
    out.append({"image_sha256": image_sha256, "source_id": source_id, "reason": reason})


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
