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


def test_embed_on_ray_equals_the_local_executor_and_survives_a_killed_worker(tmp_path, annotated_cache, annotated_store, tiny_models):
    store = tmp_path / "store"
    args = ["embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", "--chunk-tokens", "64",
            "--shard-chunks", "4", "--window", "4", "--executor", "ray", "--num-workers", "2", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *map(str, args)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
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
            np.testing.assert_allclose(got.get_key(key.tobytes()).astype(np.float32), want.get_key(key.tobytes()).astype(np.float32),
                                       atol=0.02, rtol=0.02)
    again = tcjepa(*args)
    assert "320 already stored; encoded 0 captions" in again.stdout, "a rerun over a finished store does no work"
