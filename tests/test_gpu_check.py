"""`benchmarks/gpu_check.sh --dry-run`: the GPU check's whole path on the CPU, with the packages the GPU machine lacks
made unimportable."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import gpu_check
from tests.support.repo import REPO

# Installed as sitecustomize in every Python process of the check (the torchrun one too).
BLOCKER = """
import sys

class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zarr", "numcodecs", "datasets", "vllm"):
            raise ImportError(f"{name} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, _Missing())
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_the_gpu_check_dry_run_passes_with_torch_alone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
    }
    blocked = subprocess.run([sys.executable, "-c", "import zarr"], env=env, capture_output=True, text=True)
    assert "not installed on the GPU machine" in blocked.stderr  # the blocker is in force
    proc = subprocess.run(
        [str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "gpu_check.jsonl").read_text().splitlines()]
    assert proc.stdout.splitlines() == [json.dumps(r) for r in records]
    phases = [r["phase"] for r in records if r["check"] == "phase"]
    assert phases == list(gpu_check.PHASES)  # every phase, in order, each closed by its time
    assert records[0]["check"] == "environment" and records[-1] == {"check": "done", "ok": True}
    throughput = [r for r in records if r["check"] == "throughput"]
    assert [r["config"] for r in throughput] == [s.name for p in gpu_check.PHASES.values() for s in p.specs]
    for r in throughput:
        assert r["images_per_s"] > 0 and r["gflop_per_step"] > 0 and r["mfu"] is None  # no peak FLOPs on a CPU
        assert 0 < r["useful_over_padded_flops"] < r["useful_over_computed_flops"] < 1  # padding, packed in part
        assert r["mfu_useful"] is None and r["mfu_padded"] is None
        assert r["graph_breaks"] == 0 and r["recompiles_in_timed_steps"] == 0  # fresh masks every timed step
    by_name = {r["config"]: r for r in throughput}
    assert by_name["vit_b16_cross8_before_mlp_compiled_int8"]["codec"] == "int8"
    assert by_name["vit_b16_cross8_before_mlp_compiled_accum2"]["options"] == {"accum_steps": 2}
    jagged = by_name["vit_b16_cross8_before_mlp_compiled_jagged"]  # nested rows compile on CUDA only: eager here
    assert jagged["options"] == {"attention": "jagged"} and jagged["compiled"] is False
    inputs = [r for r in records if r["check"] == "input"]
    assert [r["decode"] for r in inputs] == ["cpu", "gpu"] and all(r["ok"] and r["images_per_s"] > 0 for r in inputs)
    (decode,) = [r for r in records if r["check"] == "device_decode"]
    assert decode["ok"] and decode["batch"] == decode["decoded"] == gpu_check.DRY.batch and decode["decode_ms"] > 0
    for way in ("per_image", "batched"):  # side by side
        assert 0 < decode[f"resize_{way}_queue_ms"] <= decode[f"resize_{way}_ms"]
        assert decode[f"resize_{way}_host_syncs"] is None  # counted on CUDA only
    # per image, a resize and the row's copy at least (views not counted); batched, a copy per image and a few in all
    assert decode["resize_per_image_operators_per_image"] >= 2 and decode["resize_batched_operators_per_image"] > 1
    (corrupt,) = [r for r in records if r["check"] == "input_corrupt"]
    assert (
        corrupt["ok"]
        and corrupt["images_replaced"] > 0
        and corrupt["corrupt_images"] == gpu_check.DRY.input_images // 2
    )
    none, cross = [r for r in records if r["check"] == "profile"]
    assert (none["config"], cross["config"]) == (gpu_check.NONE.name, gpu_check.CROSS.name)
    assert cross["ok"] and set(cross["ms_per_step"]) == set(gpu_check.PARTS)
    assert none["ok"] and set(none["ms_per_step"]) == set(gpu_check.PARTS) - set(gpu_check.TEXT_PARTS)
    for profile in (none, cross):
        assert all(v > 0 for v in profile["ms_per_step"].values())  # each label is reached in a step
        assert len(profile["top_ms_per_step"]) == 15 and all(v > 0 for v in profile["top_ms_per_step"].values())
        assert profile["attention_calls_per_step"] and all(v > 0 for v in profile["attention_calls_per_step"].values())
        backward = profile["backward_ms_per_step"]
        assert backward["context_encoder"] > 0 and backward["predictor"] > 0 and "target_encoder" not in backward
        labelled = profile["ms_per_step"]["backward"] + profile["ms_per_step"].get("regularisers_backward", 0)
        assert 0.7 < sum(backward.values()) / labelled < 1.3, (backward, labelled)  # the same backward, split
    assert cross["backward_ms_per_step"]["regularisers"] > 0 and "regularisers" not in none["backward_ms_per_step"]
    (regs,) = [r for r in records if r["check"] == "regularisers"]
    assert (
        regs["ok"]
        and regs["backend"] == "aot_eager"
        and set(regs["ms_per_image"])
        == {
            "reference_eager",
            "today_eager",
            "reference_compiled",
            "today_compiled",
        }
    )
    (smoke,) = [r for r in records if r["check"] == "smoke"]
    assert smoke["ok"] and smoke["loss_last"] < smoke["loss_first"] and smoke["steps"] == gpu_check.DRY.smoke_steps
    (torchrun,) = [r for r in records if r["check"] == "torchrun"]
    assert torchrun["ok"] and torchrun["backend"] == "gloo" and torchrun["fsdp_checkpoint_roundtrip"]
    assert torchrun["fsdp_checkpoint_published"] and torchrun["fsdp_checkpoint_resumed_step"] == 2
    assert torchrun["fsdp_gathered_encoders_match"], "the last save's safetensors hold what its shards hold"
    assert torchrun["grad_clip"] == 1 and min(torchrun["ddp_grad_norms"] + torchrun["fsdp_grad_norms"]) > 1
    assert torchrun["clipped_as_asked"], "every step's gradients clipped to norm 1, FSDP's sharded ones too"
    assert torchrun["fsdp_vs_ddp_loss_rel_diff"] <= 1e-3, "FSDP's steps are DDP's: one residual stream, one clipping"


