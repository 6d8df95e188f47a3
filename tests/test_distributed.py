"""Many processes on the CPU (gloo, torchrun on loopback) against one: DDP, FSDP2 and HSDP give the one-process run,
and a sharded FSDP checkpoint resumes on another number of processes and serves `eval` and `export`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_TRAIN, tcjepa
from train.checkpoint import LATEST, SHARDED, load_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
# fp32, so that runs on different numbers of processes agree to rounding.
EXACT = ["--steps", "8", "--set", "log_every=1", "--set", "val_every=4", "--set", "checkpoint_every=2"]
EXACT += ["--set", "bf16=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
KEYS = ("loss", "loss_predict", "loss_sparse", "loss_consistency", "val_loss_predict", "val_loss_predict_shuffled")


def _args(synth_dir: Path, cache: Path, store: Path, run: Path, *extra: str) -> list[str]:
    return [str(a) for a in ("train", synth_dir / "images", "--cache", cache, "--store", store, "--out", run)] + [
        *TINY_TRAIN,
        *EXACT,
        *extra,
    ]


def _torchrun(launch: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "pipeline", *args]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(got: Path, want: Path) -> None:
    a, b = _metrics(got), _metrics(want)
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in KEYS:
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (x["step"], key, x[key], y[key])


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, synth_dir, annotated_cache, annotated_store) -> Path:
    run = tmp_path_factory.mktemp("distributed") / "one"
    tcjepa(*_args(synth_dir, annotated_cache, annotated_store, run), env=ENV)
    return run


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_ddp_on_two_processes_equals_one(
    tmp_path, synth_dir, annotated_cache, annotated_store, one_process, accum_steps
):
    """DDP (gradients as bucket views, no buffer broadcast), with a static graph, or each rank's 4 rows in 2
    micro-batches and one all-reduce."""
    run = tmp_path / "ddp"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--accum-steps", str(accum_steps))
    _run(_torchrun(["--standalone", "--nproc-per-node", "2"], args))
    _assert_same_run(run, one_process)
    assert (run / "checkpoint.pt").exists() and not (run / SHARDED).exists()


def _shard_sizes(run: Path) -> list[int]:
    latest = json.loads((run / SHARDED / LATEST).read_text())
    return sorted(p.stat().st_size for p in (run / SHARDED / latest["dir"]).glob("*.distcp"))


def test_fsdp_on_two_processes_with_checkpointed_blocks_equals_one(
    tmp_path, synth_dir, annotated_cache, annotated_store, one_process
):
    """FSDP2 with activation checkpointing; each process writes its own half of the checkpoint, none the whole."""
    run = tmp_path / "fsdp"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--fsdp", "--checkpoint-activations")
    _run(_torchrun(["--standalone", "--nproc-per-node", "2"], args))
    _assert_same_run(run, one_process)
    assert not (run / "checkpoint.pt").exists()
    sizes = _shard_sizes(run)
    assert len(sizes) == 2 and 0.3 < sizes[0] / sum(sizes) <= 0.5, sizes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hsdp_on_two_nodes_of_two_equals_one(tmp_path, synth_dir, annotated_cache, annotated_store, one_process):
    """Two torchrun agents on loopback, as two nodes of two processes: a 2×2 mesh, sharded within a node and
    replicated across the two; each rank's 2 rows in 2 micro-batches (the all-reduce across nodes deferred)."""
    run = tmp_path / "hsdp"
    args = _args(
        synth_dir, annotated_cache, annotated_store, run, "--fsdp", "--shard-within-node", "--accum-steps", "2"
    )
    port = _free_port()
    agents = [
        subprocess.Popen(
            _torchrun(
                ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"]
                + ["--master-addr", "127.0.0.1", "--master-port", str(port)],
                args,
            ),
            cwd=REPO,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    errors = [agent.communicate(timeout=900)[1] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(e[-3000:] for e in errors)
    _assert_same_run(run, one_process)
    assert len(_shard_sizes(run)) == 4  # every process wrote its shards (replicas dedup: some may be empty)


def test_a_sharded_checkpoint_resumes_on_one_process_and_serves_eval_and_export(
    tmp_path, synth_dir, annotated_cache, annotated_store, one_process
):
    """Stopped under torchrun (2 processes, FSDP) after a checkpoint, the run continues on 1 process as if it had never
    stopped; `eval` and `export` read its target encoder from the shards."""
    run = tmp_path / "moved"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--fsdp")
    # torchrun ends its workers (each in its own session) when it is told to stop.
    proc = subprocess.Popen(
        _torchrun(["--standalone", "--nproc-per-node", "2"], args),
        cwd=REPO,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while not (run / SHARDED / LATEST).exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    stopped_at = json.loads((run / SHARDED / LATEST).read_text())["step"]
    assert stopped_at < 8
    tcjepa(*_args(synth_dir, annotated_cache, annotated_store, run, "--fsdp"), env=ENV)
    _assert_same_run(run, one_process)

    state = load_checkpoint(run)
    reference = load_checkpoint(one_process)
    assert state["step"] == 8 and list(state["target"]) == list(reference["target"])
    for name, tensor in state["target"].items():
        assert tensor.shape == reference["target"][name].shape, name
    exported = tcjepa("export", run, "--out", tmp_path / "export")
    assert json.loads(exported.stdout)["step"] == 8
    evaluated = tcjepa(
        "eval",
        run,
        synth_dir / "images",
        "--labels",
        synth_dir / "labels.jsonl",
        "--probe",
        "linear",
        "--num-workers",
        "0",
        "--no-progress",
    )
    assert evaluated.stdout.strip().splitlines()[-1].startswith("step 8 | linear top1")
