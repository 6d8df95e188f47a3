"""`--executor ray`: a local Ray instance (2 CPUs, no GPU) started by the command itself, with the tiny models.

Each test kills one actor of the run it started (found among that run's own processes) once the run has published
some of its work; Ray restarts the actor and retries its batch.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from captioning.cache import CaptionCache
from captioning.job import run_caption
from tests.support.captions import VLLM_CLI, caption_config, caption_rows
from tests.support.commands import start_tcjepa, tcjepa
from tests.support.images import bad_image_catalogue
from tests.support.processes import descendants, finish
from tests.support.stores import assert_same_embeddings

pytestmark = [pytest.mark.ray, pytest.mark.slow]
WITHOUT_RAY_ADDRESS = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _segments(store) -> int:
    try:
        return len(json.loads((store / "zarr.json").read_text())["attributes"]["tcjepa"]["segments"])
    except (OSError, ValueError, KeyError):
        return 0


def _kill_one_actor_once(proc, actor: str, published, before_kill=lambda: None) -> int | None:
    """SIGKILL one process of `proc`'s own whose command line names `actor`, once `published()` >= 2 (after calling
    `before_kill`); then wait for the run to end. What had been published when it was killed."""
    import time

    killed, deadline = None, time.monotonic() + 300
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        actors = descendants(proc, actor)
        if actors and published() >= 2:
            before_kill()
            killed = published()
            actors[0].send_signal(signal.SIGKILL)
        time.sleep(0.02)
    return killed


def test_embed_on_ray_equals_the_local_executor_and_survives_a_killed_worker(
    tmp_path, annotated_cache, annotated_store, tiny_models
):
    store = tmp_path / "store"
    args = ["embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5"]
    args += ["--chunk-tokens", "64", "--shard-chunks", "4", "--window", "4", "--executor", "ray", "--ray-actors", "2"]
    proc = start_tcjepa(*args, "--no-progress", env=WITHOUT_RAY_ADDRESS)
    # One T5 actor dies mid-run; Ray restarts it and retries its batch.
    killed = _kill_one_actor_once(proc, "SegmentPerBatch", lambda: _segments(store))
    finish([proc])
    assert killed is not None and killed < 80, f"the worker was not killed mid-run ({killed} of 80 segments published)"
    assert tcjepa("store", "verify", store, "--no-progress").stdout.startswith("ok: ")
    assert_same_embeddings(store, annotated_store)  # nothing lost, nothing twice
    again = tcjepa(*args, "--no-progress", env=WITHOUT_RAY_ADDRESS)
    assert "320 already stored; encoded 0 captions" in again.stdout, "a rerun over a finished store does no work"


@pytest.mark.vllm
def test_caption_on_ray_writes_the_cache_the_local_executor_writes_though_its_actor_dies(
    tmp_path, synth_dir, tiny_models, vllm_engine
):
    """Ray tasks read and decode, one engine actor captions and commits, and is SIGKILLed once it has committed
    twice; Ray restarts it and retries its batch. Two images were captioned before (the same recipe, in process):
    Ray skips them. The cache: the same recipe, keys, texts and failures as the local executor's."""
    images = tmp_path / "images"
    images.mkdir()
    for source in sorted((synth_dir / "images").glob("*.png"))[:12]:
        (images / source.name).write_bytes(source.read_bytes())
    for name, (data, failure) in bad_image_catalogue().items():
        if name in ("truncated.png", "zero.png", "pixel.png"):
            assert failure is not None
            (images / name).write_bytes(data)
    run_caption(caption_config([images], tmp_path / "local", tiny_models), engine=vllm_engine)
    first_two = sorted(images.glob("0*.png"))[:2]
    run_caption(caption_config(first_two, tmp_path / "ray", tiny_models), engine=vllm_engine)
    before = len(list((tmp_path / "ray" / "manifests").glob("*.json")))
    one_per_batch = [*VLLM_CLI[: VLLM_CLI.index("--chunk-images")], *VLLM_CLI[VLLM_CLI.index("--chunk-images") + 2 :]]
    args = ["caption", images, "--cache", tmp_path / "ray", "--model", tiny_models / "vlm", *one_per_batch]
    proc = start_tcjepa(*args, "--chunk-images", "1", "--executor", "ray", "--ray-actors", "1", env=WITHOUT_RAY_ADDRESS)
    shards = tmp_path / "ray" / "manifests"
    # vLLM titles an engine core in a process of its own "VLLM::EngineCore": the actor runs its engine in itself
    own_engine_processes: list = []
    killed = _kill_one_actor_once(
        proc,
        "CaptionActor",
        lambda: len(list(shards.glob("*.json"))) - before,
        before_kill=lambda: own_engine_processes.extend(descendants(proc, "VLLM::EngineCore")),
    )
    ((out, _),) = finish([proc])
    assert not own_engine_processes, "the captioning actor's engine core ran in processes of its own"
    assert killed is not None and killed < 13, f"the actor was not killed mid-run ({killed} of 13 batches committed)"
    assert "captioned 10 images (80 captions), 2 already cached, 3 failed" in out, out
    local, ray_rows = caption_rows(tmp_path / "local"), caption_rows(tmp_path / "ray")
    assert sorted(map(sorted, (r.items() for r in ray_rows))) == sorted(map(sorted, (r.items() for r in local)))
    local_failures = CaptionCache(tmp_path / "local").read_failures().sort_by("source_id").to_pylist()
    assert CaptionCache(tmp_path / "ray").read_failures().sort_by("source_id").to_pylist() == local_failures
