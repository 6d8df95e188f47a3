"""`python -m MODULE ARGS` forked from a warm interpreter: a command a test runs to completion skips the imports of
torch and `torch._dynamo` (~3 CPU-seconds a process here), as a DataLoader's forked workers do.

One server per pytest process, started on first use: this file run as a script, which imports torch and
`torch._dynamo` (no module of the repository's packages, no text model), then forks for each request an intermediate
process, which forks the command, tells the test its pid, copies its output from pipes into files until every
process holding them has closed them (as `communicate` waits for a fresh one), and tells the test its exit status.
The command is a process of its own with the test's environment, working directory and `sys.path[0]`; it runs the
module in a new `__main__` as `python -m` does (`runpy`) and exits as the interpreter would, up to its last
visible step (`_exit_as_the_interpreter_would`: the modules are not torn down). Past
its timeout the intermediate, which has not reaped it, kills it and what it started.

What a forked command cannot have, and so runs in a fresh interpreter (`forkable` says which):
- an environment that differs from the test process's in what Python, numpy, torch or OpenMP may read as they start
  (`_READ_AT_START`: `TORCH_LOGS`, `OMP_NUM_THREADS`, `PYTHONPATH`, `LANG`, ...); the server is started again when the
  test process's own environment changes in those (inductor sets its cache directory in-process, an OpenMP runtime
  its KMP_*);
- options of `subprocess.Popen` besides `cwd` and `env` (`preexec_fn`, `stdin`, `start_new_session`, ...);
- coverage's measurement, or a torch started on more than one thread (`OMP_NUM_THREADS` not 1);
- its own string-hash seed: every forked command has its server's, so a test that checks that two runs write the
  same bytes runs one of them fresh (`tcjepa(..., fresh=True)`).
Commands a test starts to watch, signal or kill (`tests.support.processes.start`) always start fresh. torchrun's
workers are forked too, through a stand-in torchrun starts in their place (`forked_worker`,
`tests/support/forked_worker.py`), whose standard streams the server's fork takes over. When the server cannot start
(a torch import that leaves threads or loads CUDA's driver, say) every command runs fresh.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

# Environment variables that Python, numpy, torch, inductor, OpenMP or a BLAS may read as they start (prefixes): a
# command whose environment differs from the server's in one of these runs fresh, and the server is started again
# when the test process's own environment changes in one (inductor sets its cache directory in-process, say).
_READ_AT_START = (
    "PYTHON",
    "LANG",
    "LC_",
    "LD_",
    "MALLOC",
    "TMPDIR",
    "NPY_",
    "NUMPY_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "TORCH",
    "PYTORCH",
    "INDUCTOR",
    "AOT_INDUCTOR",
    "CXX",
    "CC",
    "CUDA",
    "NCCL",
    "GLOO",
    "TRITON",
    "COVERAGE",
    "TQDM_",  # tqdm takes its defaults from TQDM_* as torch imports it
)
SERVED_MODULES = ("pipeline", "benchmarks.")  # the CLI and the benchmarks; not torchrun, not `-c` code
# What torchrun sets for its workers besides their ranks, read by torch.distributed as it runs, not as it starts.
_SET_BY_TORCHRUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that Python, numpy, torch or OpenMP may read as they start (`_READ_AT_START`)."""
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START)}


def _read_at_start_by_a_worker(env: Mapping[str, str]) -> dict[str, str]:
    """`read_at_start` of a torchrun worker's environment, less what torchrun adds that is read as it runs."""
    return read_at_start({k: v for k, v in env.items() if not k.startswith(_SET_BY_TORCHRUN)})


def forkable(command: list[str], env: Mapping[str, str] | None, **options: Any) -> bool:
    """Whether `command` (`[python, -m, MODULE, ...]`, run with `env` and `options`) may be forked: a module served,
    no option but `cwd`, no coverage, one torch thread, a server that could start, and in `env` what is read at start
    as in this process's environment (the server's)."""
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m" or set(options) - {"cwd"}:
        return False
    if not (command[2] == SERVED_MODULES[0] or command[2].startswith(SERVED_MODULES[1])):
        return False
    current = read_at_start(os.environ)
    if any(k.startswith("COVERAGE") for k in current) or current.get("OMP_NUM_THREADS") != "1":
        return False  # coverage measures fresh processes; a fork is safe from a torch that runs one thread
    return Server.failed is None and (env is None or read_at_start(env) == current)


