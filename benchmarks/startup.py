"""Start-up cost of a training run against the size of its store: rank 0's run index, and a DataLoader worker.

Builds a synthetic run at two sizes (N captions in S segments, then `--scale` times both): tiny images in tar
shards of `--shard-images` members (one PNG with each image's number after its end: a million images take seconds
to write), a caption cache of their captions (committed as Arrow tables) and a store of random token vectors
(written with the store's public API: open_or_create / new_segment / append / finish / publish). For each size it
measures, `--repeats` times (the median counts; the machine is shared):
  index_build_s   rank 0 builds the run index (join, every caption resolved to its span) and saves it, in a
                  process of its own as at a run's start (each build spawned afresh), the tar
                  shards' listings remembered from an earlier run; of that, listing_us_per_image is the listing of
                  the images, and join_us_per_caption the rest; first_listing_us_per_image lists with nothing
                  remembered (every tar header parsed), as a first run on the images does (measured once a size);
                  its CPU time per caption, in user space and in the kernel (first touches of fresh memory), and the
                  resident memory it added at its peak
  worker_open_s   a DataLoader worker, from the loader's start until its first batch is made: the worker process's
                  start (worker_start_s, a fork of the parent) and its first batch (worker_first_batch_s)
  worker_rss_mb   that worker's resident memory after `--batches` batches, and its private part (what the worker
                  itself added: a forked worker's RSS also counts the pages it shares with its parent)
  open_files      that worker's open file descriptors then, and those on the store's files (the reader keeps at
                  most 256 shard files mapped; the rest are the process's own: torch, pipes, the libraries)
A run 1/100 the smaller's is built too, in turn with the others: its time is what any build in a fresh process costs
(first uses of Arrow, Parquet, thread pools), and index_build_marginal_us_per_caption is each size's time less it;
the smaller and tiny runs' builds, mostly that fixed cost, are repeated `--cheap-repeats` times as often.
The goals (issues 18 and 33): time per caption of the index at `--scale`× within 1.3× of the smaller run and
≤ 2 µs at 10⁷ captions (`--captions 100000 --scale 100`), open files bounded, and a worker whose memory grows with
the index's columns only, not with the store.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment

CAPTIONS_PER_IMAGE = 4


def _image_bytes(n_images: int, rng: np.random.Generator, cheap: bool) -> Iterator[bytes]:
    """Each image's bytes: an 8×8 PNG of random pixels, or (`cheap`) one such PNG with the image's number after its
    end (decoders stop at IEND), so every image has its own sha256 and a million take a second to make."""
    from PIL import Image

    def png(pixels: np.ndarray) -> bytes:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "PNG")
        return out.getvalue()

    template = png(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8))
    for i in range(n_images):
        yield template + i.to_bytes(8, "little") if cheap else png(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))


def _write_images(images: Path, n_images: int, seed: int, shard_images: int) -> tuple[list[str], list[str]]:
    """The images as PNG files, or as tar shards of `shard_images` members; their source ids (as `list_images`
    names them, checked on the first file or shard) and sha256s (hex), in listing order."""
    from pipeline.core.recipes import sha256_bytes
    from pipeline.core.sources import list_images

    ids, shas = [], []
    blobs = _image_bytes(n_images, np.random.default_rng([seed, 1]), cheap=shard_images > 0)
    if not shard_images:
        for i, data in enumerate(blobs):
            (images / f"{i:08d}.png").write_bytes(data)
            ids.append(f"{i:08d}.png")
            shas.append(sha256_bytes(data))
        first = images / ids[0]
    else:
        for shard, start in enumerate(range(0, n_images, shard_images)):
            name = f"shard-{shard:06d}.tar"
            with tarfile.open(images / name, "w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(start, min(start + shard_images, n_images)):
                    data = next(blobs)
                    member = tarfile.TarInfo(f"{i:08d}.png")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
                    ids.append(f"{name}::{member.name}")
                    shas.append(sha256_bytes(data))
        first = images / "shard-000000.tar"
    listed = [ref.source_id for ref in list_images([first])]  # a file or shard given alone is named as in its folder
    assert listed == ids[: len(listed)], (listed[:2], ids[:2])
    return ids, shas


def build_run(
    root: Path, captions: int, segments: int, dim: int, tokens: int, seed: int, shard_images: int = 0
) -> tuple[Path, Path, Path]:
    """(images, cache, store): `captions` / CAPTIONS_PER_IMAGE tiny images (PNG files, or tar shards of
    `shard_images` members), their captions committed to a cache as Arrow tables, and a store holding every
    caption's random vectors in `segments` segments (written with the store's public API). The images are written by
    a process of their own while this one writes the store (their captions' keys do not depend on them): at 10⁷
    captions each takes minutes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import pyarrow as pa

    from captioning.cache import CaptionCache
    from embedding_cache.store import EmbeddingStore
    from pipeline.core.recipes import text_key

    rng = np.random.default_rng(seed)
    images, n_images = root / "images", captions // CAPTIONS_PER_IMAGE
    images.mkdir(parents=True)
    texts = [f"image {i} caption {k}" for i in range(n_images) for k in range(CAPTIONS_PER_IMAGE)]
    keys = np.frombuffer(b"".join(text_key(t) for t in texts), np.uint8).reshape(-1, 32)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        written = pool.submit(_write_images, images, n_images, seed, shard_images)
        store = EmbeddingStore.open_or_create(root / "store", {"kind": "benchmark-startup", "d": dim}, dim)
        order = rng.permutation(len(keys))  # an image's captions land in different segments
        for part in np.array_split(order, segments):
            writer = store.new_segment()
            vectors = rng.standard_normal((len(part), tokens, dim)).astype(np.float16)
            for c, v in zip(part.tolist(), vectors):
                writer.append(keys[c].tobytes(), v)
            writer.finish()
            store.publish(writer)
        source_ids, shas = written.result()

    cache = CaptionCache.open_or_create(root / "cache")
    recipe = cache.add_recipe({"kind": "benchmark-startup", "captions_per_image": CAPTIONS_PER_IMAGE}, "synthetic")
    step = 250_000 // CAPTIONS_PER_IMAGE  # images per commit: 250,000 captions a cache shard
    for lo in range(0, n_images, step):
        hi = min(lo + step, n_images)
        rows = slice(lo * CAPTIONS_PER_IMAGE, hi * CAPTIONS_PER_IMAGE)
        image = np.repeat(np.arange(hi - lo), CAPTIONS_PER_IMAGE)
        n = len(image)
        cache.commit(
            pa.table(
                {
                    "image_sha256": pa.array(shas[lo:hi], pa.string()).take(image),
                    "source_id": pa.array(source_ids[lo:hi], pa.string()).take(image),
                    "recipe": pa.array([recipe] * n, pa.string()),
                    "prompt_id": pa.array(["p0"] * n, pa.string()),
                    "sample": pa.array(np.tile(np.arange(CAPTIONS_PER_IMAGE, dtype=np.int32), hi - lo)),
                    "text": pa.array(texts[rows], pa.string()),
                    "text_sha256": pa.array([k.hex() for k in map(bytes, keys[rows])], pa.string()),
                    "finish_reason": pa.array(["stop"] * n, pa.string()),
                    "num_tokens": pa.nulls(n, pa.int32()),
                }
            )
        )
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


def first_listing_s(images: Path) -> float:
    """Seconds to list the images with nothing remembered (a first run on them: tarfile reads every tar header), which
    leaves their listings remembered (`remembered_tar_members`, under TCJEPA_CACHE_DIR) for `index_build_s`."""
    from pipeline.core.sources import list_images

    tick = time.perf_counter()
    list_images([images])
    return time.perf_counter() - tick


def _resident_mb(field: str) -> float:
    """`VmRSS` (now) or `VmHWM` (the peak since `_reset_peak`) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Start this process's peak resident memory (`VmHWM`) again from its current size (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def index_build_s(images: Path, cache: Path, store: Path, run: Path) -> dict[str, float]:
    """Rank 0 builds the run index and saves it, the images' tar listings remembered by an earlier run
    (`first_listing_s`): seconds (`s`), and of those the listing's (`listing_s`); the CPU seconds of every thread in
    user space and in the kernel (`user_s`, `system_s`: the kernel's share is mostly first touches of fresh memory,
    whose cost is the machine's: a virtual machine that hands freed memory back to its host pays for every first
    touch again; docs/development.md); and how far the process's resident memory rose at its peak (`peak_mb`)."""
    import resource

    from pipeline.core.sources import list_images
    from train.data_index import build_index

    tick = time.perf_counter()
    list_images([images])
    listing = time.perf_counter() - tick
    _reset_peak()
    resident = _resident_mb("VmRSS")
    before = resource.getrusage(resource.RUSAGE_SELF)
    tick = time.perf_counter()
    build_index([images], cache, store, [], progress=False, verify_sample=16).save(run / "index.parquet")
    seconds = time.perf_counter() - tick
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "s": seconds,
        "listing_s": listing,
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
        "peak_mb": _resident_mb("VmHWM") - resident,
    }


