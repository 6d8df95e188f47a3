"""`--executor ray`: a local Ray instance (2 CPUs, no GPU) started by the command itself, with the tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil

from captioning.cache import CaptionCache
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore
from tests.conftest import REPO, tcjepa


def _segments(store) -> int:
    try:
        return len(json.loads((store / "zarr.json").read_text())["attributes"]["tcjepa"]["segments"])
    except (OSError, ValueError, KeyError):
        return 0


def _workers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "SegmentPerBatch" in " ".join(p.info["cmdline"] or [])]


def test_embed_on_ray_equals_the_local_executor_and_survives_a_killed_worker(
    tmp_path, annotated_cache, annotated_store, tiny_models
):
    store = tmp_path / "store"
    args = [
        "embed",
        "--cache",
        annotated_cache,
        "--store",
        store,
        "--model",
        tiny_models / "t5",
        "--chunk-tokens",
        "64",
        "--shard-chunks",
        "4",
        "--window",
        "4",
        "--executor",
        "ray",
        "--ray-actors",
        "2",
        "--no-progress",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        workers = _workers()
        if workers and _segments(store) >= 2:
            killed = _segments(store)
            workers[0].send_signal(signal.SIGKILL)  # one T5 actor dies mid-run; Ray restarts it and retries its batch
        time.sleep(0.05)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert killed is not None and killed < 80, f"the worker was not killed mid-run ({killed} of 80 segments published)"
    assert tcjepa("store", "verify", store, "--no-progress").stdout.startswith("ok: ")
    got, want = EmbeddingReader(store), EmbeddingReader(annotated_store)
    assert len(got) == len(want) == 320, "nothing lost, nothing twice"
    for segment in want.segment_ids:
        for key in EmbeddingStore(annotated_store).read_keys(segment):
            np.testing.assert_allclose(
                got.get_key(key.tobytes()).astype(np.float32),
                want.get_key(key.tobytes()).astype(np.float32),
                atol=0.02,
                rtol=0.02,
            )
    again = tcjepa(*args)
    assert "320 already stored; encoded 0 captions" in again.stdout, "a rerun over a finished store does no work"


def test_caption_on_ray_writes_the_cache_the_local_executor_writes_though_its_actor_dies(
    tmp_path, synth_dir, tiny_models, vllm_engine
):
    """Ray tasks read and decode, one engine actor captions and commits, and is SIGKILLed once it has committed
    twice; Ray restarts it and retries its batch. The cache: the same recipe, keys, texts and failures as local."""
    from captioning.job import run_caption
    from tests.test_caption import VLLM_CLI, _cfg, _rows
    from tests.test_sources_images import bad_image_catalogue

    images = tmp_path / "images"
    images.mkdir()
    for source in sorted((synth_dir / "images").glob("*.png"))[:12]:
        (images / source.name).write_bytes(source.read_bytes())
    for name, (data, failure) in bad_image_catalogue(tmp_path).items():
        if name in ("truncated.png", "zero.png", "pixel.png"):
            assert failure is not None
            (images / name).write_bytes(data)
    run_caption(_cfg([images], tmp_path / "local", tiny_models), engine=vllm_engine)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    one_per_batch = [
        *VLLM_CLI[: VLLM_CLI.index("--chunk-images")],
        *VLLM_CLI[VLLM_CLI.index("--chunk-images") + 2 :],
        "--chunk-images",
        "1",
    ]
    args = [
        "caption",
        images,
        "--cache",
        tmp_path / "ray",
        "--model",
        tiny_models / "vlm",
        *one_per_batch,
        "--executor",
        "ray",
        "--ray-actors",
        "1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    shards, killed = tmp_path / "ray" / "manifests", None
    deadline = time.monotonic() + 300
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        committed = len(list(shards.glob("*.json"))) if shards.is_dir() else 0
        actors = [p for p in psutil.process_iter(["cmdline"]) if "CaptionActor" in " ".join(p.info["cmdline"] or [])]
        if actors and committed >= 2:
            killed = committed
            actors[0].send_signal(signal.SIGKILL)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert killed is not None and killed < 15, f"the actor was not killed mid-run ({killed} of 15 batches committed)"
    assert "captioned 12 images (96 captions)" in out and "3 failed" in out, out
    local, ray_rows = _rows(tmp_path / "local"), _rows(tmp_path / "ray")
    assert sorted(map(sorted, (r.items() for r in ray_rows))) == sorted(map(sorted, (r.items() for r in local)))
    local_failures = CaptionCache(tmp_path / "local").read_failures().sort_by("source_id").to_pylist()
    assert CaptionCache(tmp_path / "ray").read_failures().sort_by("source_id").to_pylist() == local_failures
    again = tcjepa(
        "caption",
        images,
        "--cache",
        tmp_path / "ray",
        "--model",
        tiny_models / "vlm",
        *VLLM_CLI,
        "--executor",
        "ray",
        env=env,
    ).stdout
    assert "captioned 0 images" in again and "12 already cached" in again, again
