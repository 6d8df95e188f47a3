"""Caption and embed through the local executor and through Ray Data (1 and 2 workers): throughput, Ray's overhead,
equality.

The same job runs on the same inputs through each executor, each into a fresh cache / store:
  local   this process (`--executor local`)
  rayK    a local Ray instance with K model actors (`--ray-workers`, default 1 and 2)
Start-up (Ray, actor creation, model loading, vLLM's engine start) is excluded: a run's
rate is the work done between its first and its last finished batch over that time.
Each job runs `--repeats` times, the executors taking turns, and each figure is the
median of its repeats (two runs of the same job on this machine differ by up to ~30%),
with the lowest and highest beside it. Ray's overhead is local/ray1 - 1 at equal workers
(goal: <= 15%), from the medians. Without GPUs an embed actor computes on the one thread
of its CPU slot, so the local embed run gets one thread too, and `local_all_threads`
beside it shows the local executor on every core. Two cores cannot show
scaling (two actors share them); what matters here is overhead and that the caches and
stores are equal: the same caption rows, the same keys with vectors within a float16 step.

By default the models are the tiny ones built here and the images `tcjepa synth` scenes.
On a GPU node, `--vlm`, `--t5` and `--images` measure what a real job does per GPU
(`local` uses one GPU; `--ray-workers 1` where the node has one). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment

os.environ.pop("RAY_ADDRESS", None)


def steady_rate(timeline: list[tuple[float, int]], per_unit: int = 1) -> float:
    """Units per second from the first finished batch to the last (the work of all batches after the first)."""
    points = sorted(timeline)
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return float("nan")
    return sum(n for _, n in points[1:]) / per_unit / (points[-1][0] - points[0][0])


def summarise(rates: list[float], digits: int) -> dict[str, float]:
    """The median of a run's repeats, and their range."""
    return {
        "median": round(statistics.median(rates), digits),
        "min": round(min(rates), digits),
        "max": round(max(rates), digits),
    }


def caption_rows(cache: Path) -> list[tuple]:
    from captioning.cache import CaptionCache

    table = CaptionCache(cache).read_captions(
        columns=["image_sha256", "source_id", "prompt_id", "sample", "text", "finish_reason"]
    )
    return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names)))


def store_vectors(path: Path) -> dict[bytes, np.ndarray]:
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.store import EmbeddingStore

    store, reader = EmbeddingStore(path), EmbeddingReader(path)
    return {k.tobytes(): reader.get_key(k.tobytes()) for seg in store.segment_ids() for k in store.read_keys(seg)}


