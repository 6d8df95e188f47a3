"""Caption and embed through the local executor and through Ray Data (1 and 2 workers): throughput, Ray's overhead, equality.

The same job runs three times on the same inputs, each into a fresh cache / store:
  local   this process (`--executor local`)
  ray1    a local Ray instance, one model actor
  ray2    the same with two actors
Start-up (Ray, actor creation, model loading, vLLM's engine start) is excluded: a run's
rate is the work done between its first and its last finished batch over that time.
Ray's overhead is local/ray1 - 1 at equal workers (goal: <= 15%). Two cores cannot show
scaling (two actors share them); what matters here is overhead and that the caches and
stores are equal: the same caption rows, the same keys with vectors within a float16 step.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("RAY_ADDRESS", None)


def steady_rate(timeline: list[tuple[float, int]], per_unit: int = 1) -> float:
    """Units per second from the first finished batch to the last (the work of all batches after the first)."""
    points = sorted(timeline)
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return float("nan")
    return sum(n for _, n in points[1:]) / per_unit / (points[-1][0] - points[0][0])


def caption_rows(cache: Path) -> list[tuple]:
    from captioning.cache import CaptionCache

    table = CaptionCache(cache).read_captions(columns=["image_sha256", "source_id", "prompt_id", "sample", "text", "finish_reason"])
    return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names)))


def store_vectors(path: Path) -> dict[bytes, np.ndarray]:
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.store import EmbeddingStore

    store, reader = EmbeddingStore(path), EmbeddingReader(path)
    return {k.tobytes(): reader.get_key(k.tobytes()) for seg in store.segment_ids() for k in store.read_keys(seg)}


def stores_equal(a: Path, b: Path) -> bool:
    want, got = store_vectors(a), store_vectors(b)
    return want.keys() == got.keys() and all(np.allclose(got[k].astype(np.float32), v.astype(np.float32), atol=2e-3, rtol=2e-3) for k, v in want.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caption-images", type=int, default=64, help="images captioned through vLLM (8 captions each)")
    ap.add_argument("--chunk-images", type=int, default=4, help="images per engine call / Ray batch")
    ap.add_argument("--embed-scenes", type=int, default=1500, help="synthetic scenes whose 8 captions each are embedded")
    ap.add_argument("--window", type=int, default=1024, help="captions per embed batch (a segment each under Ray)")
    ap.add_argument("--stages", default="caption,embed", help="comma-separated subset of caption,embed")
    args = ap.parse_args()

    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from captioning.engines import SamplingConfig
    from captioning.job import CaptionConfig, run_caption
    from embedding_cache.job import EmbedConfig, run_embed
    from pipeline.synth import generate
    from pipeline.tiny_models import build_tiny_models

    results: dict[str, Any] = {"benchmark": "scaleout", "cpus": os.cpu_count()}
    runs = {"local": ("local", None), "ray1": ("ray", 1), "ray2": ("ray", 2)}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        generate(tmp / "data", max(args.embed_scenes, args.caption_images), seed=1)
        build_tiny_models(tmp / "models")
        if "caption" in args.stages:
            few = tmp / "few"
            few.mkdir()
            for p in sorted((tmp / "data" / "images").glob("*.png"))[: args.caption_images]:
                (few / p.name).symlink_to(p)
            base = CaptionConfig(inputs=[few], cache=tmp / "unused", model=str(tmp / "models" / "vlm"), engine_args={"max_model_len": 1024},
                                 sampling=SamplingConfig(max_tokens=16), chunk_images=args.chunk_images, decode_workers=0)
            caption: dict[str, Any] = {"images": args.caption_images}
            for name, (executor, workers) in runs.items():
                report = run_caption(replace(base, cache=tmp / f"cache-{name}", executor=executor, num_workers=workers))
                caption[f"{name}_images_per_s"] = round(steady_rate(report.timeline, 8), 2)
            reference = caption_rows(tmp / "cache-local")
            caption["rows"] = len(reference)
            caption["rows_equal"] = all(caption_rows(tmp / f"cache-{n}") == reference for n in ("ray1", "ray2"))
            caption["ray1_overhead"] = round(caption["local_images_per_s"] / caption["ray1_images_per_s"] - 1, 3)
            caption["ray2_vs_ray1"] = round(caption["ray2_images_per_s"] / caption["ray1_images_per_s"], 3)
            results["caption"] = caption
        if "embed" in args.stages:
            import_annotations(CaptionCache.open_or_create(tmp / "annotations"), tmp / "data" / "captions.jsonl")
            embed: dict[str, Any] = {}
            for name, (executor, workers) in runs.items():
                report = run_embed(EmbedConfig(cache=tmp / "annotations", store=tmp / f"store-{name}", model=str(tmp / "models" / "t5"),
                                               window=args.window, progress=False, executor=executor, num_workers=workers))
                embed[f"{name}_captions_per_s"] = round(steady_rate(report.timeline), 1)
                embed["captions"] = report.encoded
            embed["stores_equal"] = all(stores_equal(tmp / "store-local", tmp / f"store-{n}") for n in ("ray1", "ray2"))
            embed["ray1_overhead"] = round(embed["local_captions_per_s"] / embed["ray1_captions_per_s"] - 1, 3)
            embed["ray2_vs_ray1"] = round(embed["ray2_captions_per_s"] / embed["ray1_captions_per_s"], 3)
            results["embed"] = embed
    print(json.dumps(results))


if __name__ == "__main__":
    main()
