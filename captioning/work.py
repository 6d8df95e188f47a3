"""What both executors of `tcjepa caption` share: the job's config and report, the partition of images into
shards, the engine's start, and how decoded images become cache rows.

The local job (`captioning.job`) and the Ray executor (`captioning.ray_executor`) both import this module and
never each other, so a recipe's captions are made by one piece of code however the work is cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.backends import get_backend
from captioning.cache import caption_row
from captioning.engines import CaptionEngine, CaptionRequest, SamplingConfig
from captioning.prompts import Prompt
from pipeline.core.images import ImagePolicy

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
    split: str = "train"  # of hf: inputs that do not name one
    chunk_images: int = 256
    decode_workers: int | None = None
    device: str = "auto"
    trust_remote_code: bool = False
    dry_run: bool = False
    mirror: Path | None = None  # where an s3:// cache is mirrored (default ~/.cache/tcjepa/mirror)
    executor: str = "local"  # local, or ray (Ray tasks decode, Ray actors caption; not part of the recipe)
    ray_address: str | None = None  # an existing cluster; default: RAY_ADDRESS, else a local instance
    ray_actors: int | None = None  # engine actors; default: one per GPU (per tensor_parallel_size GPUs), else 1
    progress: bool = True


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
    # (seconds since start, captions) of each finished chunk
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def count_failure(self, reason: str) -> None:
        """One more failed image, counted under its reason's first words."""
        self.failed += 1
        key = reason.split(" (")[0]
        self.failure_reasons[key] = self.failure_reasons.get(key, 0) + 1

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


def in_shard(image_sha256: str, index: int, count: int) -> bool:
    """Deterministic partition of images by content hash."""
    return int(image_sha256[:16], 16) % count == index


def request_seed(seed: int, image_sha256: str, prompt_id: str) -> int:
    return int(hashlib.sha256(f"{seed}:{image_sha256}:{prompt_id}".encode()).hexdigest()[:8], 16) % 2**31


def make_engine(cfg: CaptionConfig) -> CaptionEngine:
    """Start the engine of `cfg.backend` (slow: a vLLM engine takes ~20 s on a CPU and minutes for a large model)."""
    backend = get_backend(cfg.backend)
    backend.check_args(cfg.backend, cfg.engine_args)
    return backend.start(cfg.model, cfg.engine_args, cfg.device, cfg.trust_remote_code)


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
