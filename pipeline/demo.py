"""`tcjepa demo`: the pipeline on built-in synthetic data, on a laptop CPU, with no arguments.

Each step is a real command run in this process and is skipped when its output
is already there, so a second `tcjepa demo` resumes instead of starting over.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

DEMO_IMAGES = 400
DEMO_T5_STEPS = 1500
DEMO_VLM_IMAGES = 64


def run_demo(out: Path, n_images: int = DEMO_IMAGES, t5_steps: int = DEMO_T5_STEPS, seed: int = 0) -> dict[str, Any]:
    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from captioning.engines import SamplingConfig
    from captioning.job import CaptionConfig, run_caption
    from embedding_cache.job import EmbedConfig, run_embed
    from embedding_cache.store import EmbeddingStore
    from pipeline.synth import generate
    from pipeline.tiny_models import build_tiny_models

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def step(name: str) -> float:
        print(f"[demo] {name}", flush=True)
        return time.perf_counter()

    data = out / "data"
    t = step(f"synth: {n_images} scenes with 8 captions each -> {data}")
    if not (data / "classes.json").exists():
        generate(data, n_images, seed=seed)
    timings["synth_s"] = time.perf_counter() - t

    models = out / "models"
    t = step(f"tiny-models: T5 trained {t5_steps} steps on the scene captions, random tiny Qwen2-VL -> {models}")
    stats_file = models / "stats.json"
    if not stats_file.exists():
        stats = build_tiny_models(models, t5_corpus=data / "captions.jsonl", t5_steps=t5_steps, seed=seed)
        stats_file.write_text(json.dumps(stats))
    model_stats = json.loads(stats_file.read_text())
    timings["tiny_models_s"] = time.perf_counter() - t

    t = step(f"caption: the tiny random Qwen2-VL through vLLM on {DEMO_VLM_IMAGES} images (junk text by construction; its own recipe)")
    cache = CaptionCache.open_or_create(out / "cache")
    images = sorted((data / "images").glob("*.png"))[:DEMO_VLM_IMAGES]
    vlm = run_caption(CaptionConfig(inputs=images, cache=out / "cache", model=str(models / "vlm"), recipe_name="tiny-vlm",
                                    engine_args={"max_model_len": 1024}, sampling=SamplingConfig(max_tokens=16), chunk_images=32))
    print(f"[demo]   {vlm.summary(dry_run=False)}")
    timings["caption_vlm_s"] = time.perf_counter() - t

    t = step("caption: import the scene captions (what the scene graph says) into the same cache")
    print(f"[demo]   {import_annotations(cache, data / 'captions.jsonl', name='synthetic-scenes').summary()}")
    timings["caption_import_s"] = time.perf_counter() - t

    t = step("embed: T5 token embeddings of the scene captions -> Zarr store")
    report = run_embed(EmbedConfig(cache=out / "cache", store=out / "store", model=str(models / "t5"), recipes=["synthetic-scenes"], device="cpu"))
    print(f"[demo]   {report.summary(dry_run=False)}")
    timings["embed_s"] = time.perf_counter() - t

    info = cache.info()
    summary = {
        "images": info.images,
        "recipes": {r["name"]: r["captions"] for r in info.recipes},
        "captions": info.captions,
        "store": EmbeddingStore(out / "store").stats(),
        "t5_binding_score": model_stats["t5_binding_score"],
        "t5_training": model_stats["t5_training"],
        **{k: round(v, 1) for k, v in timings.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
