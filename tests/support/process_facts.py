"""`python -m tests.support.process_facts [exit CODE | signal NAME | sleep FILE | linger CODE | finish MESSAGE]`: what a
command sees of its process, as one JSON line on stdout (a line with a carriage return on stderr), then an exit as
told; `sleep` first starts a child that sleeps, writes both pids to FILE and sleeps itself (a SIGTERM it gets is
noted in FILE before it ends by it); `linger` leaves a child
that writes a line to the same stdout a second after the command has exited; `finish` leaves what the interpreter
finishes as it ends (an object only the exiting frame holds, a thread still running, an atexit handler, a line in
C's stdout buffer) and exits with MESSAGE.
What `tests/test_forked_commands.py` compares between a forked command and a fresh one."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time


class Finalized:
    """Says when it is finalized."""

    def __del__(self) -> None:
        print("finalized", flush=True)


def finish(message: str) -> None:
    """Leave what the interpreter finishes as it ends, then exit with `message`."""
    _held = Finalized()  # alive in this frame, which the SystemExit's traceback holds until the exit is handled
    threading.Thread(target=lambda: (time.sleep(0.5), print("the thread ended", flush=True))).start()
    atexit.register(print, "atexit ran")
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    c_stdout = ctypes.c_void_p(libc.fdopen(1, b"w"))  # a C stream of its own on a pipe: fully buffered
    assert c_stdout.value, "fdopen failed"
    libc.fputs(b"in C's buffer\n", c_stdout)  # written when the C library flushes its streams, at exit()
    sys.exit(message)


if __name__ == "__main__":
    facts = {
        "argv": sys.argv[1:],
        "argv0": sys.argv[0],
        "name": __name__,
        "spec": __spec__.name if __spec__ else None,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "env": {k: v for k, v in os.environ.items() if k.startswith("TCJEPA_")},
        "stdin": sys.stdin.read(),
        "torch": "torch" in sys.modules,
    }
    print(json.dumps(facts))
    print("progress\rdone", file=sys.stderr)
    what = sys.argv[1] if len(sys.argv) > 1 else "exit"
    if what == "signal":
        sys.stdout.flush()
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    elif what == "sleep":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

        def noted(number: int, _: object) -> None:
            with open(sys.argv[2], "a") as f:
                f.write(f" {signal.Signals(number).name}")
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

        signal.signal(signal.SIGTERM, noted)
        with open(sys.argv[2], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    elif what == "linger":
        sys.stdout.flush()
        late = "import time; time.sleep(1); print('written after the command exited')"
        subprocess.Popen([sys.executable, "-c", late])
    elif what == "finish":
        finish(sys.argv[2])
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
