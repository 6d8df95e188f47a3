"""What a process shows of what the library says (`pipeline.core.logs`): bare lines on the stderr of the moment,
rank 0's messages in a torchrun group, each node's reports on its first process, warnings everywhere."""

from __future__ import annotations

import logging
import sys

import pytest

from pipeline.core import logs
from pipeline.core.errors import UserError
from tests.support.logs import logging_as_rank

# What a stage module would use: a logger under one of the project's packages.
said = logging.getLogger("train.a_stage")


def say_one_of_each() -> None:
    said.info("info: val_images chosen")
    said.log(logs.NODE, "node: 2 of the 4 image shards")
    said.warning("warning: 1 of 8 sampled images differ")


def test_each_message_is_a_bare_line_on_the_stderr_of_the_moment(capsys):
    """The handler writes to `sys.stderr` as it is when a message is said: capsys replaced it after the set-up."""
    logs.configure()  # a second time (the CLI's main in this process does too): still one line per message
    say_one_of_each()
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "info: val_images chosen",
        "node: 2 of the 4 image shards",
        "warning: 1 of 8 sampled images differ",
    ]
    assert captured.out == ""


def test_a_non_zero_rank_shows_its_warnings_and_not_its_info(capsys):
    with logging_as_rank(1):
        say_one_of_each()
    assert capsys.readouterr().err.splitlines() == ["warning: 1 of 8 sampled images differ"]
    say_one_of_each()  # the levels are rank 0's again after the block
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_the_first_process_of_another_node_shows_its_nodes_reports(capsys):
    with logging_as_rank(2, local_rank=0):
        say_one_of_each()
    assert capsys.readouterr().err.splitlines() == [
        "node: 2 of the 4 image shards",
        "warning: 1 of 8 sampled images differ",
    ]
    with logging_as_rank(0):
        say_one_of_each()
    assert len(capsys.readouterr().err.splitlines()) == 3, "rank 0 shows everything"


def test_the_environment_sets_every_ranks_level(capsys, monkeypatch):
    monkeypatch.setenv(logs.LEVEL_ENV, "info")
    with logging_as_rank(3, local_rank=1):
        say_one_of_each()
    assert len(capsys.readouterr().err.splitlines()) == 3
    monkeypatch.setenv(logs.LEVEL_ENV, "ERROR")
    with logging_as_rank(0):
        say_one_of_each()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(logs.LEVEL_ENV, "loud")
    with pytest.raises(UserError, match="TCJEPA_LOG_LEVEL='loud' is not a log level"):
        logs.set_rank(1, 1)


def test_the_trainer_takes_its_ranks_level_from_torchrun(capsys, monkeypatch):
    """`start_runtime` reads the rank torchrun gives (one process here, so no process group is joined)."""
    from train.config import TrainConfig
    from train.runtime import start_runtime

    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    with logging_as_rank(0):  # the levels come back after the block
        assert start_runtime(TrainConfig(device="cpu")).rank == 1
        say_one_of_each()
    assert capsys.readouterr().err.splitlines() == ["warning: 1 of 8 sampled images differ"]


def test_a_python_caller_sees_the_messages_through_its_own_logging(capsys):
    """Without the CLI's set-up, the messages reach the root logger's handlers, as any library's do."""
    loggers = [logging.getLogger(name) for name in logs.PACKAGES]
    before = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    root = logging.getLogger()
    caller = logging.StreamHandler(sys.stdout)
    caller.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root_level = root.level
    try:
        for logger in loggers:
            logger.handlers.clear()
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
        root.addHandler(caller)
        root.setLevel(logging.INFO)
        say_one_of_each()
    finally:
        root.removeHandler(caller)
        root.setLevel(root_level)
        for logger, (handlers, level, propagate) in zip(loggers, before):
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "INFO train.a_stage: info: val_images chosen",
        "NODE train.a_stage: node: 2 of the 4 image shards",
        "WARNING train.a_stage: warning: 1 of 8 sampled images differ",
    ]
    assert captured.err == ""
