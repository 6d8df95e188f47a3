"""`tcjepa caption --executor ray`: the images as a Ray Dataset, read and decoded in Ray tasks, captioned by VLM actors.

The driver lists the images without reading them (``pipeline.core.sources.list_images``: the
same source ids as the local executor) and computes the recipe exactly as the local
executor does. Ray tasks read each image, hash it, drop those of other `--shard`s and
those the cache already holds, and decode and downscale the rest (CPU work that scales
with the cluster). An actor per GPU (per CPU slot without GPUs) starts our captioning
engine once, captions each batch through the same code as the local executor (seeded per
image and prompt, so the captions do not depend on how the work is cut) and commits it to
the cache itself; the cache's writers are safe to run at once (a file lock, or the
``s3://`` log). Ray restarts an actor whose process dies and retries its batch; the
commit drops rows already published, so nothing is captioned into the cache twice.
On a cluster the cache must be reachable from every node: a shared file system or ``s3://``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from captioning.prompts import Prompt
from captioning.remote_cache import open_cache_for_writing
from captioning.vllm_engine import give_this_process_to_the_engine
from captioning.work import CaptionConfig, CaptionReport, caption_images, in_shard, make_engine
from pipeline.core.images import decode
from pipeline.core.ray_cluster import actor_resources, start_ray
from pipeline.core.recipes import sha256_bytes
from pipeline.core.refs import ImageRef
from pipeline.core.sources import ImageReader

TO_CAPTION, OTHER_SHARD, CACHED, FAILED = "to-caption", "other-shard", "cached", "failed"  # what a read task found


def _plain(value: Any) -> Any:
    """A numpy scalar as its Python value (strings arrive as Python objects already)."""
    return value.item() if isinstance(value, np.generic) else value


def read_and_decode(
    batch: dict[str, np.ndarray], cfg: CaptionConfig, shard: tuple[int, int], done: frozenset[str]
) -> dict[str, np.ndarray]:
    """A Ray task: each image read, hashed, sorted into to-caption / other shard / cached / failed, and decoded when to
    be captioned."""
    reader = ImageReader()
    status, digests, images, reasons = [], [], [], []
    try:
        for row in range(len(batch["source_id"])):
            ref = ImageRef(
                **{name: _plain(batch[name][row]) for name in ("source_id", "kind", "path", "offset", "size", "column")}
            )
            image, digest, reason = None, "", ""
            try:
                data = reader.read(ref)
            except OSError as exc:  # sharded by the source id, as the local executor does
                state = FAILED if in_shard(sha256_bytes(ref.source_id.encode()), *shard) else OTHER_SHARD
                reason = str(exc).split(": ", 1)[-1]
            else:
                digest = sha256_bytes(data)
                if not in_shard(digest, *shard):
                    state = OTHER_SHARD
                elif digest in done:
                    state = CACHED
                else:
                    image, error = decode(data, cfg.image_policy)
                    state, reason = (TO_CAPTION, "") if image is not None else (FAILED, error or "undecodable")
            status.append(state)
            digests.append(digest)
            reasons.append(reason)
            images.append(np.asarray(image, dtype=np.uint8) if image is not None else np.zeros((0, 0, 3), np.uint8))
    finally:
        reader.close()
    out = np.empty(len(images), dtype=object)
    out[:] = images
    return {
        "source_id": batch["source_id"],
        "status": np.array(status),
        "image_sha256": np.array(digests),
        "reason": np.array(reasons),
        "image": out,
    }


class CaptionActor:
    """A Ray Data actor: the captioning engine started once; each batch captioned and committed to the cache."""

    def __init__(self, cfg: CaptionConfig, prompts: list[Prompt], counts: list[int], recipe_id: str) -> None:
        self.cfg, self.prompts, self.counts, self.recipe_id = cfg, prompts, counts, recipe_id
        self.cache = open_cache_for_writing(cfg.cache, cfg.mirror)
        self.engine: Any = None  # started on the first image to caption: a finished cache never starts one
        give_this_process_to_the_engine()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from PIL import Image

        to_caption, failures = [], []
        for source_id, state, digest, reason, image in zip(
            batch["source_id"], batch["status"], batch["image_sha256"], batch["reason"], batch["image"]
        ):
            if state == TO_CAPTION:
                to_caption.append(
                    (str(digest), str(source_id), Image.fromarray(np.asarray(image, dtype=np.uint8), "RGB"))
                )
            elif state == FAILED:
                failures.append(
                    {
                        "image_sha256": str(digest) or None,
                        "source_id": str(source_id),
                        "recipe": self.recipe_id,
                        "reason": str(reason),
                    }
                )
        if to_caption and self.engine is None:
            self.engine = make_engine(self.cfg)
        rows = (
            caption_images(self.engine, self.cfg, self.prompts, self.counts, self.recipe_id, to_caption)
            if to_caption
            else []
        )
        if rows or failures:
            self.cache.commit(rows, failures)
        counts = Counter(str(s) for s in batch["status"])
        reasons = Counter(str(r).split(" (")[0] for s, r in zip(batch["status"], batch["reason"]) if s == FAILED)
        return {
            "images": np.array([len(batch["status"])]),
            "captioned": np.array([len(to_caption)]),
            "captions": np.array([len(rows)]),
            "other_shards": np.array([counts[OTHER_SHARD]]),
            "cached": np.array([counts[CACHED]]),
            "failed": np.array([counts[FAILED]]),
            "reasons": np.array([json.dumps(reasons)]),
            "done": np.array([time.time()]),
        }


def caption_on_ray(
    cfg: CaptionConfig,
    refs: Sequence[ImageRef],
    shard: tuple[int, int],
    done: set[str],
    prompts: list[Prompt],
    counts: list[int],
    report: CaptionReport,
) -> None:
    """Caption `refs` on a Ray cluster into the cache; fills `report` (images seen, captioned, failures, ...)."""
    import ray.data
    from tqdm import tqdm

    start_ray(cfg.ray_address)
    size, resources = actor_resources(cfg.device, cfg.ray_actors, int(cfg.engine_args.get("tensor_parallel_size", 1)))
    items = [
        {
            "source_id": r.source_id,
            "kind": r.kind,
            "path": r.path,
            "offset": r.offset,
            "size": r.size,
            "column": r.column,
        }
        for r in refs
    ]
    blocks = max(len(items) // cfg.chunk_images, 1)
    dataset = (
        ray.data.from_items(items, override_num_blocks=blocks)
        .map_batches(
            read_and_decode,
            fn_kwargs={"cfg": cfg, "shard": shard, "done": frozenset(done)},
            batch_size=cfg.chunk_images,
        )
        .map_batches(
            CaptionActor,
            fn_constructor_args=(cfg, prompts, counts, report.recipe),
            batch_size=cfg.chunk_images,
            compute=ray.data.ActorPoolStrategy(size=size),
            **resources,
        )
    )
    started, wall = time.perf_counter(), time.time()
    report.images_seen = len(refs)
    reasons: Counter[str] = Counter()
    with tqdm(total=len(refs), unit="image", dynamic_ncols=True) as bar:
        for result in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            for i in range(len(result["images"])):
                report.captioned += int(result["captioned"][i])
                report.captions += int(result["captions"][i])
                report.other_shards += int(result["other_shards"][i])
                report.already_cached += int(result["cached"][i])
                report.failed += int(result["failed"][i])
                reasons.update(json.loads(str(result["reasons"][i])))
                report.timeline.append((float(result["done"][i]) - wall, int(result["captions"][i])))
                bar.update(int(result["images"][i]))
    report.failure_reasons = dict(reasons)
    report.seconds = time.perf_counter() - started
