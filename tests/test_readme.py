"""The documentation stays true to the code: the messages the bad-input table of docs/cli.md quotes are still said,
every option of every command is named in docs/cli.md (a section lost in an edit shows up here), and the Python API
example of docs/formats.md runs."""

from __future__ import annotations

import re

from tests.conftest import REPO

PACKAGES = ("pipeline", "captioning", "embedding_cache", "train", "evaluation")


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


def test_pointers_into_the_readme_name_its_sections():
    """Comments in the Makefile and .ci/ that send a reader to a README section name one that exists."""
    readme = (REPO / "README.md").read_text()
    headings = {line.lstrip("#").strip() for line in readme.splitlines() if line.startswith("#")}
    pointers = []
    for path in [REPO / "Makefile", *sorted((REPO / ".ci").iterdir())]:
        pointers += [(path.name, name) for name in re.findall(r'README, "([^"]+)"', path.read_text())]
    assert pointers and all(name in headings for _, name in pointers), pointers


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
