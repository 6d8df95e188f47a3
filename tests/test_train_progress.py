"""Seeing a run's progress: the bar's loss, the `--no-progress` lines, TensorBoard event files, W&B (offline)."""

from __future__ import annotations

import sys
import time

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


def _log_until(run, steps: int) -> None:
    from train.metrics import MetricsLog

    log = MetricsLog(run)
    for step in range(1, steps + 1):
        log.append({"step": step, "loss": 1 / step, "loss_predict": 1 / step})
        log.append({"step": step, "val_loss_predict": 1 / step})


def _within(seconds: float, done) -> bool:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    return done()


def test_curves_are_drawn_at_once_then_at_most_once_an_interval_and_what_is_left_at_close(tmp_path):
    """A drawing takes the GIL from rank 0's thread: requests after every validation are thinned to one an interval,
    and the last one is drawn, with the newest metrics, when the run closes."""
    from train.metrics import CURVES, CurvePlotter

    _log_until(tmp_path, 2)
    plotter = CurvePlotter(every_s=3600)
    plotter.draw(tmp_path)
    assert _within(60, (tmp_path / CURVES).exists)  # written whole (a rename) by the plotter's thread
    first = (tmp_path / CURVES).read_bytes()
    _log_until(tmp_path, 6)
    for _ in range(3):  # the first drawing is done: only the interval holds these back
        plotter.draw(tmp_path)
    assert plotter.drawings == 1
    plotter.close()
    assert plotter.drawings == 1 and (tmp_path / CURVES).read_bytes() != first, "the last request drawn at close"

    # once the interval has passed (and the drawing under way is done), a request draws again
    soon = CurvePlotter(every_s=0.2)

    def asked_again() -> bool:
        soon.draw(tmp_path)
        return soon.drawings == 2

    assert soon.drawings == 0 and _within(60, asked_again)
    soon.close()
