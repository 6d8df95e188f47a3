"""Synthetic scenes made ready to train on: scenes, tiny models, their captions imported and embedded.

The demo and `benchmarks.ablations` start from the same data and the same training
configurations, sized for a 2-core CPU (they depart from the paper's on purpose).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

SCENE_IMAGES = 600
SCENE_RECIPE = "synthetic-scenes"
# Partial captions (a few objects each, some loosely): the text says some things, the pixels the rest, as with real
# captions. Full ones (every object and its cell) are for checking that the text reaches the predictor at all.
SCENE_CAPTIONS = "partial"
# A tiny ViT on 64 px scenes, one 16 px patch per grid cell; N=4 captions per image and the
# cheaper pooling (before_mlp) keep `cross` at about 2.5x the step time of `none`.
SCENE_TRAINING: dict[str, Any] = {
    "model": "vit_tiny",
    "depth": 6,
    "patch_size": 16,
    "image_size": 64,
    "predictor_width": 192,
    "predictor_depth": 4,
    "captions_per_image": 4,
    "pool": "before_mlp",
    "text_lr_scale": 10.0,
    "ema": [0.999, 1.0],
    "min_context": 2,
    "batch_size": 64,
    "steps": 300,
    "warmup_steps": 20,
    "lr": 0.001,
    "val_images": 64,
    "num_workers": 1,
    "log_every": 25,
    "val_every": 50,
    "checkpoint_every": 100,
}
# The configuration that learns (docs/experiments.md, section 5; the demo's): on free scenes (objects at any place
# and angle, so position does not answer), patch 8 so that a patch sees a fragment of an object, 400 steps, EMA
# 0.996 → 1, the paper's loss. There `none`'s encoders beat a random-init encoder and the patch pixels on dense shape
# mIoU and multi-label mAP by more than twice the 3-seed spread, in 7–12 minutes of training on 2 cores.
LEARNING_LAYOUT = "free"
LEARNING_TRAINING: dict[str, Any] = {
    **SCENE_TRAINING,
    "patch_size": 8,
    "steps": 400,
    "warmup_steps": 40,
    "lr": 0.001,
    "ema": [0.996, 1.0],
    "loss": "norm",
    "min_context": 0,
    "text_lr_scale": 1.0,
    "val_every": 100,
    "checkpoint_every": 100,
    "checkpoint_every_keep": 200,
}


def announce(name: str) -> float:
    """Print a step's name and return the time it started."""
    print(f"[demo] {name}", flush=True)
    return time.perf_counter()


def prepare_scenes(
    out: Path,
    n_images: int,
    t5_steps: int,
    seed: int,
    timings: dict[str, float],
    captions: str = SCENE_CAPTIONS,
    layout: str = "grid",
    text: bool = True,
) -> dict[str, Any]:
    """synth (`layout`, `captions` full or partial), tiny models, the scenes' captions imported and embedded into
    `out`; returns the tiny models' stats. Without `text`, the scenes alone (for runs that read no captions).

    Each part is skipped when its output is there, so a second call resumes.
    """
    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from embedding_cache.job import run_embed
    from embedding_cache.work import EmbedConfig
    from pipeline.devkit.dataset import generate
    from pipeline.devkit.tiny_models import build_tiny_models

    data = out / "data"
    t = announce(f"synth: {n_images} {layout} scenes with 8 {captions} captions each -> {data}")
    if not (data / "classes.json").exists():
        generate(data, n_images, seed=seed, captions=captions, layout=layout)
    have = sum(1 for _ in (data / "images").glob("*.png"))
    if have != n_images:
        raise UserError(f"{out} holds a demo of {have} scenes, not {n_images}; use another --out or --n-images {have}")
    made_with = json.loads((data / "classes.json").read_text()).get("captions", "full")
    if made_with != captions:
        raise UserError(f"{out} holds scenes with {made_with} captions, not {captions}; use another --out")
    drawn = json.loads((data / "classes.json").read_text()).get("layout", "grid")
    if drawn != layout:
        raise UserError(f"{out} holds {drawn} scenes, not {layout} ones; use another --out")
    timings["synth_s"] = time.perf_counter() - t
    if not text:
        return {}

    models = out / "models"
    t = announce(f"tiny-models: T5 trained {t5_steps} steps on the scene captions, random tiny Qwen2-VL -> {models}")
    stats_file = models / "stats.json"
    if not stats_file.exists():
        stats = build_tiny_models(models, t5_corpus=data / "captions.jsonl", t5_steps=t5_steps, seed=seed)
        stats_file.write_text(json.dumps(stats))
    timings["tiny_models_s"] = time.perf_counter() - t
    stats = json.loads(stats_file.read_text())
    if t5_steps and not stats["t5_training"].get("phrase_tags"):
        raise UserError(f"{models} holds a T5 trained without phrase tags (an older tcjepa); use another --out")
    if stats["t5_training"]["steps"] != t5_steps:
        raise UserError(
            f"{models} holds a T5 trained {stats['t5_training']['steps']} steps, not {t5_steps}; "
            f"use another --out or --t5-steps {stats['t5_training']['steps']}"
        )

    t = announce("caption: import the scene captions (what the scene graph says) into the cache")
    cache = CaptionCache.open_or_create(out / "cache")
    print(f"[demo]   {import_annotations(cache, data / 'captions.jsonl', name=SCENE_RECIPE).summary()}")
    timings["caption_import_s"] = time.perf_counter() - t

    t = announce("embed: T5 token embeddings of the scene captions -> Zarr store")
    report = run_embed(
        EmbedConfig(
            cache=out / "cache",
            store=out / "store",
            model=str(models / "t5"),
            recipes=[SCENE_RECIPE],
            device="cpu",
            progress=False,
        )
    )
    print(f"[demo]   {report.summary(dry_run=False)}")
    timings["embed_s"] = time.perf_counter() - t
    return stats
