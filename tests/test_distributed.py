"""Many processes on the CPU (gloo, torchrun on loopback) against one: DDP, FSDP2 and HSDP give the one-process run
(the session's `exact_run`), and a sharded FSDP checkpoint resumes on another number of processes and serves `eval`
and `export`."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.commands import run_command, tcjepa, torchrun
from tests.support.processes import finish, start
from tests.support.training import EXACT_CLIP, EXACT_STEPS, assert_close_runs, metrics, train_args
from train.checkpoint import ENCODERS, LATEST, SHARDED, kept_encoder_steps, load_checkpoint, load_kept_encoders

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _args(synth_dir: Path, cache: Path, store: Path, run: Path, *extra: str) -> list:
    return train_args(synth_dir / "images", cache, store, run, *EXACT_STEPS, *extra)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_ddp_on_two_processes_equals_one(tmp_path, synth_dir, annotated_cache, annotated_store, exact_run, accum_steps):
    """DDP (gradients as bucket views, no buffer broadcast), with a static graph, or each rank's 4 rows in 2
    micro-batches and one all-reduce. The first with fresh workers (`torchrun -m pipeline`, as users run it): ranks
    whose string-hash seeds differ, as a forked worker's do not."""
    run = tmp_path / "ddp"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--accum-steps", str(accum_steps))
    run_command(torchrun(*args, fresh=accum_steps == 1), timeout=900)
    assert_close_runs(metrics(exact_run), metrics(run))
    assert (run / "checkpoint.pt").exists() and not (run / SHARDED).exists()


def test_the_runs_compared_clip_their_gradients_in_some_steps_and_not_in_others(exact_run):
    norms = [m["grad_norm"] for m in metrics(exact_run) if "grad_norm" in m]
    assert max(norms) > EXACT_CLIP > min(norms), norms


def _shard_sizes(run: Path) -> list[int]:
    latest = json.loads((run / SHARDED / LATEST).read_text())
    return sorted(p.stat().st_size for p in (run / SHARDED / latest["dir"]).glob("*.distcp"))


def test_fsdp_on_two_processes_with_checkpointed_blocks_equals_one(
    tmp_path, synth_dir, annotated_cache, annotated_store, exact_run
):
    """FSDP2 with activation checkpointing; each process writes its own half of the checkpoint, none the whole."""
    run = tmp_path / "fsdp"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--fsdp", "--checkpoint-activations")
    run_command(torchrun(*args), timeout=900)
    assert_close_runs(metrics(exact_run), metrics(run))
    assert not (run / "checkpoint.pt").exists()
    sizes = _shard_sizes(run)
    assert len(sizes) == 2 and 0.3 < sizes[0] / sum(sizes) <= 0.5, sizes
    _assert_kept_encoders_from_shards(run, exact_run)


def _assert_same_encoders(a: dict, b: dict) -> None:
    for encoder in ENCODERS:
        assert sorted(a[encoder]) == sorted(b[encoder])
        for key, tensor in b[encoder].items():
            torch.testing.assert_close(a[encoder][key], tensor, rtol=1e-3, atol=1e-5, msg=f"{encoder} {key}")


def _assert_kept_encoders_from_shards(run: Path, exact_run: Path) -> None:
    """An FSDP run (`checkpoint_every=2`, 8 steps) kept steps 6 and 8 as the one-process run did: step 6's encoders
    read from its shards alone, and the last step's also gathered into safetensors, equal to its shards."""
    assert kept_encoder_steps(run) == kept_encoder_steps(exact_run) == [6, 8]
    assert not (run / "checkpoints" / "step-00000006.target_encoder.safetensors").exists(), "gathered at the last only"
    _assert_same_encoders(load_kept_encoders(run, 6), load_kept_encoders(exact_run, 6))
    with safe_open(str(run / "target_encoder.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "8", "the last save writes the encoders as safetensors"
    gathered = load_kept_encoders(run, 8)
    shutil.rmtree(run / "checkpoints")  # step 8's encoders from its shards now
    _assert_same_encoders(load_kept_encoders(run, 8), gathered)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hsdp_on_two_nodes_of_two_equals_one(tmp_path, synth_dir, annotated_cache, annotated_store, exact_run):
    """Two torchrun agents on loopback, as two nodes of two processes: a 2×2 mesh, sharded within a node and
    replicated across the two; each rank's 2 rows in 2 micro-batches (the all-reduce across nodes deferred)."""
    run = tmp_path / "hsdp"
    args = _args(
        synth_dir, annotated_cache, annotated_store, run, "--fsdp", "--shard-within-node", "--accum-steps", "2"
    )
    port = _free_port()
    agents = [
        start(
            torchrun(
                *args,
                launch=("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2")
                + ("--master-addr", "127.0.0.1", "--master-port", str(port)),
            )
        )
        for node in (0, 1)
    ]
    finish(agents, timeout=900)
    assert_close_runs(metrics(exact_run), metrics(run))
    assert len(_shard_sizes(run)) == 4  # every process wrote its shards (replicas dedup: some may be empty)


def test_a_sharded_checkpoint_resumes_on_one_process_and_serves_eval_and_export(
    tmp_path, synth_dir, annotated_cache, annotated_store, exact_run
):
    """Stopped under torchrun (2 processes, FSDP) after a checkpoint, the run continues on 1 process as if it had never
    stopped; `eval` and `export` read its target encoder from the shards."""
    run = tmp_path / "moved"
    args = _args(synth_dir, annotated_cache, annotated_store, run, "--fsdp")
    # torchrun ends its workers (each in its own session) when it is told to stop.
    proc = start(torchrun(*args), quiet=True)
    deadline = time.monotonic() + 600
    while not (run / SHARDED / LATEST).exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    stopped_at = json.loads((run / SHARDED / LATEST).read_text())["step"]
    assert stopped_at < 8
    assert not (run / "target_encoder.safetensors").exists(), "no sharded save but the last gathers the encoders"
    tcjepa(*args)
    assert_close_runs(metrics(exact_run), metrics(run))
    _assert_kept_encoders_from_shards(run, exact_run)

    state = load_checkpoint(run)
    reference = load_checkpoint(exact_run)
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
