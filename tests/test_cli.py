"""The command line as a whole: one-line usage errors, the version, and `train`'s options as config keys."""

from __future__ import annotations

import dataclasses
from importlib.metadata import version

import typer

from pipeline.cli import CONFIG_KEYS, NOT_CONFIG, app, config_flags
from tests.support.commands import tcjepa
from train.config import TrainConfig


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


def test_every_train_option_is_a_config_key_or_named_as_none():
    """`train` reads its config flags by name (`config_flags`): each of its parameters is a TrainConfig field, its
    help and default the field's (`config_option`), or one of the few NOT_CONFIG names. A flag that sets no field,
    or a field renamed under its flag, fails here (a renamed field already fails where `config_option` reads it)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    params = typer.main.get_command(app).commands["train"].params
    names = {p.name for p in params}
    assert set(NOT_CONFIG) <= names and set(CONFIG_KEYS) <= names, "NOT_CONFIG or CONFIG_KEYS name no parameter"
    keys = {p.name: CONFIG_KEYS.get(p.name, p.name) for p in params if p.name not in NOT_CONFIG}
    assert not {name: key for name, key in keys.items() if key not in fields}, "train options that set no config key"
    for param in params:
        if param.name in keys:
            key = keys[param.name]
            assert f"(config key {key}; default: {getattr(TrainConfig(), key)})" in (param.help or ""), param.name
    assert {"images", "cache", "store", "recipes", "lr", "compile", "log"} <= set(keys.values())


def test_train_gives_the_config_keys_of_the_flags_on_its_command_line():
    """What the command parses (click's `ctx.params`) becomes config keys: renamed ones under their key, flags not
    given left out, and the options that are not config keys never among them."""
    command = typer.main.get_command(app).commands["train"]
    args = ["a", "b", "--out", "r", "--recipe", "x", "--compile", "--no-fsdp", "--lr", "0.5", "--log", "wandb"]
    ctx = command.make_context("train", [*args, "--set", "steps=3", "--no-progress", "--resume"])
    assert config_flags(ctx.params) == {
        "images": ["a", "b"],
        "recipes": ["x"],
        "compile": True,
        "fsdp": False,
        "lr": 0.5,
        "log": ["wandb"],
    }
    assert config_flags(command.make_context("train", ["--out", "r"]).params) == {}