def index_build_in_own_process(images: Path, cache: Path, store: Path, run: Path) -> dict[str, float]:
    """`index_build_s` in a process spawned for it, as rank 0 builds once per run. Builds repeated in one process
    measured the state earlier builds left it in, not a start-up: at 10⁷ captions, 2.8 µs a caption against 1.5 one
    build per process (2026-12-05, docs/development.md)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(index_build_s, images, cache, store, run).result()


def worker_probe(images: Path, cache: Path, store: Path, batches: int, run: Path) -> Any:
    """The training dataset of the saved run index, wrapped to report from its DataLoader worker."""
    from train.config import TrainConfig
    from train.data import StepBatches
    from train.data_index import TrainIndex

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
    index = TrainIndex.load(run / "index.parquet")
    return _probe_class()(StepBatches(index, np.arange(len(index)), cfg, (4, 4)), batches)


def worker_run(probe: Any) -> dict[str, float]:
    """One DataLoader worker over `probe`: its start and first batch (seconds), and its state after the last."""
    import torch

    loader = torch.utils.data.DataLoader(probe, batch_size=None, num_workers=1, prefetch_factor=2)
    tick = time.monotonic()
    it = iter(loader)
    first = next(it)
    last = list(it)[-1] if len(probe) > 1 else first
    return {**last, "open_s": first["done"] - tick, "start_s": first["started"] - tick}


def summary(
    probe: Any, first: float, builds: list[dict[str, float]], workers: list[dict[str, float]], fixed: tuple[int, float]
) -> dict[str, Any]:
    index = probe.data.index
    spans = index.caption_spans
    columns = index.caption_offsets.nbytes + sum(a.nbytes for a in (spans.segment, spans.start, spans.length))
    n = int(index.caption_offsets[-1])

    def median(key: str) -> float:
        return statistics.median(w[key] for w in workers)

    build, listing, user, system, peak = (
        statistics.median(b[k] for b in builds) for k in ("s", "listing_s", "user_s", "system_s", "peak_mb")
    )

    return {
        "captions": n,
        "segments": len(index.segments),
        "images": len(index),
        "index_build_s": round(build, 4),
        "index_build_us_per_caption": round(1e6 * build / n, 3),
        # less the cost of a build in a fresh process that does not grow with the run (a run of `fixed[0]` captions
        # takes `fixed[1]` s): what each further caption costs
        "index_build_marginal_us_per_caption": round(1e6 * (build - fixed[1]) / (n - fixed[0]), 3),
        "listing_us_per_image": round(1e6 * listing / len(index), 3),  # of the build: list_images, remembered
        "join_us_per_caption": round(1e6 * (build - listing) / n, 3),  # the rest: cache, store, join, save
        "first_listing_us_per_image": round(1e6 * first / len(index), 3),  # nothing remembered: tarfile; once
        "first_index_build_us_per_caption": round(1e6 * (build - listing + first) / n, 3),  # a first run's
        "index_build_user_cpu_us_per_caption": round(1e6 * user / n, 3),  # every thread's CPU time, in user space
        "index_build_system_cpu_us_per_caption": round(1e6 * system / n, 3),  # and in the kernel
        "index_build_peak_mb": round(peak, 1),  # resident memory the build added at its peak
        "index_build_peak_bytes_per_caption": round(peak * 2**20 / n, 1),
        "worker_open_s": round(median("open_s"), 4),
        "worker_open_us_per_caption": round(1e6 * median("open_s") / n, 3),
        "worker_start_s": round(median("start_s"), 4),  # of worker_open_s: the process's start, until the dataset
        "worker_first_batch_s": round(median("open_s") - median("start_s"), 4),  # is asked, then its first batch
        "worker_rss_mb": round(median("rss_mb"), 1),
        "worker_private_mb": round(median("private_mb"), 1),
        "open_files": int(max(w["open_files"] for w in workers)),
        "open_store_files": int(max(w["open_store_files"] for w in workers)),
        "index_columns_mb": round(columns / 2**20, 3),
        "batches": len(probe),
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
    ap.add_argument("--shard-images", type=int, default=1000, help="images per tar shard (0: one PNG file per image)")
    ap.add_argument("--batches", type=int, default=300, help="batches a worker reads before its memory is taken")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cheap-repeats", type=int, default=5, help="builds of the smaller and the tiny run per build of the larger"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TCJEPA_CACHE_DIR"] = str(Path(tmp) / "tcjepa-cache")  # remembered listings: not in the user's
        # A run 1/100 the smaller one's size: its build is mostly what a build in a fresh process costs whatever
        # the size (first uses of Arrow, Parquet and thread pools), so that each size's per-caption figure can be
        # read with and without it.
        tiny_root = Path(tmp) / "tiny"
        (tiny_root / "run").mkdir(parents=True)
        tiny_captions = max(CAPTIONS_PER_IMAGE, args.captions // 100)
        shape = (args.dim, args.tokens_per_caption, args.seed, args.shard_images)
        tiny = (*build_run(tiny_root, tiny_captions, 1, *shape), tiny_root)
        first_listing_s(tiny[0])
        sizes, made, firsts = [], [], []
        for factor in (1, args.scale):
            root = Path(tmp) / f"x{factor}"
            (root / "run").mkdir(parents=True)
            tick = time.perf_counter()
            captions, segments = args.captions * factor, args.segments * factor
            run = build_run(root, captions, segments, args.dim, args.tokens_per_caption, args.seed, args.shard_images)
            sizes.append((*run, root))
            made.append(time.perf_counter() - tick)
            firsts.append(first_listing_s(run[0]))  # once: ~1 minute at 10⁷ captions
            index_build_in_own_process(*sizes[-1][:3], sizes[-1][3] / "run")  # warms the page cache; not counted
        # The sizes take turns, so that whatever else the machine does weighs on both alike.
        # The smaller and the tiny runs' builds, a few tenths of a second each and mostly the fixed cost, are
        # repeated `--cheap-repeats` times as often: the smaller run's marginal time is their difference, so their noise
        # is its noise.
        builds: list[list[dict[str, float]]] = [[], [], []]
        for _ in range(args.repeats):
            for k, (images, cache, store, root) in enumerate([*sizes, tiny]):
                for _ in range(1 if k == 1 else args.cheap_repeats):
                    builds[k].append(index_build_in_own_process(images, cache, store, root / "run"))
        fixed = (tiny_captions, statistics.median(b["s"] for b in builds[2]))
        probes = [
            worker_probe(images, cache, store, args.batches, root / "run") for images, cache, store, root in sizes
        ]
        workers: list[list[dict[str, float]]] = [[], []]
        for _ in range(args.repeats):
            for k, probe in enumerate(probes):
                workers[k].append(worker_run(probe))
        runs = [
            {**summary(probe, firsts[k], builds[k], workers[k], fixed), "synthesis_s": round(made[k], 1)}
            for k, probe in enumerate(probes)
        ]
        for run in runs:
            print(json.dumps(run), flush=True)
    small, large = runs
    print_result(
        {
            **large,
            "scale": args.scale,
            "dim": args.dim,
            "tokens_per_caption": args.tokens_per_caption,
            "smaller": small,
            "shard_images": args.shard_images,
            "index_build_per_caption_ratio": round(
                large["index_build_us_per_caption"] / small["index_build_us_per_caption"], 3
            ),
            "index_build_marginal_ratio": round(
                large["index_build_marginal_us_per_caption"] / small["index_build_marginal_us_per_caption"], 3
            ),
            "fixed_build_s": round(fixed[1], 4),
            "fixed_build_s_range": [round(min(b["s"] for b in builds[2]), 4), round(max(b["s"] for b in builds[2]), 4)],
            "fixed_build_captions": fixed[0],
            "index_build_user_cpu_ratio": round(
                large["index_build_user_cpu_us_per_caption"] / small["index_build_user_cpu_us_per_caption"], 3
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