def test_the_phases_are_listed_with_times_that_fit_a_device_call(capsys):
    assert gpu_check.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [*gpu_check.PHASES, "all"]
    assert all(phase.expected_s <= 240 for phase in gpu_check.PHASES.values())  # ≤ 4 minutes cold each
    assert gpu_check.parse_args(["--phase", "smoke", "torchrun"]).phase == ["smoke", "torchrun"]


def test_work_launched_from_another_thread_is_counted_apart_from_the_labels():
    """On CUDA autograd runs the backward on its own thread: the profile adds what that thread launched to `backward`.
    Profiler events as torch makes them, one thread holding the labels and another the backward's work."""
    from torch.autograd.profiler_util import FunctionEvent

    label = FunctionEvent(0, "backward", thread=1, start_us=0, end_us=10)
    own = FunctionEvent(1, "aten::mm", thread=1, start_us=10, end_us=2010)
    engine = FunctionEvent(2, "autograd::engine::evaluate_function: MmBackward0", thread=7, start_us=10, end_us=4010)
    inner = FunctionEvent(3, "aten::mm", thread=7, start_us=20, end_us=3020)
    inner.cpu_parent = engine  # held by its parent: counted once
    assert gpu_check.off_thread_ms([label, own, engine, inner], device=False) == 4.0
    assert gpu_check.off_thread_ms([label, own], device=False) == 0.0
    # A label inside the backward (the regularisers') runs on the engine's thread: it does not make it the labels'.
    regularisers = FunctionEvent(4, "regularisers_backward", thread=7, start_us=30, end_us=1030)
    regularisers.cpu_parent = engine
    assert gpu_check.off_thread_ms([label, own, engine, inner, regularisers], device=False) == 4.0


