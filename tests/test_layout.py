"""The layout's promise: arrows between packages point one way, and so do those between modules.

A unit is a subpackage (``pipeline.core``) or a top-level package's own modules
(``pipeline`` = cli, demo). Every import statement counts: module level, inside
functions, and under ``TYPE_CHECKING``. Modules inside one unit may import each other,
but no module may reach itself through its imports: an import inside a function hides
such a circle from Python, not from the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.repo import REPO

PACKAGES = ("pipeline", "captioning", "embedding_cache", "train", "evaluation")


def unit_of(module: str) -> str | None:
    """The unit a dotted module name belongs to, or None outside the project."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    package_dir = REPO.joinpath(*parts[:2])
    if len(parts) >= 2 and package_dir.is_dir() and (package_dir / "__init__.py").exists():
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pipeline import core`
    return found


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            source = unit_of(module_name(path))
            assert source is not None
            targets = graph.setdefault(source, set())
            for name in imported_modules(path):
                target = unit_of(name)
                if (
                    target is not None
                    and target != source
                    and (
                        REPO.joinpath(*name.split(".")).with_suffix(".py").exists()
                        or REPO.joinpath(*name.split(".")).is_dir()
                    )
                ):
                    targets.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first repeated last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_between_units() -> None:
    graph = unit_graph()
    assert {
        "pipeline",
        "pipeline.core",
        "pipeline.devkit",
        "captioning",
        "embedding_cache",
        "train",
        "evaluation",
    } <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between units: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_stages_stand_on_the_ground_not_on_the_cli() -> None:
    """Shared ground imports no stage; no stage imports the CLI, the demo or the development kit."""
    graph = unit_graph()
    assert graph["pipeline.core"] == set(), graph["pipeline.core"]
    for stage in ("captioning", "embedding_cache", "train", "evaluation"):
        assert not graph[stage] & {"pipeline", "pipeline.devkit"}, (stage, graph[stage])
    assert "evaluation" not in graph["train"], "train must not import evaluation (evaluation reads runs)"


def module_graph() -> dict[str, set[str]]:
    """Every module of the project and the project modules its import statements name (anywhere in the file)."""
    paths = {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}
    return {
        module: {name for name in imported_modules(path) if name in paths and name != module}
        for module, path in paths.items()
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan), each sorted; a module on no circle is one alone."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_circle_between_modules() -> None:
    """No module imports, directly or through others, a module that imports it back, even from inside a function."""
    graph = module_graph()
    assert {"pipeline.cli", "pipeline.core.sources", "captioning.job", "embedding_cache.job", "train.loop"} <= set(
        graph
    )
    circles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            inside = set(component)
            cycle = find_cycle({m: graph[m] & inside for m in component})
            assert cycle is not None
            circles.append(" -> ".join(cycle))
    assert not circles, "import circles between modules: " + "; ".join(circles)


def test_the_component_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"]]


# The CLI and what is the demo command's face may print: their prints are the commands' own output (the demo's
# `[demo]` lines and its table, on stdout, which tests read). Every other module says what it has to say through its
# logger (`pipeline.core.logs`), so that one setup decides what each process shows.
PRINTING = {"pipeline/cli.py", "pipeline/demo.py", "pipeline/devkit/scenes.py"}


def speaking(source: str, name: str) -> list[str]:
    """Where the module `name` (its `source`) calls `print` or takes a `say` argument (a flag a caller threads down
    to silence it)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"{name}:{node.lineno}: print(")
        elif isinstance(node, ast.arguments):
            arguments = [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
            found += [f"{name}:{a.lineno}: say" for a in arguments if a is not None and a.arg == "say"]
    return found


def test_library_modules_log_instead_of_printing() -> None:
    """No module of the project prints or takes a `say` flag, but the CLI and the demo's face (`PRINTING`)."""
    paths = {
        str(path.relative_to(REPO)): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
    }
    assert set(paths) >= PRINTING
    found = [line for name, path in paths.items() if name not in PRINTING for line in speaking(path.read_text(), name)]
    assert not found, "say it through the module's logger (logging.getLogger(__name__)):\n" + "\n".join(found)


def test_the_print_finder_finds_prints_and_say_flags() -> None:
    code = "def f(x, say: bool = True):\n    print(x)\n\nlambda say: say\ndef g(*, say=False): pass\nlog.print(x)\n"
    found = speaking(code, "m.py")
    assert sorted(found) == ["m.py:1: say", "m.py:2: print(", "m.py:4: say", "m.py:5: say"], found
