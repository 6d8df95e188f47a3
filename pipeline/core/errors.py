"""The exception types that reach users as one line, and the line an I/O failure gets."""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """Bad input, bad configuration or a refused operation.

    The CLI prints ``error: <message>`` on one line and exits with status 2; the
    message must say what is wrong and what to do about it.
    """


class DataProblem(Exception):
    """`verify` found a cache or store inconsistent: the CLI prints ``problem: <message>`` and exits with status 1."""


class Stopped(Exception):
    """A long command stopped on request (SIGTERM, SIGUSR1: what Slurm and Kubernetes send before a kill) after
    saving its progress. The CLI prints ``stopped: <message>`` and exits with `STOPPED_STATUS`, on which a job
    script requeues; the same command then continues."""


STOPPED_STATUS = os.EX_TEMPFAIL  # 75, sysexits.h: a temporary failure, try again


NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NO_WRITE = {errno.EROFS, errno.EACCES, errno.EPERM}


def os_error_line(exc: OSError) -> str:
    """One line for a failed read or write: what failed, where, and what to do; writers publish only whole files."""
    where = f" ({exc.filename})" if exc.filename else ""
    reason = exc.strerror or str(exc)
    if exc.errno in NO_SPACE:
        return (
            f"cannot write{where}: {reason}; free space (or raise the file size limit) and rerun: "
            "nothing half-written was published, and the rerun resumes"
        )
    if exc.errno in NO_WRITE:
        return f"cannot access{where}: {reason}; make the destination writable (or the input readable), then rerun"
    return f"{reason}{where}"