def stores_equal(a: Path, b: Path) -> bool:
    want, got = store_vectors(a), store_vectors(b)
    return want.keys() == got.keys() and all(
        np.allclose(got[k].astype(np.float32), v.astype(np.float32), atol=2e-3, rtol=2e-3) for k, v in want.items()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of each job per executor, taking turns; figures are their medians"
    )
    ap.add_argument("--caption-images", type=int, default=128, help="images captioned through vLLM (8 captions each)")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens per caption")
    ap.add_argument("--chunk-images", type=int, default=4, help="images per engine call / Ray batch")
    ap.add_argument(
        "--embed-scenes", type=int, default=1500, help="synthetic scenes whose 8 captions each are embedded"
    )
    ap.add_argument("--window", type=int, default=1024, help="captions per embed batch (a segment each under Ray)")
    ap.add_argument("--stages", default="caption,embed", help="comma-separated subset of caption,embed")
    ap.add_argument(
        "--ray-workers", default="1,2", help="comma-separated actor counts to run under Ray (the overhead needs 1)"
    )
    ap.add_argument("--vlm", type=Path, help="a captioning model directory (default: the tiny Qwen2-VL built here)")
    ap.add_argument("--t5", type=Path, help="a T5 directory (default: the tiny T5 built here)")
    ap.add_argument("--images", type=Path, help="an image folder to caption (default: tcjepa synth scenes)")
    args = ap.parse_args()

    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from captioning.engines import SamplingConfig
    from captioning.job import run_caption
    from captioning.work import CaptionConfig
    from embedding_cache.job import run_embed
    from embedding_cache.work import EmbedConfig
    from pipeline.core.refs import IMAGE_SUFFIXES
    from pipeline.devkit.dataset import generate
    from pipeline.devkit.tiny_models import build_tiny_models

    results: dict[str, Any] = {"benchmark": "scaleout", "cpus": os.cpu_count()}
    runs = {"local": ("local", None), **{f"ray{k}": ("ray", k) for k in map(int, args.ray_workers.split(","))}}
    if "ray1" not in runs:
        raise SystemExit("--ray-workers must include 1: Ray's overhead is measured at equal workers")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        generate(
            tmp / "data", args.embed_scenes if args.images else max(args.embed_scenes, args.caption_images), seed=1
        )
        if not (args.vlm and args.t5):
            build_tiny_models(tmp / "models")
        vlm, t5 = args.vlm or tmp / "models" / "vlm", args.t5 or tmp / "models" / "t5"
        if "caption" in args.stages:
            few = tmp / "few"
            few.mkdir()
            images = sorted(
                p for p in (args.images or tmp / "data" / "images").rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
            )
            for k, p in enumerate(images[: args.caption_images]):
                (few / f"{k:06d}{p.suffix}").symlink_to(p.resolve())
            base = CaptionConfig(
                inputs=[few],
                cache=tmp / "unused",
                model=str(vlm),
                engine_args={} if args.vlm else {"max_model_len": 1024},
                sampling=SamplingConfig(max_tokens=args.max_tokens),
                chunk_images=args.chunk_images,
            )
            rates: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats):
                for name, (executor, workers) in runs.items():
                    report = run_caption(
                        replace(base, cache=tmp / f"cache-{name}-{repeat}", executor=executor, ray_actors=workers)
                    )
                    rates[name].append(steady_rate(report.timeline, 8))
            reference = caption_rows(tmp / "cache-local-0")
            caption: dict[str, Any] = {
                "images": min(len(images), args.caption_images),
                "chunk_images": args.chunk_images,
                "repeats": args.repeats,
            }
            caption.update({f"{name}_images_per_s": summarise(r, 2) for name, r in rates.items()})
            caption["rows"] = len(reference)
            caption["rows_equal"] = all(
                caption_rows(tmp / f"cache-{n}-{r}") == reference for n in runs for r in range(args.repeats)
            )
            median = {name: statistics.median(r) for name, r in rates.items()}
            caption["ray1_overhead"] = round(median["local"] / median["ray1"] - 1, 3)
            caption.update(
                {f"{n}_vs_ray1": round(median[n] / median["ray1"], 3) for n in runs if n not in ("local", "ray1")}
            )
            results["caption"] = caption
        if "embed" in args.stages:
            import_annotations(CaptionCache.open_or_create(tmp / "annotations"), tmp / "data" / "captions.jsonl")
            import torch

            threads = torch.get_num_threads()
            # Without GPUs a T5 actor holds one CPU slot, and Ray gives it one thread: `local` gets one too (equal
            # workers); `local_all_threads` shows what the local executor does with every core.
            embed_runs = {name: (executor, workers, threads) for name, (executor, workers) in runs.items()}
            if not torch.cuda.is_available() and threads > 1:
                embed_runs = {
                    "local": ("local", None, 1),
                    "local_all_threads": ("local", None, threads),
                    **{n: run for n, run in embed_runs.items() if n != "local"},
                }
            embed_rates: dict[str, list[float]] = {name: [] for name in embed_runs}
            encoded = 0
            for repeat in range(args.repeats):
                for name, (executor, workers, run_threads) in embed_runs.items():
                    torch.set_num_threads(run_threads)
                    report = run_embed(
                        EmbedConfig(
                            cache=tmp / "annotations",
                            store=tmp / f"store-{name}-{repeat}",
                            model=str(t5),
                            window=args.window,
                            progress=False,
                            executor=executor,
                            ray_actors=workers,
                        )
                    )
                    embed_rates[name].append(steady_rate(report.timeline))
                    encoded = report.encoded
            torch.set_num_threads(threads)
            embed: dict[str, Any] = {
                "captions": encoded,
                "window": args.window,
                "repeats": args.repeats,
                "local_threads": {name: run[2] for name, run in embed_runs.items() if run[0] == "local"},
            }
            embed.update({f"{name}_captions_per_s": summarise(r, 1) for name, r in embed_rates.items()})
            embed["stores_equal"] = all(
                stores_equal(tmp / "store-local-0", tmp / f"store-{n}-{r}")
                for n in embed_runs
                for r in range(args.repeats)
            )
            median = {name: statistics.median(r) for name, r in embed_rates.items()}
            embed["ray1_overhead"] = round(median["local"] / median["ray1"] - 1, 3)
            embed.update(
                {f"{n}_vs_ray1": round(median[n] / median["ray1"], 3) for n in embed_runs if n not in ("local", "ray1")}
            )
            results["embed"] = embed
    print_result(results)


if __name__ == "__main__":
    main()
