"""A torchrun worker forked from the pytest process's warm interpreter (`tests.support.forked_commands`): torchrun
starts this script (`--no-python`) where it would start `python -u -m MODULE ARGS`, and it stands in for that process.

`python -S forked_worker.py SOCKET MODULE ARGS` (no site: it starts in ~20 ms on the standard library alone) sends
the fork server its environment, working directory and standard streams (the descriptors themselves), and the server
forks `python -u -m MODULE ARGS` with them, in a process group of its own as torchrun starts a worker. This process
then hands on each signal it gets: one from torchrun (its parent), which signals a worker's whole group, to the
command's group; one from anyone else (a test) to the command alone. It ends as the command ended, with its exit
status or by its signal. If this process is killed, the server kills the command and what it started. When the server
is gone, or refuses (an environment that differs in what is read at start), this process becomes the fresh one torchrun
would have started (`exec`).

A forked worker skips ~2.5 CPU-seconds of imports (torch, `torch._dynamo`) for each of the suite's ~30 torchrun
workers. What differs from a fresh one: the command is not a descendant of the torchrun agent (this process stands in
for it among the agent's children), so stopping the agent's family (SIGSTOP) does not stop the command, and killing
it ends the command a moment later (the server's doing).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys
import threading

# What torchrun (SIGTERM, SIGINT, SIGHUP, SIGQUIT: TORCHELASTIC_SIGNALS_TO_HANDLE) and the tests (SIGUSR1) send.
FORWARDED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}


def main() -> None:
    path, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    conn = socket.socket(socket.AF_UNIX)
    request = {"module": module, "argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "worker": True}
    # From here on a signal waits for `forward`, also one that comes before the command exists (the server hands
    # it on); the mask is inherited by the thread below.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = conn.makefile("r")
        pid = replies.readline().strip()
    except OSError:
        pid = ""
    if not pid.isdigit():  # no server, or it refused: the process torchrun would have started
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # what came meanwhile acts now, as on a fresh one
        os.execv(sys.executable, [sys.executable, "-u", "-m", module, *args])
    threading.Thread(target=forward, args=(conn,), daemon=True).start()
    status = replies.readline().strip()
    code = int(status) if status.lstrip("-").isdigit() else 1  # the server gone mid-run: a failure
    if code < 0:  # ended by a signal: end by the same one, as torchrun would have seen the command end
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGQUIT or SIGSEGV: one core file, the command's
        with contextlib.suppress(OSError):  # SIGKILL and SIGSTOP keep their action
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        signal.pthread_kill(threading.main_thread().ident, -code)  # to this thread, not to `forward`'s wait
    os._exit(code if code >= 0 else 128 - code)


def forward(conn: socket.socket) -> None:
    """Hand on each signal this process gets: torchrun's to the command's group, anyone else's to the command."""
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo(FORWARDED)
        scope = "group" if info.si_pid == parent else "process"
        with contextlib.suppress(OSError):  # the server gone: the status the main thread reads says so
            conn.sendall(f"signal {info.si_signo} {scope}\n".encode())


if __name__ == "__main__":
    main()
