"""The suite's own machinery, run as `make test` runs it: the xdist groups that keep one vLLM engine, one trained T5
and one Ray instance per run, and the order tests are handed out in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.repo import REPO

# Five tests of a group, five of none and one of the unit tier; each records its worker and the order it ran in.
TESTS = """
import json, os, time
import pytest

def record(name):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(5))
@pytest.mark.ray
def test_grouped(i):
    record(f"grouped{i}")

def test_unit():
    record("unit")

@pytest.mark.parametrize("i", range(5))
@pytest.mark.slow
def test_costly(i):
    record(f"costly{i}")
"""


def nested_pytest(cwd: Path, test_file: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest in `cwd` on `test_file` with the suite's conftest as a plugin, as `make test` loads it, and `env` added
    to this process's environment less its own pytest variables (its xdist worker, say)."""
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(
        [*command, test_file],
        cwd=cwd,
        env={**outer, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.distributed
def test_a_group_runs_in_one_worker_and_costly_tests_are_handed_out_first(tmp_path):
    """pytest-xdist 3.8 with pytest 9.2 lets every group fall apart without a word (pytest-xdist#1386): here the
    conftest's groups and order go through the same pytest, xdist and hooks as `make test`."""
    (tmp_path / "test_tiers.py").write_text(TESTS)
    record = tmp_path / "record.jsonl"

    def pytest_(*args: str) -> subprocess.CompletedProcess:
        return nested_pytest(tmp_path, "test_tiers.py", *args, RECORD=str(record))

    done = pytest_("-n", "2", "--dist", "loadgroup")
    assert done.returncode == 0, done.stdout[-3000:]
    ran = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(ran) == 11
    assert len({worker for name, worker in ran if name.startswith("grouped")}) == 1, ran
    assert len({worker for _, worker in ran}) == 2, ran
    listed = pytest_("--collect-only")
    order = [line.split("::")[1] for line in listed.stdout.splitlines() if "::" in line]
    assert len(order) == 11 and order[-1] == "test_unit", "the unit tier is handed out after the costly tiers"


ENGINE_USERS = """
import json, os
import pytest

def record(name):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps(name) + "\\n")

@pytest.fixture(scope="session")
def vllm_engine():  # the conftest's session engine, as a record of its starts and ends
    record("start")
    yield "engine"
    record("end")

def test_a(vllm_engine):
    record("a")

def test_b(vllm_engine):
    record("b")

@pytest.mark.slow
def test_c():
    record("c")

def test_d(vllm_engine):
    record("d")
"""
# Run after the suite's conftest has ordered the tests: the order ORDER names, to place a user after a non-user.
FORCED_ORDER = """
import os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    if os.environ.get("ORDER"):
        order = os.environ["ORDER"].split(",")
        items.sort(key=lambda item: order.index(item.name))
"""


def test_the_session_engine_runs_its_users_in_a_row_then_ends_and_starts_again_for_a_later_one(tmp_path):
    (tmp_path / "test_engine_users.py").write_text(ENGINE_USERS)
    (tmp_path / "conftest.py").write_text(FORCED_ORDER)

    def ran(**env: str) -> list[str]:
        record = tmp_path / "record.jsonl"
        record.unlink(missing_ok=True)
        done = nested_pytest(tmp_path, "test_engine_users.py", **env, RECORD=str(record))
        assert done.returncode == 0, done.stdout[-3000:]
        return [json.loads(line) for line in record.read_text().splitlines()]

    assert ran() == ["start", "a", "b", "d", "end", "c"]  # its users first and together: one start
    assert ran(ORDER="test_a,test_b,test_c,test_d") == ["start", "a", "b", "end", "c", "start", "d", "end"]


def test_the_processes_a_test_starts_lack_the_test_only_packages_which_the_test_itself_has():
    """scikit-learn is a reference for the tests only; transformers imports it wherever it is installed (0.7 CPU-s
    more for each `tcjepa embed`). The commands the tests run see a user's install, without it."""
    import sklearn  # the reference tests import it in this process

    assert sklearn.__version__
    probe = "import importlib.util, sys; from transformers.utils import is_sklearn_available; "
    probe += "print(importlib.util.find_spec('sklearn') is None, is_sklearn_available(), 'sklearn' in sys.modules)"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["True", "False", "True"], seen  # absent, and the entry that hides it is the only one
