"""Kill/resume cycles per stage: time lost per kill, and rows lost or duplicated (must be 0).

For each stage — `caption` (tiny Qwen2-VL through vLLM), `embed` (tiny T5) and
`train` (tiny ViT, `cross`) — one uninterrupted CLI run is the reference. Then the
same command is started, SIGKILLed with its whole process group (vLLM's engine
runs in child processes) at a random moment after it has published something,
`--kills` times, and finally run to the end. Time lost per kill = (wall time of all
attempts − the reference's) / kills: work redone plus start-up again. Rows are
compared with the reference: lost, duplicated, or different (captions are seeded,
so a resumed cache must hold the same texts; store vectors, computed in float32,
must match within float16 rounding; resumed training metrics must be equal). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT, print_result  # first: sets the offline environment


def cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "pipeline", *map(str, args)]


def timed_run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:5])} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def kill_cycles(
    cmd: list[str], progress: Callable[[], int], kills: int, max_delay: float, rng: random.Random
) -> dict[str, Any]:
    """Start, wait for new published work, wait a random moment more, SIGKILL the group; `kills` times, then finish."""
    total, done = 0.0, 0
    for _ in range(kills):
        before = progress()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        while progress() <= before and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, max_delay))
        if proc.poll() is not None:  # finished before the kill: nothing left to interrupt
            total += time.perf_counter() - t0
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        total += time.perf_counter() - t0
        done += 1
    total += timed_run(cmd)
    return {"kills": done, "total_s": total}


def caption_rows(cache: Path) -> list[tuple]:
    from captioning.cache import CaptionCache

    table = CaptionCache(cache).read_captions(columns=["image_sha256", "prompt_id", "sample", "text"])
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names)))


def compare_captions(reference: Path, resumed: Path) -> dict[str, int]:
    want, got = caption_rows(reference), caption_rows(resumed)
    want_keys = {r[:3]: r[3] for r in want}
    got_keys: dict[tuple, str] = {}
    for r in got:
        got_keys.setdefault(r[:3], r[3])
    return {
        "rows": len(got),
        "rows_lost": len(set(want_keys) - set(got_keys)),
        "rows_duplicated": len(got) - len(got_keys),
        "rows_extra": len(set(got_keys) - set(want_keys)),
        "rows_differing": sum(got_keys[k] != v for k, v in want_keys.items() if k in got_keys),
    }


def store_rows(path: Path) -> tuple[dict[bytes, np.ndarray], int]:
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.store import EmbeddingStore

    store, reader = EmbeddingStore(path), EmbeddingReader(path)
    keys = [k.tobytes() for seg in store.segment_ids() for k in store.read_keys(seg)]
    return {k: reader.get_key(k) for k in keys}, len(keys)


def compare_stores(reference: Path, resumed: Path) -> dict[str, int]:
    want, _ = store_rows(reference)
    got, n = store_rows(resumed)
    # float32 compute: other batch compositions change a value by at most a float16 rounding step
    differing = sum(
        not np.allclose(got[k].astype(np.float32), v.astype(np.float32), atol=2e-3, rtol=2e-3)
        for k, v in want.items()
        if k in got
    )
    return {
        "rows": n,
        "rows_lost": len(set(want) - set(got)),
        "rows_duplicated": n - len(got),
        "rows_extra": len(set(got) - set(want)),
        "rows_differing": differing,
    }


def compare_metrics(reference: Path, resumed: Path) -> dict[str, int]:
    def lines(run: Path) -> list[dict]:
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    want, got = lines(reference), lines(resumed)
    keys = ("loss", "loss_predict", "loss_sparse", "loss_consistency", "val_loss_predict", "val_loss_predict_shuffled")
    return {
        "rows": len(got),
        "rows_lost": max(len(want) - len(got), 0),
        "rows_duplicated": max(len(got) - len(want), 0),
        "rows_differing": sum(any(a.get(k) != b.get(k) for k in (*keys, "step")) for a, b in zip(want, got)),
    }


def stage(
    name: str,
    make_cmd: Callable[[Path], list[str]],
    progress_of: Callable[[Path], Callable[[], int]],
    compare: Callable[[Path, Path], dict[str, int]],
    tmp: Path,
    kills: int,
    max_delay: float,
    rng: random.Random,
) -> dict[str, Any]:
    print(f"[faults] {name}: reference run", file=sys.stderr)
    reference_s = timed_run(make_cmd(tmp / f"{name}-reference"))
    print(f"[faults] {name}: {kills} kills, then to the end", file=sys.stderr)
    killed = tmp / f"{name}-killed"
    cycles = kill_cycles(make_cmd(killed), progress_of(killed), kills, max_delay, rng)
    lost = cycles["total_s"] - reference_s
    return {
        "reference_s": round(reference_s, 2),
        "with_kills_s": round(cycles["total_s"], 2),
        "kills": cycles["kills"],
        "lost_s_per_kill": round(lost / max(cycles["kills"], 1), 2),
        **compare(tmp / f"{name}-reference", killed),
    }


def count_files(folder: Path, pattern: str) -> Callable[[], int]:
    return lambda: len(list(folder.glob(pattern))) if folder.is_dir() else 0


def checkpoint_mtime(run: Path) -> Callable[[], int]:
    return lambda: (run / "checkpoint.pt").stat().st_mtime_ns if (run / "checkpoint.pt").exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs per stage before the final run")
    ap.add_argument("--caption-images", type=int, default=96, help="images captioned through vLLM")
    ap.add_argument("--embed-scenes", type=int, default=600, help="synthetic scenes whose 8 captions each are embedded")
    ap.add_argument("--train-steps", type=int, default=60, help="steps of the training stage (checkpoint every 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--stages", default="caption,embed,train", help="comma-separated subset of caption,embed,train")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    stages = args.stages.split(",")

    from pipeline.devkit.dataset import generate
    from pipeline.devkit.tiny_models import build_tiny_models

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        generate(tmp / "data", max(args.embed_scenes, args.caption_images), seed=1)
        build_tiny_models(tmp / "models")
        images = sorted((tmp / "data" / "images").glob("*.png"))
        (tmp / "few").mkdir()
        for p in images[: args.caption_images]:
            (tmp / "few" / p.name).symlink_to(p)
        if "caption" in stages:
            results["caption"] = stage(
                "caption",
                lambda cache: cli(
                    "caption",
                    tmp / "few",
                    "--cache",
                    cache,
                    "--model",
                    tmp / "models" / "vlm",
                    "--vllm-arg",
                    "max_model_len=1024",
                    "--max-tokens",
                    "16",
                    "--chunk-images",
                    "8",
                    "--decode-workers",
                    "1",
                ),
                lambda cache: count_files(cache / "manifests", "*.json"),
                compare_captions,
                tmp,
                args.kills,
                1.5,
                rng,
            )
        if "embed" in stages or "train" in stages:
            timed_run(cli("caption", "--cache", tmp / "cache", "--annotations", tmp / "data" / "captions.jsonl"))
        if "embed" in stages:
            results["embed"] = stage(
                "embed",
                lambda store: cli(
                    "embed",
                    "--cache",
                    tmp / "cache",
                    "--store",
                    store,
                    "--model",
                    tmp / "models" / "t5",
                    "--segment-mb",
                    "0.5",
                    "--window",
                    "256",
                    "--dtype",
                    "float32",
                    "--no-progress",
                ),
                lambda store: count_files(store / "segments", "*/zarr.json"),
                compare_stores,
                tmp,
                args.kills,
                1.0,
                rng,
            )
        if "train" in stages:
            timed_run(
                cli(
                    "embed",
                    "--cache",
                    tmp / "cache",
                    "--store",
                    tmp / "store",
                    "--model",
                    tmp / "models" / "t5",
                    "--no-progress",
                )
            )
            results["train"] = stage(
                "train",
                lambda run: cli(
                    "train",
                    tmp / "data" / "images",
                    "--cache",
                    tmp / "cache",
                    "--store",
                    tmp / "store",
                    "--out",
                    run,
                    "--model",
                    "vit_tiny",
                    "--patch-size",
                    "16",
                    "--image-size",
                    "64",
                    "--batch-size",
                    "32",
                    "--steps",
                    args.train_steps,
                    "--captions-per-image",
                    "4",
                    "--no-progress",
                    "--set",
                    "depth=4",
                    "--set",
                    "predictor_depth=2",
                    "--set",
                    "num_workers=1",
                    "--set",
                    "min_context=2",
                    "--set",
                    "checkpoint_every=10",
                    "--set",
                    "val_every=10",
                    "--set",
                    "log_every=5",
                ),
                checkpoint_mtime,
                compare_metrics,
                tmp,
                args.kills,
                2.0,
                rng,
            )
    bad = sum(
        r["rows_lost"] + r["rows_duplicated"] + r["rows_differing"] + r.get("rows_extra", 0) for r in results.values()
    )
    print_result({"benchmark": "faults", **results, "rows_lost_duplicated_or_differing": bad})


if __name__ == "__main__":
    main()
