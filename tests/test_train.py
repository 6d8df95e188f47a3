"""`tcjepa train` end to end through the CLI: resume exactness, torchrun, no text model, NaN stop, refused runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.support.commands import cli, refused, run_command, start_tcjepa, tcjepa, torchrun
from tests.support.processes import kill_tree, start
from tests.support.training import (
    EXACT_STEPS,
    LOSS_KEYS,
    REFERENCE_STEPS,
    TINY_TRAIN,
    assert_close_runs,
    metrics,
    sets,
    train_args,
)
from train.checkpoint import checkpoint_step, has_checkpoint


def _wait_for_checkpoint(proc, run: Path) -> int:
    """Wait until the run has written its first checkpoint (either format), then kill the run and everything it
    started; its step."""
    deadline = time.monotonic() + 300
    while not has_checkpoint(run):
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kill_tree(proc)
    step = checkpoint_step(run)
    assert step is not None
    return step


def test_run_writes_config_index_checkpoint_metrics_and_plot(reference_run):
    for name in ("config.yaml", "index.parquet", "checkpoint.pt", "metrics.jsonl", "curves.png"):
        assert (reference_run / name).stat().st_size > 0, name
    lines = metrics(reference_run)
    train = [m for m in lines if "loss" in m]
    val = [m for m in lines if "val_loss_predict" in m]
    assert [m["step"] for m in train] == list(range(1, 13))
    assert [m["step"] for m in val] == [4, 8, 12]
    for m in train:
        assert set(LOSS_KEYS) | {"grad_norm", "lr", "wd", "ema", "images_per_s", "images_replaced"} <= set(m)
        assert m["images_replaced"] == 0
        assert m["loss_sparse"] > 0 and m["loss_consistency"] > 0
        assert m["loss"] == pytest.approx(
            m["loss_predict"] + 0.1 * m["loss_sparse"] + 0.5 * m["loss_consistency"], rel=1e-5
        )
    for m in val:
        assert len(m["val_positive_cosine"]) == 2 and all(0 <= v <= 1 for v in m["val_positive_cosine"])
        assert 1 < m["val_rankme"] <= 192
        assert m["val_loss_predict_shuffled"] > 0 and m["val_loss_predict_notext"] > 0
    state = torch.load(reference_run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 12 and state["config"]["conditioning"] == "cross"


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted_run(
    tmp_path, synth_dir, annotated_cache, annotated_store, reference_run
):
    run = tmp_path / "killed"
    args = train_args(synth_dir / "images", annotated_cache, annotated_store, run, *REFERENCE_STEPS)
    killed_at = _wait_for_checkpoint(start_tcjepa(*args, quiet=True), run)
    assert killed_at < 12, "the kill came too late to test a resume"
    resumed = tcjepa(*args, "--resume")
    assert f"resuming {run} at step {killed_at}" in resumed.stderr
    got, want = metrics(run), metrics(reference_run)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        for key in (*LOSS_KEYS, "lr", "wd", "ema", "val_loss_predict", "val_loss_predict_shuffled", "val_rankme"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failure_on_rank_0_stops_every_rank_with_its_message(tmp_path, synth_dir, annotated_cache, annotated_store):
    """Only rank 0 claims RUN; its refusal must reach rank 1 too, not leave it in a barrier until the timeout."""
    run = tmp_path / "not-a-run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    args = train_args(synth_dir / "images", annotated_cache, annotated_store, run, "--steps", "2")
    proc = run_command(torchrun(*args), check=False, timeout=300)
    assert proc.returncode != 0 and "is a non-empty directory that is not a tcjepa run" in proc.stderr
    assert "another process of this run failed" in proc.stderr, proc.stderr[-2000:]


def test_an_error_in_a_data_loader_worker_ends_the_run_in_one_line(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    """A worker that raises (here: the store's token files were removed after the index was built) ends the run;
    its workers, which ignore stop signals, must not keep it from exiting."""
    store = tmp_path / "store"
    shutil.copytree(annotated_store, store)
    for shard in store.glob("segments/*/tokens/c/**/*"):
        if shard.is_file():
            shard.unlink()
    args = train_args(synth_dir / "images", annotated_cache, store, tmp_path / "run", "--steps", "2")
    proc = run_command(cli(*args), check=False, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "DataLoader worker" in proc.stderr and "No such file" in proc.stderr, proc.stderr[-2000:]


BLOCK_TEXT_MODELS = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('transformers', 'vllm', 'tokenizers'):
            raise ImportError(f'the trainer imported {name}')
        return None
sys.meta_path.insert(0, Block())
from pipeline.cli import main
sys.argv = ['tcjepa'] + sys.argv[1:]
main()
"""


@pytest.mark.slow
def test_trainer_never_imports_a_text_model(tmp_path, synth_dir, annotated_cache, annotated_store):
    """Imports of transformers / vllm / tokenizers fail in the trainer process and its DataLoader workers."""
    args = train_args(
        synth_dir / "images",
        annotated_cache,
        annotated_store,
        tmp_path / "run",
        "--steps",
        "2",
        "--set",
        "num_workers=2",
    )
    run_command([sys.executable, "-c", BLOCK_TEXT_MODELS, *map(str, args)], timeout=300)
    assert (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_none_mode_needs_no_cache(tmp_path, synth_dir):
    out = tcjepa(
        *train_args(synth_dir / "images", None, None, tmp_path / "ijepa", "--conditioning", "none", "--steps", 3)
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    # Without text, the shuffled and no-text controls are the same prediction.
    assert last["val_loss_predict"] == last["val_loss_predict_shuffled"] == last["val_loss_predict_notext"]
    assert "val_positive_cosine" not in last


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    run = tmp_path / "diverge"
    diverging = ["--steps", "8", "--set", "start_lr=1e-4", "--set", "lr=1e30", "--set", "warmup_steps=4"]
    every_step = ["--set", "log_every=1", "--set", "checkpoint_every=1"]
    proc = tcjepa(
        *train_args(synth_dir / "images", annotated_cache, annotated_store, run, *diverging, *every_step), check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: loss became NaN/Inf by step") and "last good checkpoint" in error
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert 1 <= state["step"] < int(error.split("by step ")[1].split(";")[0])
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_a_bad_setting_is_one_line_from_deep_inside_the_trainer(tmp_path, synth_dir):
    """The CLI's error path: settings the trainer refuses (train.config's messages are tested in process) end the
    command with one `error:` line and exit 2."""
    proc = tcjepa(*train_args(synth_dir / "images", None, None, tmp_path / "run", "--patch-size", "7"), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[-1] == "error: patch_size 7 does not divide image_size 64", proc.stderr
    assert not (tmp_path / "run").exists()


# TINY_TRAIN without its explicit val_images and min_context, textless: a first run at the automatic settings.
FIRST_RUN = [
    *("--conditioning", "none", "--model", "vit_tiny", "--batch-size", "8", "--no-progress"),
    *sets("depth=2", "predictor_width=96", "predictor_depth=2"),
]


@pytest.fixture(scope="module")
def twenty_images(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth20")
    tcjepa("synth", "--out", out, "--n-images", 20, "--seed", 5)
    return out / "images"


@pytest.mark.slow
def test_a_first_run_on_a_small_folder_chooses_its_settings_and_a_corrected_retry_is_accepted(tmp_path, twenty_images):
    """20 images at the default settings, patch 16 on 64 px: a validation set of 10%, a min_context scaled to the
    4×4 grid and loader workers from this machine's CPUs, each said in one line; an explicit impossible value is
    refused in one line and leaves no config, so the corrected command runs into the same --out."""
    from pipeline.core.devices import usable_cpus
    from train.config import automatic_num_workers

    run = tmp_path / "run"
    small = ["train", twenty_images, "--out", run, *FIRST_RUN, "--patch-size", "16", "--image-size", "64"]
    refusal = tcjepa(*small, "--steps", "2", "--set", "val_images=20", check=False)
    assert refusal.returncode == 2 and refusal.stderr.strip().splitlines()[-1].startswith(
        "error: val_images 20: only 20 images, so at most 19 can be held out"
    ), refusal.stderr
    assert not (run / "config.yaml").exists()
    done = tcjepa(*small, "--steps", "2")
    said = done.stderr.splitlines()
    assert any(line.startswith("val_images: 2 of the 20 images held out for validation") for line in said), said
    assert any(line.startswith("min_context: 1 patch(es) on the 4×4 grid") for line in said), said
    cpus = usable_cpus()
    workers = f"num_workers: {automatic_num_workers(cpus, 1)} DataLoader worker(s) per rank ({cpus} CPUs for 1 rank(s)"
    assert any(line.startswith(workers) for line in said), said
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 2
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["val_images"], saved["min_context"]) == (0, 0), "the config keeps what was asked: automatic"
    assert torch.load(run / "checkpoint.pt", weights_only=True)["config"]["min_context"] == 1


@pytest.mark.slow
def test_a_first_run_at_the_default_patch_size_on_twenty_images_trains(tmp_path, twenty_images):
    done = tcjepa("train", twenty_images, "--out", tmp_path / "run", *FIRST_RUN, "--image-size", "64", "--steps", "1")
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 1


@pytest.mark.slow
def test_a_run_started_with_relative_paths_resumes_from_another_directory(tmp_path, synth_dir):
    """Paths in the saved config are absolute: a run started in one directory with relative paths continues from
    another with nothing but its --out."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    images = os.path.relpath(synth_dir / "images", here)
    args = ["train", images, "--out", "run", *TINY_TRAIN, "--conditioning", "none", *REFERENCE_STEPS]
    killed_at = _wait_for_checkpoint(start_tcjepa(*args, quiet=True, cwd=here), here / "run")
    assert killed_at < 12
    assert yaml.safe_load((here / "run" / "config.yaml").read_text())["images"] == [str(synth_dir / "images")]
    resumed = tcjepa("train", "--out", os.path.relpath(here / "run", elsewhere), "--resume", cwd=elsewhere)
    assert f"at step {killed_at}" in resumed.stderr
    assert [m["step"] for m in metrics(here / "run") if "val_loss_predict" in m] == [4, 8, 12]


def _signal_once_training(proc, run: Path, process: Any) -> None:
    """Send SIGUSR1 to `process` (the run or one of its workers) once the run has logged a training step."""
    deadline = time.monotonic() + 300
    while not any("loss" in m for m in (metrics(run) if (run / "metrics.jsonl").exists() else [])):
        assert proc.poll() is None, "the run ended before it trained"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)


@pytest.mark.slow
def test_a_preempted_run_checkpoints_exits_75_and_resumes_to_the_uninterrupted_end(
    tmp_path, synth_dir, annotated_cache, annotated_store, reference_run
):
    """SIGUSR1 (Slurm's warning before the time limit): the step finishes, a checkpoint is written, the command exits
    75 with one `stopped:` line; the same command then ends where an uninterrupted run ends, metrics and weights."""
    run = tmp_path / "preempted"
    args = train_args(synth_dir / "images", annotated_cache, annotated_store, run, *REFERENCE_STEPS)
    proc = start_tcjepa(*args)
    _signal_once_training(proc, run, proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: SIGUSR1 received: stopped after step "), err[-3000:]
    stopped_at = int(last.split("after step ")[1].split(" of 12")[0])
    assert stopped_at < 12, "the signal came too late to test a resume"
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == stopped_at
    resumed = tcjepa(*args)
    assert f"resuming {run} at step {stopped_at}" in resumed.stderr
    got, want = metrics(run), metrics(reference_run)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        for key in (*LOSS_KEYS, "lr", "wd", "ema", "val_loss_predict", "val_rankme"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    mine = torch.load(run / "checkpoint.pt", weights_only=True)
    theirs = torch.load(reference_run / "checkpoint.pt", weights_only=True)
    for part in ("model", "target"):
        assert all(torch.equal(mine[part][k], theirs[part][k]) for k in theirs[part]), part


@pytest.mark.slow
@pytest.mark.distributed
def test_a_signal_to_one_process_under_torchrun_stops_every_rank_after_the_same_step(
    tmp_path, synth_dir, annotated_cache, annotated_store, exact_run
):
    """Only rank 1 gets SIGUSR1: the ranks agree (an all-reduced flag), both stop after the same step with one
    checkpoint, and the run continues on one process as if it had never stopped."""
    import psutil

    run = tmp_path / "agreed"
    args = train_args(synth_dir / "images", annotated_cache, annotated_store, run, *EXACT_STEPS)
    proc = start(torchrun(*args))
    deadline = time.monotonic() + 300
    rank_1 = None
    while rank_1 is None:
        assert proc.poll() is None and time.monotonic() < deadline
        for child in psutil.Process(proc.pid).children(recursive=True):
            with suppress(psutil.Error):
                if child.environ().get("RANK") == "1" and "pipeline" in child.cmdline():
                    rank_1 = child
        time.sleep(0.05)
    _signal_once_training(proc, run, rank_1)
    _, err = proc.communicate(timeout=300)
    stops = [line for line in err.splitlines() if line.startswith("stopped: SIGUSR1 received")]
    assert len(stops) == 2 and len(set(stops)) == 1, err[-4000:]
    stopped_at = int(stops[0].split("after step ")[1].split(" of 8")[0])
    assert stopped_at < 8 and torch.load(run / "checkpoint.pt", weights_only=True)["step"] == stopped_at
    tcjepa(*args)
    assert_close_runs(metrics(exact_run), metrics(run))


@pytest.mark.slow
def test_checkpoints_keep_the_newest_and_every_nth_with_the_encoders_as_safetensors(tmp_path, synth_dir):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    every = sets("log_every=1", "val_every=5", "checkpoint_every=1", "checkpoint_keep=2", "checkpoint_every_keep=2")
    tcjepa(*train_args(synth_dir / "images", None, None, run, "--conditioning", "none", "--steps", "5", *every))
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    names = ("pt", "context_encoder.safetensors", "target_encoder.safetensors")
    assert kept == sorted(f"step-{s:08d}.{n}" for s in (2, 4, 5) for n in names)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    target, context = load_file(run / "target_encoder.safetensors"), load_file(run / "context_encoder.safetensors")
    assert target.keys() == state["target"].keys() and all(
        torch.equal(v, state["target"][k]) for k, v in target.items()
    )
    assert all(torch.equal(v, state["model"][f"encoder.{k}"]) for k, v in context.items())
    assert len(context) == len([k for k in state["model"] if k.startswith("encoder.")])
    exported = json.loads(tcjepa("export", run, "--out", tmp_path / "export").stdout)
    assert exported["step"] == 5


def test_resume_needs_a_checkpoint(tmp_path, synth_dir):
    proc = refused(*train_args(synth_dir / "images", None, None, tmp_path / "run", "--resume"))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: --resume: {tmp_path / 'run'} holds no checkpoint to continue from"
    )


def test_a_config_file_or_missing_images_are_one_line(tmp_path, synth_dir):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("steps: [1\n")
    proc = refused("train", synth_dir / "images", "--out", tmp_path / "r", "--config", config_file)
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = refused("train", "--out", tmp_path / "r")
    assert proc.returncode == 2 and proc.stderr == "error: no images: pass IMAGES (or `images:` in --config)\n"


def test_help_config_lists_every_key():
    from dataclasses import fields

    from train.config import TrainConfig

    out = tcjepa("train", "--help-config").stdout
    for f in fields(TrainConfig):
        assert f.name in out


@pytest.mark.slow
def test_the_loop_reads_the_device_and_agrees_on_stops_only_where_it_logs_or_checkpoints(
    tmp_path, synth_dir, monkeypatch
):
    """Host stalls outside the step: 8 steps logging every 4, validating and checkpointing at the end. The loop reads
    the device once per log (one `tolist` of the summed loss parts and images replaced, after one all-reduce under
    torchrun) and once per checkpoint (its finiteness check), and asks the processes to agree on stop requests only
    at a log or checkpoint step (a collective under torchrun): once here (step 4; the last step needs none)."""
    import inspect

    from train.config import TrainConfig, apply
    from train.loop import run_training
    from train.runtime import StopRequests

    loop_file = str(Path(inspect.getfile(run_training)))
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __original=original, __name=name):
            if sys._getframe(1).f_code.co_filename == loop_file:
                reads.append(__name)
            return __original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    agreements: list[int] = []
    agree = StopRequests.agreed

    def counted_agree(self):
        agreements.append(1)
        return agree(self)

    monkeypatch.setattr(StopRequests, "agreed", counted_agree)
    settings = {
        "images": [str(synth_dir / "images")],
        "conditioning": "none",
        "model": "vit_tiny",
        "depth": 1,
        "patch_size": 16,
        "image_size": 64,
        "predictor_width": 48,
        "predictor_depth": 1,
        "batch_size": 8,
        "steps": 8,
        "warmup_steps": 2,
        "log_every": 4,
        "val_every": 8,
        "checkpoint_every": 8,
        "val_images": 8,
        "num_workers": 0,
        "min_context": 1,
        "device": "cpu",
    }
    metrics = run_training(apply(TrainConfig(), settings, "test"), tmp_path / "run", progress=False)
    assert [m["step"] for m in metrics if "loss" in m] == [4, 8]
    assert sorted(reads) == sorted(["tolist", "tolist", "__bool__"]), reads
    assert len(agreements) == 1
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000, "the curves were drawn in the background"
