"""Start-up cost of a training run against the size of its store: rank 0's run index, and a DataLoader worker.

Builds a synthetic run at two sizes (N captions in S segments, then `--scale` times both): tiny PNG images,
a caption cache of their captions (written with `import_annotations`) and a store of random token vectors
(written with the store's public API: open_or_create / new_segment / append / finish / publish). For each size it
measures, `--repeats` times (the median counts; the machine is shared):
  index_build_s   rank 0 builds the run index (join, every caption resolved to its span) and saves it
  worker_open_s   a DataLoader worker, from the loader's start until its first batch is made: the worker process's
                  start (worker_start_s, a fork of the parent) and its first batch (worker_first_batch_s)
  worker_rss_mb   that worker's resident memory after `--batches` batches, and its private part (what the worker
                  itself added: a forked worker's RSS also counts the pages it shares with its parent)
  open_files      that worker's open file descriptors then, and those on the store's files (the reader keeps at
                  most 256 shard files mapped; the rest are the process's own: torch, pipes, the libraries)
The goals (issue 18): time per caption of the index at `--scale`× within 1.3× of the smaller run, open files
bounded, and a worker whose memory grows with the index's columns only, not with the store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment

CAPTIONS_PER_IMAGE = 4


def build_run(root: Path, captions: int, segments: int, dim: int, tokens: int, seed: int) -> tuple[Path, Path, Path]:
    """(images, cache, store): `captions` / CAPTIONS_PER_IMAGE tiny PNGs, their captions, and a store holding every
    caption's random vectors in `segments` segments."""
    from PIL import Image

    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from embedding_cache.store import EmbeddingStore
    from pipeline.core.recipes import text_key

    rng = np.random.default_rng(seed)
    images, n_images = root / "images", captions // CAPTIONS_PER_IMAGE
    images.mkdir(parents=True)
    lines = []
    for i in range(n_images):
        pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{i:07d}.png")
        texts = [f"image {i} caption {k}" for k in range(CAPTIONS_PER_IMAGE)]
        lines.append(json.dumps({"image": f"{i:07d}.png", "captions": texts}))
    (root / "captions.jsonl").write_text("\n".join(lines) + "\n")
    cache = CaptionCache.open_or_create(root / "cache")
    import_annotations(cache, root / "captions.jsonl", images)

    store = EmbeddingStore.open_or_create(root / "store", {"kind": "benchmark-startup", "d": dim}, dim)
    order = rng.permutation(n_images * CAPTIONS_PER_IMAGE)  # an image's captions land in different segments
    for part in np.array_split(order, segments):
        writer = store.new_segment()
        for c in part.tolist():
            i, k = divmod(c, CAPTIONS_PER_IMAGE)
            writer.append(text_key(f"image {i} caption {k}"), rng.standard_normal((tokens, dim)).astype(np.float16))
        writer.finish()
        store.publish(writer)
    return images, root / "cache", root / "store"


def _proc_status(store: str) -> dict[str, float]:
    """This process's resident memory (MB): all of it, and what is its own (private: written since the fork, or
    mapped only here); its open file descriptors, and those on files of `store`."""
    kb = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, _, value = line.partition(":")
        kb[name] = int(value.split()[0])
    fds = os.listdir("/proc/self/fd")
    root = os.path.realpath(store)
    on_store = 0
    for fd in fds:
        try:
            on_store += os.path.realpath(f"/proc/self/fd/{fd}").startswith(root + os.sep)
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return {
        "rss_mb": kb["Rss"] / 1024,
        "private_mb": (kb["Private_Clean"] + kb["Private_Dirty"]) / 1024,
        "open_files": len(fds),
        "open_store_files": on_store,
    }


def _probe_class() -> Any:
    import torch

    class Probe(torch.utils.data.Dataset):
        """Step s of the training dataset, answering the worker's memory and open files after it."""

        def __init__(self, data: Any, steps: int) -> None:
            self.data, self.steps = data, steps

        def __len__(self) -> int:
            return self.steps

        def __getitem__(self, step: int) -> dict[str, float]:
            started = time.monotonic()  # the same clock in every process
            batch = self.data[step]
            return {
                **_proc_status(self.data.cfg.text_store),
                "captions": int((batch.lengths > 0).sum()),
                "started": started,
                "done": time.monotonic(),
            }

    return Probe