def test_the_backward_is_split_by_the_part_whose_forward_made_each_node():
    """A real profile: two labelled parts and an unlabelled loss, each node found in the part that made it. On the CPU
    the backward runs on the caller's thread (on CUDA on autograd's own, where the profiler follows it but a test
    thread's would not): its nodes are found by their forward operators' thread and number either way."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    wide, narrow = torch.nn.Linear(512, 512), torch.nn.Linear(512, 16)
    x = torch.randn(1024, 512)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("context_encoder"):
            h = wide(x).relu()
        with record_function("predictor"):
            y = narrow(h)
        (y**2).mean().backward()  # the loss has no label: its nodes are `other`
    nodes = gpu_check.backward_nodes(prof.events())
    names = {part: sorted(e.name.removeprefix(gpu_check.BACKWARD_NODE) for e in found) for part, found in nodes.items()}
    assert names["context_encoder"] == ["AddmmBackward0", "ReluBackward0", "TBackward0"], names
    assert names["predictor"] == ["AddmmBackward0", "TBackward0"], names
    assert {"MeanBackward0", "PowBackward0"} <= set(names["other"]), names
    assert set(names) == {"context_encoder", "predictor", "other"}
    split = gpu_check.backward_by_part(prof.events(), device=False)
    assert set(split) == set(names) and all(v > 0 for v in split.values()), split


def test_backward_nodes_are_matched_to_their_forward_by_its_thread_and_the_last_operator_to_take_the_number():
    """Events as torch's profiler makes them on CUDA: the forward on thread 1, the backward on autograd's thread 9. A
    node goes to the part whose forward operator took its number on the forward's thread (not on the node's own), and
    an unlabelled operator that takes a number after a labelled one that built no node owns the node."""
    from torch.autograd.profiler_util import FunctionEvent

    node = gpu_check.BACKWARD_NODE

    def event(i: int, name: str, thread: int, start: int, end: int, seq: int = -1, fwd: int | None = None) -> Any:
        return FunctionEvent(i, name, thread=thread, start_us=start, end_us=end, sequence_nr=seq, fwd_thread=fwd)

    label = event(0, "predictor", 1, 0, 100)
    mm = event(1, "aten::mm", 1, 10, 50, seq=7)
    view = event(2, "aten::view", 1, 60, 70, seq=8)  # builds no node: the number stays 8
    mm.cpu_parent = view.cpu_parent = label
    mean = event(3, "aten::mean", 1, 100, 110, seq=8)  # no label: builds node 8
    mm_node = event(4, f"{node}MmBackward0", 9, 200, 600, seq=7, fwd=1)
    mean_node = event(5, f"{node}MeanBackward0", 9, 150, 200, seq=8, fwd=1)
    own_thread = event(6, "aten::add", 9, 120, 140, seq=7)  # number 7 of thread 9, not the node's forward
    events = [label, mm, view, mean, own_thread, mean_node, mm_node]
    assert gpu_check.backward_by_part(events, device=False) == {"predictor": 0.4, "other": 0.05}


def test_a_phase_reports_each_measurement_as_it_finishes_and_goes_on_past_one_that_fails(tmp_path, monkeypatch):
    """A phase cut off by a device call's time limit keeps the lines it measured before (the H200's `variants` phase,
    stopped in its second spec, once left none); a measurement that fails (out of memory) is a line that says so, and
    the phase goes on."""
    checkpointed, accum2 = (spec.name for spec in gpu_check.PHASES["options"].specs)

    def out_of_memory_first(spec, shapes, device):
        if spec.name == checkpointed:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        raise AssertionError  # as a bare assert in the code gives: an error without a message

    monkeypatch.setattr(gpu_check, "throughput", out_of_memory_first)
    assert gpu_check.main(["--dry-run", "--phase", "options", "--out", str(tmp_path / "failed")]) == 1
    records = [json.loads(line) for line in (tmp_path / "failed" / "gpu_check.jsonl").read_text().splitlines()]
    assert [r for r in records if r["check"] == "throughput"] == [
        {
            "check": "throughput",
            "config": checkpointed,
            "ok": False,
            "error": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
        },
        {"check": "throughput", "config": accum2, "ok": False, "error": "AssertionError"},
    ]

    def cut_off_second(spec, shapes, device):
        if spec.name == accum2:
            raise KeyboardInterrupt  # as the call's time limit ends the process: nothing after it is written
        return {"check": "throughput", "config": spec.name}

    monkeypatch.setattr(gpu_check, "throughput", cut_off_second)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--dry-run", "--phase", "options", "--out", str(tmp_path / "cut")])
    records = [json.loads(line) for line in (tmp_path / "cut" / "gpu_check.jsonl").read_text().splitlines()]
    assert [r.get("config") for r in records if r["check"] == "throughput"] == [checkpointed]


def test_a_torchrun_phase_past_its_limit_stops_and_says_so():
    result = gpu_check.run_torchrun(dry_run=True, limit_s=3)
    assert result["ok"] is False and result["cut_off_after_s"] == 3 and result["check"] == "torchrun"


def test_a_stopped_torchrun_ends_its_worker_which_holds_the_gpu(tmp_path):
    """torchrun's worker runs in a session of its own and holds the GPU and our stdout pipe: stopping torchrun must
    end it too, not leave it running (or leave us waiting on its pipe). Stopped once the worker has started."""
    pid_file = tmp_path / "worker.pid"
    proc = gpu_check.start_torchrun(dry_run=True, pid_file=pid_file)
    try:
        deadline = time.monotonic() + 300
        while not (pid_file.exists() and pid_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        gpu_check.stop_torchrun(proc, pid_file)
        assert proc.poll() is not None
        _assert_ends(worker)
    finally:
        _end(proc, pid_file)


def test_a_worker_that_ignores_the_stop_is_killed_with_its_process_group(tmp_path):
    """Where torchrun's worker does not end on the agent's SIGTERM, `stop_torchrun` kills its process group after
    its grace, and returns what it had printed. A stand-in agent whose worker, in a session of its own as torchrun
    starts it, ignores SIGTERM and holds the agent's stdout."""
    pid_file = tmp_path / "worker.pid"
    worker = (
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpgrp())); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
        'print(\'{"check": "torchrun", "partial": true}\', flush=True); time.sleep(600)'
    )
    agent = (
        "import subprocess, sys; "
        f"subprocess.Popen([sys.executable, '-c', {worker!r}, {str(pid_file)!r}], start_new_session=True).wait()"
    )
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in worker never started"
            time.sleep(0.05)
        group = int(pid_file.read_text())
        printed = gpu_check.stop_torchrun(proc, pid_file, grace_s=1)
        assert gpu_check.torchrun_records(printed) == [{"check": "torchrun", "partial": True}]
        _assert_ends(group)
    finally:
        _end(proc, pid_file)


