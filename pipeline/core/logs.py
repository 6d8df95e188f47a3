"""What the project's modules say, and where it goes: one logger per module (`logging.getLogger(__name__)`), set up
once per process.

Library code never prints: it logs. A message that is a warning or a problem is `logger.warning`, the rest
`logger.info`; a report about this machine's own share of the work (its mirror of a remote cache or store, the
partitions and shards its node reads), which the first process of every node gives, is `logger.log(NODE, ...)`.

`configure()` is the CLI's set-up (its `main()` calls it first): the loggers of the project's packages write each
message as it is, one line, to the `sys.stderr` of the moment it is said (pytest's capture replaces it after
start-up), at INFO. A Python caller that configures logging itself (`logging.basicConfig(level=logging.INFO)`) sees
the same messages through the root logger; one that configures nothing sees the warnings (Python's last resort).

In a torchrun group, `set_rank` (called where the trainer learns its rank, `train.runtime.start_runtime`) keeps rank
0 at INFO and raises the others to WARNING, and the first process of each other node to NODE, so that a run's
messages are said once and each node's reports once per node. The environment variable TCJEPA_LOG_LEVEL (DEBUG,
INFO, NODE, WARNING, ERROR or a number) sets the level of every process instead, rank 0 included (users read this in
docs/cli.md, "Overview").
"""

from __future__ import annotations

import logging
import os
import sys

from pipeline.core.errors import UserError

PACKAGES = ("pipeline", "captioning", "embedding_cache", "train", "evaluation")
LEVEL_ENV = "TCJEPA_LOG_LEVEL"
# Between INFO and WARNING: a node's report on its own share of the work, kept on the first process of every node.
NODE = 25
logging.addLevelName(NODE, "NODE")


class StderrHandler(logging.Handler):
    """Writes each record to `sys.stderr` as it is when the record is emitted, not as it was when the handler was
    made (pytest's capsys and capfd, and `contextlib.redirect_stderr`, replace it after start-up)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


_handler = StderrHandler()
_handler.setFormatter(logging.Formatter("%(message)s"))


def env_level() -> int | None:
    """The level TCJEPA_LOG_LEVEL asks for, or None when it is unset or empty."""
    value = os.environ.get(LEVEL_ENV, "").strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise UserError(f"{LEVEL_ENV}={value!r} is not a log level: DEBUG, INFO, NODE, WARNING, ERROR or a number")
    return level


def configure() -> None:
    """The CLI's set-up, once per process (again: no second handler): the project's loggers write `%(message)s` to
    stderr at INFO (or TCJEPA_LOG_LEVEL), and not also to the root logger's handlers, so that a library which
    configures the root logger does not repeat or reformat them."""
    level = env_level() or logging.INFO
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if _handler not in logger.handlers:
            logger.addHandler(_handler)
        logger.setLevel(level)
        logger.propagate = False


def set_rank(rank: int, local_rank: int) -> None:
    """This process's level in a torchrun group: rank 0 keeps its own (INFO under the CLI); the first process of every
    other node shows its node's reports and warnings (NODE), the other processes warnings only. TCJEPA_LOG_LEVEL,
    when set, holds for every process instead."""
    level = env_level()
    if level is None:
        if rank == 0:
            return
        level = NODE if local_rank == 0 else logging.WARNING
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level)
