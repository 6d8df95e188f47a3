"""`tcjepa train` end to end through the CLI: resume exactness, torchrun, no text model, NaN stop, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tcjepa

# A tiny run: 8×8 patches of 8 px, a 2-layer encoder and predictor, 4 captions per image.
TINY = [
    "--model",
    "vit_tiny",
    "--patch-size",
    "8",
    "--image-size",
    "64",
    "--batch-size",
    "8",
    "--captions-per-image",
    "4",
    "--no-progress",
    "--set",
    "depth=2",
    "--set",
    "predictor_width=96",
    "--set",
    "predictor_depth=2",
    "--set",
    "min_context=4",
    "--set",
    "val_images=8",
    "--set",
    "num_workers=1",
    "--set",
    "warmup_steps=2",
]
LOSS_KEYS = ("loss", "loss_predict", "loss_sparse", "loss_consistency")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_args(synth_dir: Path, cache: Path, store: Path, run: Path, *extra: str) -> list[str]:
    return ["train", synth_dir / "images", "--cache", cache, "--store", store, "--out", run, *TINY, *extra]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, synth_dir, annotated_cache, annotated_store) -> Path:
    """12 uninterrupted steps of `cross`, logging every step, validating and checkpointing every 4."""
    run = tmp_path_factory.mktemp("runs") / "reference"
    tcjepa(
        *_train_args(
            synth_dir,
            annotated_cache,
            annotated_store,
            run,
            "--steps",
            "12",
            "--set",
            "log_every=1",
            "--set",
            "val_every=4",
            "--set",
            "checkpoint_every=4",
        )
    )
    return run


def test_run_writes_config_index_checkpoint_metrics_and_plot(reference_run):
    for name in ("config.yaml", "index.parquet", "checkpoint.pt", "metrics.jsonl", "curves.png"):
        assert (reference_run / name).stat().st_size > 0, name
    lines = _metrics(reference_run)
    train = [m for m in lines if "loss" in m]
    val = [m for m in lines if "val_loss_predict" in m]
    assert [m["step"] for m in train] == list(range(1, 13))
    assert [m["step"] for m in val] == [4, 8, 12]
    for m in train:
        assert set(LOSS_KEYS) | {"lr", "wd", "ema", "images_per_s", "images_replaced"} <= set(m)
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


def test_resume_after_kill_equals_uninterrupted_run(
    tmp_path, synth_dir, annotated_cache, annotated_store, reference_run
):
    run = tmp_path / "killed"
    args = [
        sys.executable,
        "-m",
        "pipeline",
        *map(
            str,
            _train_args(
                synth_dir,
                annotated_cache,
                annotated_store,
                run,
                "--steps",
                "12",
                "--set",
                "log_every=1",
                "--set",
                "val_every=4",
                "--set",
                "checkpoint_every=4",
            ),
        ),
    ]
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not (run / "checkpoint.pt").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert killed_at < 12, "the kill came too late to test a resume"
    resumed = tcjepa(
        *_train_args(
            synth_dir,
            annotated_cache,
            annotated_store,
            run,
            "--steps",
            "12",
            "--resume",
            "--set",
            "log_every=1",
            "--set",
            "val_every=4",
            "--set",
            "checkpoint_every=4",
        )
    )
    assert f"resuming {run} at step {killed_at}" in resumed.stderr
    got, want = _metrics(run), _metrics(reference_run)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        for key in (*LOSS_KEYS, "lr", "wd", "ema", "val_loss_predict", "val_loss_predict_shuffled", "val_rankme"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))


def _torchrun(args: list, env: dict, wait: bool = True):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pipeline",
        *map(str, args),
    ]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _assert_close_runs(a: list[dict], b: list[dict]) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in (*LOSS_KEYS, "val_loss_predict"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), (x["step"], key)
        if "lr" in x:
            assert (x["lr"], x["wd"], x["ema"]) == (y["lr"], y["wd"], y["ema"])


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_torchrun_two_processes_match_one(tmp_path, synth_dir, annotated_cache, annotated_store, sharding):
    common = [
        "--steps",
        "4",
        "--set",
        "log_every=1",
        "--set",
        "val_every=4",
        "--set",
        "checkpoint_every=4",
        "--set",
        f"fsdp={str(sharding == 'fsdp').lower()}",
        "--set",
        "bf16=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single, double = tmp_path / "single", tmp_path / "double"
    tcjepa(*_train_args(synth_dir, annotated_cache, annotated_store, single, *common), env=env)
    _torchrun(_train_args(synth_dir, annotated_cache, annotated_store, double, *common), env)
    _assert_close_runs(_metrics(single), _metrics(double))


def test_a_failure_on_rank_0_stops_every_rank_with_its_message(tmp_path, synth_dir, annotated_cache, annotated_store):
    """Only rank 0 claims RUN; its refusal must reach rank 1 too, not leave it in a barrier until the timeout."""
    run = tmp_path / "not-a-run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pipeline",
        *map(str, _train_args(synth_dir, annotated_cache, annotated_store, run, "--steps", "2")),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "is a non-empty directory that is not a tcjepa run" in proc.stderr
    assert "another process of this run failed" in proc.stderr, proc.stderr[-2000:]


def test_fsdp_checkpoint_resumes_on_one_process(tmp_path, synth_dir, annotated_cache, annotated_store):
    """A run killed under torchrun (2 processes, FSDP) continues on 1 process as if it had never stopped."""
    common = [
        "--steps",
        "8",
        "--set",
        "log_every=1",
        "--set",
        "val_every=4",
        "--set",
        "checkpoint_every=2",
        "--set",
        "fsdp=true",
        "--set",
        "bf16=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference, moved = tmp_path / "reference", tmp_path / "moved"
    tcjepa(*_train_args(synth_dir, annotated_cache, annotated_store, reference, *common), env=env)
    proc = _torchrun(_train_args(synth_dir, annotated_cache, annotated_store, moved, *common), env, wait=False)
    deadline = time.monotonic() + 300
    while not (moved / "checkpoint.pt").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # torchrun's workers may live in their own process groups: kill whatever still trains into `moved`.
    subprocess.run(["pkill", "-9", "-f", str(moved)], check=False)
    while subprocess.run(["pgrep", "-f", str(moved)], capture_output=True).returncode == 0:
        time.sleep(0.1)
    assert torch.load(moved / "checkpoint.pt", weights_only=True)["step"] < 8
    tcjepa(*_train_args(synth_dir, annotated_cache, annotated_store, moved, *common), env=env)
    _assert_close_runs(_metrics(reference), _metrics(moved))


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


def test_trainer_never_imports_a_text_model(tmp_path, synth_dir, annotated_cache, annotated_store):
    """Imports of transformers / vllm / tokenizers fail in the trainer process and its DataLoader workers."""
    args = _train_args(
        synth_dir, annotated_cache, annotated_store, tmp_path / "run", "--steps", "2", "--set", "num_workers=2"
    )
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TEXT_MODELS, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint.pt").exists()


def test_none_mode_needs_no_cache(tmp_path, synth_dir):
    run = tmp_path / "ijepa"
    out = tcjepa("train", synth_dir / "images", "--out", run, "--conditioning", "none", "--steps", "3", *TINY)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    # Without text, the shuffled and no-text controls are the same prediction.
    assert last["val_loss_predict"] == last["val_loss_predict_shuffled"] == last["val_loss_predict_notext"]
    assert "val_positive_cosine" not in last


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    run = tmp_path / "diverge"
    proc = tcjepa(
        *_train_args(
            synth_dir,
            annotated_cache,
            annotated_store,
            run,
            "--steps",
            "8",
            "--set",
            "start_lr=1e-4",
            "--set",
            "lr=1e30",
            "--set",
            "warmup_steps=4",
            "--set",
            "log_every=1",
            "--set",
            "checkpoint_every=1",
        ),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: loss became NaN/Inf by step") and "last good checkpoint" in error
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert 1 <= state["step"] < int(error.split("by step ")[1].split(";")[0])
    assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "stepz=3"], "unknown config key 'stepz' (did you mean 'steps'?)"),
        (["--set", "lr=fast"], "config key 'lr': expected a number"),
        (["--conditioning", "crosss"], "conditioning must be one of none, sequence, cross"),
        (["--patch-size", "7"], "patch_size 7 does not divide image_size 64"),
        (["--set", "target_scale=[0.3,0.2]"], "mask settings: target_scale must be ordered"),
        (["--resume"], "holds no checkpoint to continue from"),
    ],
)
def test_bad_settings_get_one_line_errors(tmp_path, synth_dir, annotated_cache, annotated_store, extra, message):
    proc = tcjepa(
        *_train_args(synth_dir, annotated_cache, annotated_store, tmp_path / "run", "--steps", "2", *extra), check=False
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-1500:]


def test_cross_without_cache_and_run_of_another_config_are_refused(tmp_path, synth_dir, reference_run):
    proc = tcjepa("train", synth_dir / "images", "--out", tmp_path / "run", *TINY, check=False)
    assert proc.returncode == 2 and "needs --cache and --store" in proc.stderr
    proc = tcjepa("train", "--out", reference_run, "--lr", "0.5", "--no-progress", check=False)
    assert proc.returncode == 2 and "holds a run with another config" in proc.stderr and "lr" in proc.stderr
    config_file = tmp_path / "c.yaml"
    config_file.write_text("steps: [1\n")
    proc = tcjepa("train", synth_dir / "images", "--out", tmp_path / "r2", "--config", config_file, check=False)
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr


def test_a_run_continued_on_another_encoders_store_is_refused(
    tmp_path, synth_dir, annotated_cache, annotated_store, reference_run
):
    """The store path is in the config, but a store rebuilt in place with another T5 is caught by the encoder record."""
    record = json.loads((reference_run / "text_encoder.json").read_text())
    assert (
        record["encoder_hash"] == json.loads(tcjepa("store", "info", annotated_store, "--json").stdout)["encoder_hash"]
    )
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    (run / "text_encoder.json").write_text(json.dumps({**record, "encoder_hash": "0" * 64}))
    proc = tcjepa(
        *_train_args(
            synth_dir,
            annotated_cache,
            annotated_store,
            run,
            "--steps",
            "12",
            "--set",
            "log_every=1",
            "--set",
            "val_every=4",
            "--set",
            "checkpoint_every=4",
        ),
        check=False,
    )
    assert proc.returncode == 2 and "was trained on embeddings of encoder 000000000000" in proc.stderr, proc.stderr[
        -1500:
    ]


def test_a_run_in_use_is_refused(tmp_path, synth_dir):
    from filelock import FileLock

    run = tmp_path / "busy"
    run.mkdir()
    with FileLock(str(run / ".lock")):
        proc = tcjepa(
            "train", synth_dir / "images", "--out", run, "--conditioning", "none", "--steps", "2", *TINY, check=False
        )
    assert proc.returncode == 2 and "is in use by another `tcjepa train`" in proc.stderr


def test_help_config_lists_every_key():
    from dataclasses import fields

    from train.config import TrainConfig

    out = tcjepa("train", "--help-config").stdout
    for f in fields(TrainConfig):
        assert f.name in out


@pytest.mark.slow
def test_compile_trains(tmp_path, synth_dir):
    """`compile=true` wraps the trained module in torch.compile (inductor on CPU: about a minute here)."""
    run = tmp_path / "compiled"
    out = tcjepa(
        "train",
        synth_dir / "images",
        "--out",
        run,
        "--conditioning",
        "none",
        "--steps",
        "2",
        *TINY,
        "--set",
        "compile=true",
        "--set",
        "num_workers=0",
    )
    assert json.loads(out.stdout.strip().splitlines()[-1])["step"] == 2
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 2
