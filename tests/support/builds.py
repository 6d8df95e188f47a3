"""What a test session builds once and shares: under pytest-xdist, the first worker to ask builds it in the
session's common temporary directory while the others wait on its lock."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's common temporary directory: the base directory of the one process, or under pytest-xdist the
    controller's, which holds each worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, made by `build(directory)` once per test session and then only read.

    Under pytest-xdist every worker process would build its own copy of a session fixture; here the first worker to
    ask builds it in the session's common temporary directory (the workers' base directories' parent) while the
    others wait on its lock, and all of them use that one. A build that failed leaves no `.done` mark: the next
    worker to ask builds it again (and fails as loudly). Only for fixtures no test writes into.
    """
    from filelock import FileLock

    shared = session_root(tmp_path_factory) / "built-once"
    shared.mkdir(exist_ok=True)
    out, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


SYNTH_ARGS = ("--n-images", 40, "--seed", 3)  # the session's synthetic scenes
