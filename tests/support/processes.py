"""Processes a test starts: in a session of their own, waited for, or frozen and killed with every process they
started. Tests end only the processes they started (`kill_tree`)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from tests.support.repo import REPO


def start(command: list[str], quiet: bool = False, **kwargs: Any) -> subprocess.Popen:
    """Start `command` in the repository in a session of its own (so `kill_tree` can end it and its children);
    text pipes for its output, or none when `quiet`."""
    streams: dict[str, Any] = (
        {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        if quiet
        else {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    )
    return subprocess.Popen(command, start_new_session=True, **{"cwd": REPO, **streams, **kwargs})


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[str, str]]:
    """Wait for processes started with pipes; each must succeed. Their (stdout, stderr). Past `timeout` (for all
    together) every one is ended with what it started, and the test fails with the end of each one's stderr."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, err[-3000:]
            outs.append((out, err))
    except subprocess.TimeoutExpired:
        tails = []
        for p in procs:
            if p.poll() is None:
                end_family(p)
            tails.append((p.communicate()[1] or "")[-2000:])
        raise AssertionError(f"still running after {timeout} s; their stderr:\n" + "\n---\n".join(tails)) from None
    return outs


def _family(proc: subprocess.Popen) -> list[Any]:
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def freeze_tree(proc: subprocess.Popen) -> list[Any]:
    """SIGSTOP a process this test started and every process under it, until none is left running; returns them.

    The state the processes left on disk then stays as it is while the test looks at it.
    """
    import psutil

    stopped: dict[int, Any] = {}
    while True:
        family = [p for p in _family(proc) if p.pid not in stopped]
        if not family:
            return list(stopped.values())
        for p in family:
            with suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)
                stopped[p.pid] = p


def thaw(family: list[Any]) -> None:
    """SIGCONT what `freeze_tree` stopped."""
    import psutil

    for p in family:
        with suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGCONT)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process this test started and every process under it, by their ids, and wait until they are gone.

    Stopped first, so none can start another; torchrun's workers and Ray's actors live in sessions of their own,
    which is why a process group is not enough.
    """
    end_family(proc)
    proc.communicate() if proc.stdout is not None and not proc.stdout.closed else proc.wait()


def end_family(proc: subprocess.Popen) -> None:
    """SIGKILL a process this test started and every process under it (stopped first, as in `kill_tree`), and wait
    until they are gone; what is left in its pipes is the caller's to read."""
    import psutil

    family = freeze_tree(proc)
    for p in family:
        with suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(family, timeout=60)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """Kill `proc` and everything under it (`kill_tree`) at the first moment `ready()` holds, which is checked again
    with all of them stopped: the kill lands exactly in the state the test waited for, not at a moment chosen by a
    clock."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the process ended before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill the process never came"
        if ready():
            family = freeze_tree(proc)
            if ready():
                kill_tree(proc)
                return
            thaw(family)
        time.sleep(0.02)


def descendants(proc: subprocess.Popen, marker: str) -> list[Any]:
    """Processes under `proc` whose command line contains `marker` (e.g. one Ray actor's class)."""
    import psutil

    found = []
    for p in _family(proc)[1:]:
        with suppress(psutil.NoSuchProcess):
            if marker in " ".join(p.cmdline()):
                found.append(p)
    return found