class Server:
    """The warm interpreter of this pytest process (`Server.get()`), ended with the process."""

    _this: Server | None = None
    _lock = threading.Lock()
    failed: str | None = None  # why the server could not start: every command then runs fresh

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"tcjepa-fork-{os.getpid()}-"))
        self.socket = self.dir / "socket"
        self.env = dict(os.environ)
        with open(self.dir / "server.stderr", "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.socket)],
                cwd=Path(__file__).resolve().parents[2],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        deadline = time.monotonic() + 120
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((self.dir / "server.stderr").read_text().strip()[-2000:] or "no socket after 120 s")
            time.sleep(0.05)

    @classmethod
    def get(cls) -> Server | None:
        """The server, started again when this process's environment has changed in what is read at start since
        it started; None, with a warning the first time, when it cannot start."""
        with cls._lock:
            this = cls._this
            if this is not None and this.proc.poll() is None and read_at_start(this.env) == read_at_start(os.environ):
                return this
            cls._stop()
            try:
                cls._this = Server()
            except (OSError, RuntimeError) as exc:
                cls.failed = str(exc)
                warnings.warn(f"commands run fresh: the fork server did not start: {exc}", stacklevel=2)
            return cls._this

    @classmethod
    def _stop(cls) -> None:
        """End this process's server (by its pid; commands it forked finish on their own)."""
        if cls._this is not None and cls._this.proc.poll() is None:
            cls._this.proc.kill()
            cls._this.proc.wait()
        cls._this = None

    @classmethod
    def stop_and_clean(cls) -> None:
        """At the pytest process's exit: end its server and remove the directories of every server it started."""
        with cls._lock:
            cls._stop()
        for path in Path(tempfile.gettempdir()).glob(f"tcjepa-fork-{os.getpid()}-*"):
            shutil.rmtree(path, ignore_errors=True)


WORKER = Path(__file__).with_name("forked_worker.py")


def stand_in(server: Server, module: str) -> list[str]:
    """torchrun's options that start each worker through the stand-in (`--no-python`,
    `tests/support/forked_worker.py`), which has `server` fork `python -u -m MODULE`."""
    return ["--no-python", sys.executable, "-S", str(WORKER), str(server.socket), module]


def forked_worker(module: str) -> list[str]:
    """torchrun's options for workers `python -u -m MODULE` forked from this process's server (`stand_in`); `-m
    MODULE` where commands run fresh here."""
    server = Server.get() if forkable([sys.executable, "-m", module], None) else None
    return ["-m", module] if server is None else stand_in(server, module)


def run_forked(
    command: list[str], timeout: float, cwd: Path | str, env: Mapping[str, str] | None
) -> tuple[int, str, str] | None:
    """(exit status, stdout, stderr) of `command` forked from this process's server, or None when no server could
    start. Past `timeout` the command and what it started are killed and AssertionError is raised with its stderr."""
    server = Server.get()
    if server is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="cmd-", dir=server.dir))
    request = {
        "module": command[2],
        "argv": command[3:],
        "cwd": str(Path(cwd).resolve()),
        "env": dict(os.environ if env is None else env),
        "stdout": str(out / "stdout"),
        "stderr": str(out / "stderr"),
    }
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(server.socket))
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.settimeout(timeout)
        try:
            with conn.makefile("r") as replies:
                pid, status = replies.readline(), replies.readline()
        except TimeoutError:
            conn.settimeout(120)
            conn.sendall(b"kill\n")  # the intermediate kills the command it has not reaped, and what it started
            with contextlib.suppress(TimeoutError):
                conn.recv(1 << 16)  # its exit status, once its output is closed
            raise AssertionError(
                f"{' '.join(map(str, command[1:]))} still running after {timeout} s; its stderr:\n"
                f"{_read(out / 'stderr')[-3000:]}"
            ) from None
    if not pid or not status:
        raise RuntimeError(
            f"the fork server lost {' '.join(command[2:])}: {(server.dir / 'server.stderr').read_text()}"
        )
    texts = _read(out / "stdout"), _read(out / "stderr")
    shutil.rmtree(out)
    return int(status), *texts


def _read(path: Path) -> str:
    """A command's output as `subprocess.Popen(..., text=True)` reads a pipe (universal newlines)."""
    with open(path) as f:
        return f.read()


if __name__ != "__main__":
    atexit.register(Server.stop_and_clean)  # in the pytest process only, not in the server or its commands