def measure(images: Path, cache: Path, store: Path, batches: int, repeats: int, run: Path) -> dict[str, Any]:
    import torch

    from embedding_cache.reader import StoreKeys
    from train.config import TrainConfig
    from train.data import StepBatches
    from train.data_index import TrainIndex, build_index

    cfg = TrainConfig(
        images=[str(images)],
        cache=str(cache),
        store=str(store),
        model="vit_tiny",
        patch_size=8,
        image_size=32,
        batch_size=16,
        steps=batches,
        captions_per_image=CAPTIONS_PER_IMAGE,
        min_context=2,
        seed=0,
    )
    builds, opens, starts, finals = [], [], [], []
    for attempt in range(repeats + 1):  # the first warms imports and the page cache, and is not counted
        tick = time.perf_counter()
        index = build_index([images], cache, store, [], progress=False, verify_sample=16)
        index.save(run / "index.parquet")
        if attempt:
            builds.append(time.perf_counter() - tick)
    index = TrainIndex.load(run / "index.parquet")
    data = StepBatches(index, np.arange(len(index)), cfg, (4, 4))
    key_indexes = StoreKeys.builds
    probe = _probe_class()(data, batches)
    for _ in range(repeats):
        loader = torch.utils.data.DataLoader(probe, batch_size=None, num_workers=1, prefetch_factor=2)
        tick = time.monotonic()
        it = iter(loader)
        first = next(it)
        opens.append(first["done"] - tick)
        starts.append(first["started"] - tick)
        finals.append(list(it)[-1] if batches > 1 else first)
        del it, loader
    spans = index.caption_spans
    columns = (
        index.caption_keys.nbytes
        + index.caption_offsets.nbytes
        + sum(a.nbytes for a in (spans.segment, spans.start, spans.length))
    )
    n = len(index.caption_keys)
    return {
        "captions": n,
        "segments": len(index.segments),
        "images": len(index),
        "index_build_s": round(statistics.median(builds), 4),
        "index_build_us_per_caption": round(1e6 * statistics.median(builds) / n, 3),
        "worker_open_s": round(statistics.median(opens), 4),
        "worker_open_us_per_caption": round(1e6 * statistics.median(opens) / n, 3),
        "worker_start_s": round(statistics.median(starts), 4),  # of worker_open_s: the process's start, until the
        "worker_first_batch_s": round(statistics.median(o - s for o, s in zip(opens, starts)), 4),  # dataset is asked
        "worker_rss_mb": round(statistics.median(f["rss_mb"] for f in finals), 1),
        "worker_private_mb": round(statistics.median(f["private_mb"] for f in finals), 1),
        "open_files": int(max(f["open_files"] for f in finals)),
        "open_store_files": int(max(f["open_store_files"] for f in finals)),
        "index_columns_mb": round(columns / 2**20, 3),
        "key_indexes_built_by_dataset": StoreKeys.builds - key_indexes,
        "batches": batches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captions", type=int, default=4000, help="captions of the smaller run")
    ap.add_argument("--segments", type=int, default=40, help="store segments of the smaller run")
    ap.add_argument("--dim", type=int, default=8, help="token vector width")
    ap.add_argument("--tokens-per-caption", type=int, default=4)
    ap.add_argument(
        "--scale", type=int, default=10, help="the larger run has this many times the captions and segments"
    )
    ap.add_argument("--batches", type=int, default=300, help="batches a worker reads before its memory is taken")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for factor in (1, args.scale):
            root = Path(tmp) / f"x{factor}"
            run = root / "run"
            run.mkdir(parents=True)
            tick = time.perf_counter()
            images, cache, store = build_run(
                root, args.captions * factor, args.segments * factor, args.dim, args.tokens_per_caption, args.seed
            )
            made = time.perf_counter() - tick
            result = measure(images, cache, store, args.batches, args.repeats, run)
            runs.append({**result, "synthesis_s": round(made, 1)})
            print(json.dumps(runs[-1]), flush=True)
    small, large = runs
    print_result(
        {
            **large,
            "scale": args.scale,
            "dim": args.dim,
            "tokens_per_caption": args.tokens_per_caption,
            "smaller": small,
            "index_build_per_caption_ratio": round(
                large["index_build_us_per_caption"] / small["index_build_us_per_caption"], 3
            ),
            "worker_open_ratio": round(large["worker_open_s"] / small["worker_open_s"], 3),
            "worker_rss_growth_mb": round(large["worker_rss_mb"] - small["worker_rss_mb"], 1),
            "worker_private_growth_mb": round(large["worker_private_mb"] - small["worker_private_mb"], 1),
            "index_columns_growth_mb": round(large["index_columns_mb"] - small["index_columns_mb"], 3),
            "goal_per_caption_ratio": 1.3,
            "goal_open_files": 256,
        }
    )


if __name__ == "__main__":
    main()
