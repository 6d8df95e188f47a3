"""The warm interpreter the tests fork their commands from (`tests.support.forked_commands`): a forked command sees
what a fresh one does, exits as it would, is done when its output is, is killed with its children past its timeout,
and a command that needs a fresh interpreter gets one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.commands import run_command, tcjepa
from tests.support.forked_commands import Server, forkable, run_forked, stand_in
from tests.support.processes import kill_tree, start
from tests.support.repo import REPO

FACTS = [sys.executable, "-m", "tests.support.process_facts"]
CLI = [sys.executable, "-m", "pipeline", "train"]

pytestmark = pytest.mark.skipif(
    not forkable(CLI, None), reason="every command runs fresh here (coverage, or OMP_NUM_THREADS is not 1)"
)


@pytest.fixture(autouse=True)
def facts_importable(monkeypatch):
    """`tests.support.process_facts` importable from any directory, in the server (started again) as in a fresh
    process."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(REPO)]))


def fresh(args: list[str], cwd, env) -> tuple[int, str, str]:
    done = subprocess.run([*FACTS, *args], cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("args", [["exit", "3"], ["signal", "SIGTERM"], ["linger", "0"]])
def test_a_forked_command_sees_and_exits_as_a_fresh_one(tmp_path, args):
    """Same facts, exit status (a signal's negative), and output: stderr read as a text pipe is, and stdout until
    the child the command left behind has closed it too."""
    env = {**os.environ, "TCJEPA_SOMETHING": "set by the test"}
    forked = run_forked([*FACTS, *args], 120, tmp_path, env)
    alone = fresh(args, tmp_path, env)
    assert forked is not None
    assert forked[0] == alone[0] == {"exit": 3, "signal": -15, "linger": 0}[args[0]]
    assert forked[2] == alone[2] == "progress\ndone\n"
    (seen, *late), (expected, *late_too) = forked[1].splitlines(), alone[1].splitlines()
    assert late == late_too == (["written after the command exited"] if args[0] == "linger" else [])
    seen, expected = json.loads(seen), json.loads(expected)
    assert seen.pop("torch") and not expected.pop("torch"), "the server's imports are the one difference"
    assert seen == expected and seen["env"] == {"TCJEPA_SOMETHING": "set by the test"}
    assert seen["path0"] == seen["cwd"] == str(tmp_path.resolve()) and seen["name"] == "__main__"


def test_a_forked_command_ends_as_the_interpreter_ends_a_fresh_one(tmp_path):
    """A forked command skips the interpreter's teardown of its modules, not what anyone sees of its end: what the
    SystemExit's frames held is finalized, the thread still running is joined, the atexit handler runs, C's buffered
    output is written, and a SystemExit message is printed and exits 1, in the order a fresh process does them."""
    forked = run_forked([*FACTS, "finish", "stopped: a message"], 120, tmp_path, dict(os.environ))
    alone = fresh(["finish", "stopped: a message"], tmp_path, dict(os.environ))
    assert forked is not None
    assert forked[0] == alone[0] == 1
    assert forked[2] == alone[2] == "progress\ndone\nstopped: a message\n"
    assert (
        forked[1].splitlines()[1:]
        == alone[1].splitlines()[1:]
        == ["finalized", "the thread ended", "atexit ran", "in C's buffer"]
    )


def test_a_forked_command_past_its_timeout_is_killed_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 10 s"):
        run_forked([*FACTS, "sleep", str(pids)], 10, tmp_path, None)
    assert time.monotonic() - started < 60
    command, child = map(int, pids.read_text().split())
    server = Server.get()
    assert server is not None and command not in (os.getpid(), server.proc.pid)
    for pid in (command, child):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_commands_that_need_a_fresh_interpreter_get_one(monkeypatch):
    base = dict(os.environ)
    assert forkable(CLI, None) and forkable([sys.executable, "-m", "benchmarks.startup"], base)
    read_later = {"TCJEPA_CACHE_DIR": "/x", "HF_HUB_OFFLINE": "0", "AWS_ACCESS_KEY_ID": "k", "HOME": "/tmp"}
    assert forkable(CLI, {**base, **read_later}), "read at run time"
    read_at_start = ("TORCH_LOGS", "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED", "KMP_INIT_AT_FORK", "LANG", "CXX")
    for name in (*read_at_start, "TQDM_DISABLE"):  # tqdm's defaults: read as torch imports it
        assert not forkable(CLI, {**base, name: "+recompiles"}), f"{name} may be read when the interpreter starts"
    assert not forkable(CLI, None, preexec_fn=print) and forkable(CLI, None, cwd="/")
    assert not forkable([sys.executable, "-m", "torch.distributed.run", "-m", "pipeline"], None), "torchrun"
    assert not forkable([sys.executable, "-c", "print()"], None)
    assert not forkable(["python3", "-m", "pipeline"], None), "another interpreter"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not forkable(CLI, None), "a fork from a torch on several threads is unsafe"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("COVERAGE_PROCESS_START", "pyproject.toml")
    assert not forkable(CLI, None), "coverage measures fresh processes"


def test_the_server_starts_again_when_the_test_process_sets_what_is_read_at_start(monkeypatch):
    first = Server.get()
    assert first is not None and Server.get() is first
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/somewhere")  # as inductor does when it compiles in-process
    second = Server.get()
    assert second is not None and second is not first and first.proc.poll() is not None
    assert second.env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/somewhere"


def test_without_a_server_commands_run_fresh(monkeypatch):
    monkeypatch.setattr(Server, "failed", "could not start")
    assert not forkable(CLI, None)
    assert tcjepa("--version").stdout.startswith("tcjepa ")


def test_the_cli_forked_and_fresh_says_the_same():
    for args in (["--version"], ["train", "--no-such-option"]):
        forked, alone = tcjepa(*args, check=False), tcjepa(*args, check=False, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    with pytest.raises(AssertionError, match="exited 2"):
        run_command([sys.executable, "-m", "pipeline", "no-such-command"])


def _torchrun_facts(forked: bool, *args: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node 1 -m tests.support.process_facts ARGS`, its worker forked from this
    process's server or fresh."""
    module = "tests.support.process_facts"
    server = Server.get()
    assert server is not None
    worker = stand_in(server, module) if forked else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *worker, *args]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("args", "reported"),
    [(["exit", "3"], ["exitcode  : 3"]), (["signal", "SIGTERM"], ["exitcode  : -15"])],
)
def test_a_forked_torchrun_worker_sees_and_ends_as_a_fresh_one(tmp_path, args, reported):
    """torchrun's worker forked or fresh: the same facts (torchrun's environment, the module run as `__main__`, the
    working directory) and output, and torchrun reports the same end: a status, or a signal. (One worker: two would
    write their lines into one pipe at once, and with two a failure's report depends on which ends first.)"""
    env = {**os.environ, "TCJEPA_SOMETHING": "set by the test"}
    runs = {}
    for forked in (True, False):
        done = subprocess.run(
            _torchrun_facts(forked, *args),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        facts = [json.loads(line) for line in sorted(done.stdout.splitlines())]
        ends = [line.split("(pid")[0].strip() for line in done.stderr.splitlines() if "exitcode  :" in line]
        runs[forked] = done.returncode, facts, ends, done.stderr.count("progress\ndone\n")
    (code, facts, ends, progress), fresh_run = runs[True], runs[False]
    assert all(f.pop("torch") for f in facts) and not any(f.pop("torch") for f in fresh_run[1]), "forked, and fresh"
    assert (code, facts, ends, progress) == fresh_run
    assert code == 1 and ends == reported and len(facts) == progress == 1
    assert facts[0]["env"] == {"TCJEPA_SOMETHING": "set by the test"} and facts[0]["cwd"] == str(tmp_path.resolve())


def _sleeping_worker(tmp_path) -> tuple[subprocess.Popen, psutil.Process, psutil.Process, psutil.Process]:
    """torchrun with one forked worker whose command sleeps beside a child it started: (torchrun, the worker that
    torchrun started, the command, its child; psutil signals neither once its pid is another process's)."""
    tmp_path.mkdir()
    pids = tmp_path / "pids"
    agent = start(_torchrun_facts(True, "sleep", str(pids)), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not pids.exists() or not pids.read_text():
        if agent.poll() is not None or time.monotonic() > deadline:
            kill_tree(agent)
            raise AssertionError("torchrun ended, or its worker did not sleep within 120 s")
        time.sleep(0.05)
    (worker,) = psutil.Process(agent.pid).children()
    command, child = (psutil.Process(int(pid)) for pid in pids.read_text().split()[:2])
    assert command.pid != worker.pid and "forked_worker.py" in " ".join(worker.cmdline())
    return agent, worker, command, child


def _gone(*procs: psutil.Process) -> bool:
    def ended(p: psutil.Process) -> bool:
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(ended(p) for p in procs)


@pytest.mark.distributed
def test_signals_reach_a_forked_torchrun_worker_as_they_reach_a_fresh_one(tmp_path):
    """torchrun told to stop signals its worker's whole group: the command gets SIGTERM and ends, and so does the
    child it started. A signal to the worker alone (a test's) reaches the command alone. A killed worker takes its
    command and child with it."""

    def ended(agent: subprocess.Popen, command: psutil.Process, child: psutil.Process) -> tuple[bool, bool, str]:
        """Whether the command and its child ended by themselves, then torchrun's stderr (what is left killed first:
        the child holds torchrun's output pipes)."""
        try:
            agent.wait(timeout=120)
            gone = _until(lambda: _gone(command)), _until(lambda: _gone(child), timeout=5)
        finally:
            for p in (command, child):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            if agent.poll() is None:
                kill_tree(agent)
        return *gone, agent.communicate(timeout=120)[1]

    agent, _, command, child = _sleeping_worker(tmp_path / "a")
    agent.send_signal(signal.SIGTERM)
    assert ended(agent, command, child)[:2] == (True, True), "torchrun's SIGTERM reached the command's group"
    assert (tmp_path / "a" / "pids").read_text().split()[2:] == ["SIGTERM"], "the command got it (not a SIGKILL)"

    agent, worker, command, child = _sleeping_worker(tmp_path / "b")
    worker.send_signal(signal.SIGUSR1)
    command_gone, child_gone, err = ended(agent, command, child)
    assert command_gone and not child_gone and "exitcode  : -10 " in err, "the command alone got it, and died by it"

    agent, worker, command, child = _sleeping_worker(tmp_path / "c")
    worker.kill()
    assert ended(agent, command, child)[:2] == (True, True), "the server ended what the killed worker stood for"


def _until(condition, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
