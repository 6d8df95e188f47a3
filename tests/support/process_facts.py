"""`python -m tests.support.process_facts [exit CODE | signal NAME | sleep FILE | linger CODE]`: what a command sees
of its process, as one JSON line on stdout (a line with a carriage return on stderr), then an exit as told; `sleep`
first starts a child that sleeps, writes both pids to FILE and sleeps itself; `linger` leaves a child that writes a
line to the same stdout a second after the command has exited. What `tests/test_forked_commands.py`
compares between a forked command and a fresh one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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
        with open(sys.argv[2], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    elif what == "linger":
        sys.stdout.flush()
        late = "import time; time.sleep(1); print('written after the command exited')"
        subprocess.Popen([sys.executable, "-c", late])
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
