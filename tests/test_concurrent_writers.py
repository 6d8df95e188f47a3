"""Four `tcjepa` processes at once on one cache or one store, with fully overlapping inputs: nothing lost, nothing
twice."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from embedding_cache.reader import EmbeddingReader
from tests.conftest import REPO, tcjepa

WRITERS = 4


def _start(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    return outs


def test_four_annotation_imports_at_once(tmp_path, synth_dir):
    cache = tmp_path / "cache"
    rows = [json.loads(line) for line in (synth_dir / "captions.jsonl").read_text().splitlines()]
    # one file, imported by four processes (one recipe), and halves of it in another order, by four more (another
    # recipe each)
    files = [synth_dir / "captions.jsonl"] * WRITERS
    for k in range(WRITERS):
        part = tmp_path / f"part{k}.jsonl"
        part.write_text(
            "".join(json.dumps({**r, "image": str(synth_dir / r["image"])}) + "\n" for r in rows[::-1][k % 2 :: 2])
        )
        files.append(part)
    _finish([_start("caption", "--cache", cache, "--annotations", f) for f in files])
    info = json.loads(tcjepa("cache", "info", cache, "--json").stdout)
    per_recipe = sorted(r["captions"] for r in info["recipes"])
    assert per_recipe == [160, 160, 320], per_recipe  # parts 0 and 2 (and 1 and 3) are the same file: the same recipe
    assert tcjepa("cache", "verify", cache, "--no-progress").stdout.startswith("ok: 3 recipes")


def test_four_embed_processes_at_once(tmp_path, annotated_cache, annotated_store, tiny_models):
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
        "16",
        "--segment-mb",
        "0.02",
        "--no-progress",
    ]
    outs = _finish([_start(*args) for _ in range(WRITERS)])
    assert sum(int(o.split("; encoded ")[1].split(" captions")[0]) for o in outs) == 320, outs
    assert tcjepa("store", "verify", store, "--no-progress").stdout.startswith("ok: ")
    got, want = EmbeddingReader(store), EmbeddingReader(annotated_store)
    assert len(got) == len(want) == 320
    for seg in want.segment_ids:
        keys = zarr_keys(annotated_store, seg)
        for key in keys:
            np.testing.assert_allclose(
                got.get_key(key).astype(np.float32), want.get_key(key).astype(np.float32), atol=0.02, rtol=0.02
            )


def zarr_keys(store, segment: str) -> list[bytes]:
    from embedding_cache.store import EmbeddingStore

    return [k.tobytes() for k in EmbeddingStore(store).read_keys(segment)]