def _assert_ends(pid: int) -> None:
    deadline = time.monotonic() + 30  # ended, then reaped by whoever adopted it
    while _running(pid):
        assert time.monotonic() < deadline, f"the worker {pid} outlived torchrun"
        time.sleep(0.1)


def _end(proc: subprocess.Popen, pid_file: Path) -> None:
    """End what a test started, by id, whatever failed: the agent, then the worker's process group it wrote."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError, ValueError):
        group = int(pid_file.read_text())
        if _running(group):
            os.killpg(group, signal.SIGKILL)
    if proc.stdout is not None:
        proc.stdout.close()


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie (its state, after the command name in /proc/PID/stat)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_flops_counted_on_some_rows_carry_over_to_the_whole_batch_as_counted_on_all(monkeypatch, accum_steps):
    """FlopCounterMode counts an eager step on `FLOP_COUNT_ROWS` rows a micro-batch (the whole batch could run out of
    memory eagerly), and MFU carries that count over by the analytic count's ratio: the ratio on those rows must be
    the ratio on the whole batch (a count per row against one per batch would be off by the rows' ratio), with
    accumulation too (the rows then cut into micro-batches as the step cuts them)."""
    cfg = replace(gpu_check.config(gpu_check.CROSS, gpu_check.DRY), accum_steps=accum_steps)
    cpu = torch.device("cpu")
    assert gpu_check.DRY.batch > cfg.accum_steps
    whole = gpu_check.Rig(cfg, gpu_check.DRY, cpu, count_flops=True)
    monkeypatch.setattr(gpu_check, "FLOP_COUNT_ROWS", 1)
    some = gpu_check.Rig(cfg, gpu_check.DRY, cpu, count_flops=True)
    assert 0.5 < whole.counted_over_analytic < 1.5
    assert some.counted_over_analytic == pytest.approx(whole.counted_over_analytic, rel=0.1)


def test_each_gpu_gets_its_own_peak_flops():
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == gpu_check.peak_flops("NVIDIA H200") == 989.4e12
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == 756e12 and gpu_check.peak_flops("NVIDIA H100 NVL") == 835e12
    assert gpu_check.peak_flops("NVIDIA H200 NVL") == 835e12
    assert gpu_check.peak_flops("NVIDIA GeForce RTX 4090") is None
