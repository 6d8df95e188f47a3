"""Running the CLI: `tcjepa` runs it in a subprocess and waits, `start_tcjepa` starts one to watch and kill, and
`refused` runs it in this process for commands that must be refused before any work."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from tests.support.forked_commands import forkable, forked_worker, run_forked
from tests.support.processes import end_family, start
from tests.support.repo import REPO


def cli(*args: object) -> list[str]:
    """The command line of `tcjepa ARGS` in this interpreter."""
    return [sys.executable, "-m", "pipeline", *map(str, args)]


def torchrun(
    *args: object, launch: tuple[str, ...] = ("--standalone", "--nproc-per-node", "2"), fresh: bool = False
) -> list[str]:
    """The command line of `torchrun LAUNCH -m pipeline ARGS` (default: two processes on this host), whose workers are
    forked from this process's warm interpreter (`tests.support.forked_worker`) unless `fresh`."""
    workers = ["-m", "pipeline"] if fresh else forked_worker("pipeline")
    return [sys.executable, "-m", "torch.distributed.run", *launch, *workers, *map(str, args)]


def two_nodes(name: str) -> tuple[str, ...]:
    """torchrun's launch options for two nodes of one process each, meeting at a c10d rendezvous on loopback."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    endpoint = ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name)
    return ("--nnodes", "2", "--nproc-per-node", "1", *endpoint)


def run_command(
    command: list[str], check: bool = True, timeout: float = 600, fresh: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run `command` in the repository (or `cwd=`), capturing its text output; with `check`, a failure shows its
    stderr. Past `timeout` it is ended with every process it started (subprocess.run ends only the first), and
    the test fails with its stderr. `python -m` of the CLI or a benchmark is forked from this process's warm
    interpreter (`tests.support.forked_commands`) unless `fresh` or its options need a fresh one."""
    options = {"cwd": REPO, **kwargs}
    env = options.pop("env", None)
    if not fresh and forkable(command, env, **options):
        forked = run_forked(command, timeout, options["cwd"], env)
        if forked is not None:  # else no server could start: fresh, as below
            return _checked(subprocess.CompletedProcess(command, *forked), check)
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **options)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_family(child)
        raise AssertionError(
            f"{' '.join(map(str, command[1:]))} still running after {timeout} s; its stderr:\n"
            f"{(child.communicate()[1] or '')[-3000:]}"
        ) from None
    return _checked(subprocess.CompletedProcess(command, child.returncode, out, err), check)


def _checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        command = " ".join(proc.args[1:])
        raise AssertionError(
            f"{command} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def tcjepa(
    *args: object, check: bool = True, timeout: float = 600, fresh: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m pipeline ...`) in a process of its own (forked, unless `fresh`: `run_command`)."""
    return run_command(cli(*args), check=check, timeout=timeout, fresh=fresh, **kwargs)


def refused(*args: object) -> subprocess.CompletedProcess:
    """`tcjepa ARGS` through the console script's own entry point (`pipeline.cli.main`), in this process: for
    commands that must be refused before any work. Everything but the process start (~2.5 CPU-seconds of imports)
    is the real path, exit status and stderr included; the same error path is checked from a process once per
    command (test_cli.py, and a `tcjepa(..., check=False)` test in each command's module)."""
    from pipeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["tcjepa", *map(str, args)]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main()
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
    assert code != 0, f"tcjepa {' '.join(map(str, args))} was not refused:\n{out.getvalue()[-2000:]}"
    return subprocess.CompletedProcess(["tcjepa", *map(str, args)], code, out.getvalue(), err.getvalue())


def python_module(
    module: str, *args: object, check: bool = True, timeout: float = 600, fresh: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (a benchmark, say) in the repository, as `tcjepa` runs the CLI."""
    command = [sys.executable, "-m", module, *map(str, args)]
    return run_command(command, check=check, timeout=timeout, fresh=fresh, **kwargs)


def start_tcjepa(*args: object, quiet: bool = False, **kwargs: Any) -> subprocess.Popen:
    """Start `tcjepa ARGS` (see `start`)."""
    return start(cli(*args), quiet=quiet, **kwargs)