def _kill_family(pid: int) -> None:
    """SIGSTOP then SIGKILL the command `pid` (this process's unreaped child) and every process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):  # one that ended by itself meanwhile
                p.send_signal(sig)


def _serve(path: str) -> tuple[dict[str, Any], int, int, int]:
    """The server's loop; returns only in a forked command: its request and its standard streams (a test's command:
    /dev/null and the write ends of its output pipes; a torchrun worker's: the three it sent)."""
    started_with = _read_at_start_by_a_worker(os.environ)  # the test process's, before torch's import adds to it
    import torch  # noqa: F401  (what the commands would import first)
    import torch._dynamo  # noqa: F401  (imported by every torch optimizer's constructor)

    if len(os.listdir("/proc/self/task")) != 1:
        sys.exit("torch's import left threads running (OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1 avoid them)")
    if "libcuda" in Path("/proc/self/maps").read_text():
        sys.exit("torch's import loaded the CUDA driver, which a forked process cannot use")
    parent = os.getppid()
    gc.collect()
    gc.freeze()  # the objects imported so far stay out of the children's collections (no copy-on-write of them)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".part")
    listener.listen(16)
    os.rename(path + ".part", path)
    listener.settimeout(1.0)
    while True:
        while True:  # reap the intermediate processes that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if os.getppid() != parent:
            os._exit(0)  # the pytest process is gone
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            conn.settimeout(60)
            request, fds, pending = _receive(conn)
        except (OSError, ValueError):
            conn.close()  # a test (or a worker) that went away before asking
            continue
        conn.settimeout(None)
        if request.get("worker") and _read_at_start_by_a_worker(request["env"]) != started_with:
            with contextlib.suppress(OSError):
                conn.sendall(b"fresh\n")  # the worker becomes a fresh interpreter
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if os.fork() != 0:
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        listener.close()
        if request.get("worker"):  # its own standard streams (torchrun's), and the signals it forwards
            command = os.fork()
            if command == 0:
                os.setpgid(0, 0)  # a group of its own, as torchrun starts each worker in a session of its own
                conn.close()
                return request, *fds
            for fd in fds:
                os.close(fd)
            try:
                _intermediate_for_worker(conn, command, pending)
            finally:
                os._exit(0)
        pipes = os.pipe(), os.pipe()
        command = os.fork()
        if command == 0:
            conn.close()
            os.close(pipes[0][0])
            os.close(pipes[1][0])
            return request, os.open(os.devnull, os.O_RDONLY), pipes[0][1], pipes[1][1]
        try:
            _intermediate(conn, command, request, (pipes[0][0], pipes[1][0]), (pipes[0][1], pipes[1][1]))
        finally:
            os._exit(0)  # never back into the loop, also when the test has gone (a closed connection)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int], bytes]:
    """A request (one JSON line), the descriptors sent with it (a worker's standard streams), and what came after it
    (signals a worker forwarded before its command existed)."""
    data, fds = b"", []
    try:
        while b"\n" not in data:
            chunk, received, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            fds += received
            if not chunk:
                raise OSError("closed before a whole request")
            data += chunk
        line, _, pending = data.partition(b"\n")
        return json.loads(line), fds, pending
    except BaseException:
        for fd in fds:  # held here, torchrun's output pipes would never close
            os.close(fd)
        raise


