"""The README and docs/ stay true to the code: the messages the bad-input table of docs/cli.md quotes are still said,
every option of every command is named in docs/cli.md (a section lost in an edit shows up here), the Python API
example of docs/formats.md runs, the README stays short, and every relative link and every pointer from the code into
the documentation leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.repo import REPO

PACKAGES = ("pipeline", "captioning", "embedding_cache", "train", "evaluation")
README_MAX_LINES = 300


def documentation() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in prose_lines(path.read_text()) if re.match(r"#+ ", line)]


def anchors(path: Path) -> set[str]:
    """The fragment GitHub gives each heading: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in headings(path):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_every_quoted_message_is_in_the_code():
    cli = (REPO / "docs" / "cli.md").read_text()
    table = cli.split("<!-- bad-input:begin -->")[1].split("<!-- bad-input:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) >= 20
    source = "\n".join(p.read_text() for package in PACKAGES for p in (REPO / package).rglob("*.py"))
    missing = [
        phrase for row in rows for phrase in re.findall(r'"([^"]+)"', row.rsplit("|", 2)[1]) if phrase not in source
    ]
    assert not missing, f"docs/cli.md quotes messages the code no longer says: {missing}"


def test_every_option_of_every_command_is_in_the_cli_reference():
    import typer

    from pipeline.cli import app

    def commands(command, name=""):
        if hasattr(command, "commands"):
            for sub_name, sub in command.commands.items():
                yield from commands(sub, f"{name} {sub_name}".strip())
        else:
            yield name, command

    cli = (REPO / "docs" / "cli.md").read_text()
    found = list(commands(typer.main.get_command(app)))
    assert {"caption", "embed", "train", "eval", "demo", "cache verify", "store verify"} <= {name for name, _ in found}
    missing = [
        f"{name} {options[0]}"
        for name, command in found
        for param in command.params
        if (options := [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")])
        and not any(o in cli for o in options)
    ]
    assert not missing, f"options docs/cli.md never names: {missing}"


def test_pointers_into_the_documentation_name_its_sections():
    """Comments in the Makefile, .ci/ and the code that send a reader to a section (`README, "Install"`,
    `docs/cli.md, "vLLM on CPU"`) name a heading that exists in that file."""
    sources = [REPO / "Makefile", *sorted((REPO / ".ci").iterdir())]
    sources += [p for package in (*PACKAGES, "benchmarks") for p in sorted((REPO / package).rglob("*.py"))]
    pointers = [
        (path.relative_to(REPO).as_posix(), document, section)
        for path in sources
        for document, section in re.findall(r'(README|docs/[\w-]+\.md),\s+"([^"]+)"', path.read_text())
    ]
    assert {"Makefile", "pipeline/devkit/tiny_models.py", "captioning/vllm_engine.py"} <= {p[0] for p in pointers}
    wrong = []
    for source, document, section in pointers:
        path = REPO / ("README.md" if document == "README" else document)
        names = {heading.replace("`", "") for heading in headings(path)} if path.is_file() else set()
        if section.replace("`", "") not in names:
            wrong.append((source, document, section))
    assert not wrong, f"pointers to sections that do not exist: {wrong}"


def test_the_python_api_example_runs(tmp_path, monkeypatch):
    """docs/formats.md's "a store from your own vectors" example runs as printed, in a fresh directory."""
    formats = (REPO / "docs" / "formats.md").read_text()
    section = formats.split("## Python API: a store from your own vectors")[1]
    code = section.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "docs/formats.md", "exec"), namespace)
    assert namespace["tokens"].shape == (14, 512) and namespace["offsets"].tolist() == [0, 7, 14]
    assert (tmp_path / "my-store" / "zarr.json").is_file()


def test_the_readme_is_short_and_keeps_what_users_need():
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the detail belongs in docs/"
    assert "make demo" in readme and "make test" in readme
    assert {"Install", "Status", "Citation", "License"} <= set(headings(REPO / "README.md"))
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", readme))
    assert {"docs/cli.md", "docs/formats.md", "docs/cluster.md", "docs/development.md", "docs/experiments.md"} <= linked


def test_every_relative_link_leads_somewhere():
    """Each relative link in the README and docs/ names a file that exists, and a heading in it when it has a #."""
    broken = []
    for document in documentation():
        for line in prose_lines(document.read_text()):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                name, _, fragment = target.partition("#")
                path = (document.parent / name).resolve() if name else document
                if not path.exists() or (fragment and fragment not in set(anchors(path))):
                    broken.append(f"{document.relative_to(REPO)}: {target}")
    assert not broken, f"links that lead nowhere: {broken}"
