"""Seeing a run's progress: the bar's loss, the `--no-progress` lines, TensorBoard event files, W&B (offline)."""

from __future__ import annotations

import sys

import pytest

from pipeline.core.errors import UserError
from tests.support.commands import tcjepa
from tests.support.training import sets, train_args
from train.reporting import Progress, check_loggers, format_line

RECORD = {
    "step": 10,
    "loss": 1.5,
    "loss_predict": 1.25,
    "loss_sparse": 2.0,
    "loss_consistency": 0.1,
    "lr": 0.001,
    "images_per_s": 12.0,
}


def test_the_bar_shows_the_loss(tmp_path, capsys):
    progress = Progress(tmp_path, {}, 0, 20, bar=True, loggers=[])
    for _ in range(10):
        progress.step()
    progress.logged(RECORD)
    progress.step()
    progress.close()
    assert "loss=1.5000" in capsys.readouterr().err


def test_a_log_line_names_the_step_loss_terms_lr_speed_and_eta():
    line = format_line(RECORD, 20, 65.0)
    assert line == (
        "step 10/20 | loss 1.5000 (predict 1.2500, sparse 2.0000, consistency 0.1000) | lr 0.001 | 12.0 images/s | "
        "ETA 00:01:05"
    )


def test_an_unknown_or_missing_logger_is_one_line(monkeypatch):
    with pytest.raises(UserError, match="--log mlflow: choose tensorboard or wandb"):
        check_loggers(["mlflow"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as when it is not installed: `import wandb` fails
    with pytest.raises(UserError, match="--log wandb needs the wandb package, which is not installed: pip install"):
        check_loggers(["wandb"])


@pytest.mark.slow
def test_no_progress_prints_a_line_per_log_and_tensorboard_gets_the_scalars(tmp_path, synth_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    args = ["--conditioning", "none", "--steps", "4", *sets("log_every=2", "val_every=4"), "--log", "tensorboard"]
    done = tcjepa(*train_args(synth_dir / "images", None, None, run, *args))
    lines = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 4/4", "step 4/4"], done.stderr
    assert " images/s | ETA " in lines[0] and "lr " in lines[0] and "(predict " in lines[0]
    assert lines[2].startswith("step 4/4 | validation: predict ")
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "loss_predict", "lr", "images_per_s", "val_loss_predict", "val_rankme"} <= set(scalars)
    assert [e.step for e in events.Scalars("loss")] == [2, 4]


@pytest.mark.slow
def test_wandb_offline_logs_the_run(tmp_path, synth_dir):
    pytest.importorskip("wandb")
    import os

    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = ["--conditioning", "none", "--steps", "2", *sets("log_every=1"), "--log", "wandb"]
    tcjepa(*train_args(synth_dir / "images", None, None, run, *args), env=env)
    logged = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logged) == 1 and logged[0].stat().st_size > 0