def _intermediate_for_worker(conn: socket.socket, command: int, pending: bytes) -> None:
    """Tell the worker the command's pid; pass on the signals it forwards (to the command's group, or to the command
    alone), and kill the command and what it started if the worker goes (killed: torchrun's last resort); then wait
    for the command and tell its exit status."""
    os.setpgid(command, command)  # as the command does itself: whichever runs first, the group exists from here on
    ended = os.pidfd_open(command)
    try:
        conn.sendall(f"{command}\n".encode())
        with selectors.DefaultSelector() as selector:
            selector.register(ended, selectors.EVENT_READ)
            selector.register(conn, selectors.EVENT_READ)
            while True:
                *lines, pending = pending.split(b"\n")
                for line in lines:  # b"signal NUMBER group|process"; not reaped yet, the command's pid is its own
                    _, number, scope = line.split()
                    (os.killpg if scope == b"group" else os.kill)(command, int(number))
                if ended in {key.fd for key, _ in selector.select()}:
                    break
                try:
                    chunk = conn.recv(1 << 12)
                except OSError:  # ECONNRESET: the worker was killed with a signal line unread
                    chunk = b""
                if not chunk:  # the worker has gone
                    selector.unregister(conn)
                    _kill_family(command)
                pending += chunk
    except BaseException:
        _kill_family(command)  # never left running without the worker that stands for it
        raise
    finally:
        os.close(ended)
    _, status = os.waitpid(command, 0)
    with contextlib.suppress(OSError):
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _intermediate(conn: socket.socket, command: int, request: dict, reads: tuple, writes: tuple) -> None:
    """Tell the test the command's pid; copy its output into the request's files until every holder of its pipes
    has closed them, killing it and what it started if the test asks; then wait for it and tell its exit status."""
    for fd in writes:
        os.close(fd)
    conn.sendall(f"{command}\n".encode())
    files = {reads[0]: open(request["stdout"], "wb"), reads[1]: open(request["stderr"], "wb")}
    with selectors.DefaultSelector() as selector:
        for fd in reads:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(conn, selectors.EVENT_READ)
        while files.keys() & selector.get_map().keys():  # a pipe still open (after a kill too)
            for key, _ in selector.select():
                if key.fileobj is conn:
                    selector.unregister(conn)
                    _kill_family(command)  # the test asked (past its timeout) or has gone
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    files[key.fd].write(chunk)
                    files[key.fd].flush()
                else:
                    selector.unregister(key.fd)
                    files[key.fd].close()
    _, status = os.waitpid(command, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _become(request: dict[str, Any], stdin: int, stdout: int, stderr: int) -> None:
    """Turn this forked process into `python -m MODULE ARGS` as the test would have started it (a torchrun worker:
    `python -u -m MODULE ARGS`, as torchrun starts it)."""
    import io
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None
    for fd, target in enumerate((stdin, stdout, stderr)):
        if target != fd:
            os.dup2(target, fd)
            os.close(target)
    if request.get("worker"):  # `-u`: unbuffered standard output and error
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            raw = io.FileIO(fd, "w", closefd=False)
            raw.name = f"<{name}>"  # type: ignore[misc]  (as the interpreter names its own)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
            stream.mode = "w"  # type: ignore[misc]
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # the legacy global state, fresh as in a new interpreter
    importlib.invalidate_caches()
    sys.path[0] = request["cwd"]
    sys.argv = [request["module"], *request["argv"]]
    sys.modules["__main__"] = types.ModuleType("__main__")
    code: object = None
    try:
        runpy._run_module_as_main(request["module"], alter_argv=True)  # type: ignore[attr-defined]  (`python -m`'s)
    except SystemExit as exc:
        code = exc.code  # the exception and the frames its traceback holds are freed here, as the interpreter does
    _exit_as_the_interpreter_would(code)


def _exit_as_the_interpreter_would(code: object) -> NoReturn:
    """End the command as CPython ends a process whose `__main__` returned or raised SystemExit, in what anyone can
    see of it: the exit message and status, non-daemon threads joined, atexit handlers run, output flushed, cyclic
    garbage collected (its finalizers run), C's stdio buffers flushed; then `os._exit`. Skipped: the teardown that
    frees every module and runs C++ destructors, which in a forked process writes to, and so copies, most pages shared
    with the server (~40,000 page faults and ~0.22 CPU-s a command here); what that teardown would print (a module's
    `__del__`, a ResourceWarning) is not seen, where a fresh process (`fresh=True`, coverage's runs) shows it. An
    exception other than SystemExit takes the interpreter's own path."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF if -(2**63) <= code < 2**63 else 255  # a C long's range, else 255, as CPython
    else:
        if sys.stderr is None:
            os.write(2, f"{code}\n".encode())
        else:
            print(code, file=sys.stderr)  # as the interpreter prints a non-integer exit code
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  (what the interpreter calls first as it ends)
    atexit._run_exitfuncs()
    streams = {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s is not None}
    for stream in streams.values():
        try:
            stream.flush()
        except Exception:
            status = 120  # CPython's status when flushing the standard streams fails at exit
    gc.collect()  # the finalizers of what cycles still held, as the interpreter's last collection runs them
    for stream in streams.values():
        with contextlib.suppress(Exception):
            stream.flush()
    ctypes.CDLL(None).fflush(None)  # C's stdio buffers, which exit() would flush
    os._exit(status)


if __name__ == "__main__":
    _become(*_serve(sys.argv[1]))
