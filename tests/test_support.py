"""The suite's own layout: `tests/conftest.py` holds fixtures and hooks, and what tests share besides them lives in
`tests/support`, so that the helper library does not grow back into the conftest."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.repo import REPO

CONFTEST = REPO / "tests" / "conftest.py"


def imports_conftest(path: Path) -> list[int]:
    """The lines of `path` that import `tests.conftest` (or anything from it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(name == "tests.conftest" or name.startswith("tests.conftest.") for name in names):
            found.append(node.lineno)
    return found


def is_fixture(node: ast.FunctionDef) -> bool:
    """Whether `node` is decorated with `pytest.fixture` or `pytest.fixture(...)`."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
            isinstance(target, ast.Name) and target.id == "fixture"
        ):
            return True
    return False


def helpers(tree: ast.Module) -> list[str]:
    """The public functions and classes a module defines that are neither fixtures nor pytest hooks."""
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if isinstance(node, ast.ClassDef) or not (node.name.startswith("pytest_") or is_fixture(node)):
            found.append(node.name)
    return found


def test_no_module_imports_from_the_conftest() -> None:
    paths = [*(REPO / "tests").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / ".ci").rglob("*.py")]
    offenders = {str(p.relative_to(REPO)): lines for p in paths if p != CONFTEST and (lines := imports_conftest(p))}
    assert not offenders, f"import these from tests/support, not tests.conftest: {offenders}"


def test_the_conftest_defines_only_fixtures_and_hooks() -> None:
    """Every public function of conftest.py is a fixture or a pytest hook, and it defines no public class: a helper
    belongs in tests/support (private functions that only the hooks call may stay)."""
    found = helpers(ast.parse(CONFTEST.read_text(), filename=str(CONFTEST)))
    assert not found, f"conftest.py defines helpers; move them to tests/support: {found}"


def test_the_checks_see_imports_and_helpers(tmp_path) -> None:
    """The two checks above catch what they look for."""
    module = tmp_path / "test_x.py"
    module.write_text("import os\nfrom tests.conftest import tcjepa\nimport tests.conftest as c\nfrom tests import x\n")
    assert imports_conftest(module) == [2, 3]
    conftest = """
@pytest.fixture
def a(): ...
@pytest.fixture(scope="session")
def b(): ...
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items): ...
def _turn(item): ...
def tcjepa(*args): ...
class Helper: ...
"""
    assert helpers(ast.parse(conftest)) == ["tcjepa", "Helper"]


def test_the_support_modules_asserts_are_rewritten(request: pytest.FixtureRequest) -> None:
    """pytest rewrites the asserts of tests/support as it did theirs in conftest.py (which registers the package), so
    a helper's failed assert shows its values."""
    if request.config.getoption("assertmode") != "rewrite":
        pytest.skip("pytest runs with --assert=plain")
    import tests.support.processes  # noqa: F401 (one with asserts, loaded whatever else this run imported)

    support = {name: m for name, m in sys.modules.items() if name.startswith("tests.support.")}
    assert "tests.support.processes" in support
    plain = [name for name, m in support.items() if type(m.__loader__).__name__ != "AssertionRewritingHook"]
    assert not plain, f"not rewritten by pytest: {plain}"


def test_what_the_collection_and_earlier_tests_left_is_out_of_the_collectors_reach():
    """`tests/conftest.py` freezes the heap after the collection and after each test: a collection in this test walks
    only what it made, not the modules and fixtures before it, and still frees this test's own cycles."""
    import gc
    import weakref

    assert gc.get_freeze_count() > 10_000, "pytest's and the test modules' objects are frozen"

    class Node:
        """An object that can refer to itself (a plain list could not be referred to weakly)."""

    cycle = Node()
    cycle.itself = cycle
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert gone() is None, "a cycle made while a test runs is not frozen"
