"""The project's logging in the test process: the CLI's set-up (`tests/conftest.py` makes it once per session, so
that a test that calls a library function reads what it says on stderr as a user of the CLI would), and the levels
of a torchrun rank for the length of a test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.core import logs


@contextmanager
def logging_as_rank(rank: int, local_rank: int | None = None) -> Iterator[None]:
    """Inside the block, the project's loggers are at the levels `set_rank` gives process `rank` (on a node of its
    own unless `local_rank` says otherwise); after it, at the levels they had."""
    loggers = [logging.getLogger(name) for name in logs.PACKAGES]
    before = [logger.level for logger in loggers]
    logs.set_rank(rank, rank if local_rank is None else local_rank)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before):
            logger.setLevel(level)
