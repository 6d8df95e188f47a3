"""The command line as a whole: one-line usage errors, the version."""

from __future__ import annotations

from importlib.metadata import version

from tests.support.commands import tcjepa


def test_usage_errors_are_one_line_with_where_the_help_is():
    for args, needle in (
        (["caption"], "Missing option '--cache'"),
        (["train", "--out", "x", "--no-such-flag"], "No such option: --no-such-flag"),
        (["synth", "--out", "x", "--n-images", "many"], "Invalid value for '--n-images'"),
        (["no-such-command"], "No such command"),
    ):
        proc = tcjepa(*args, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert needle in lines[0] and "--help" in lines[0], lines[0]


def test_version():
    proc = tcjepa("--version")
    assert proc.stdout.strip() == f"tcjepa {version('tcjepa')}"
