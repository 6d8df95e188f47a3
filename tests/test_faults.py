"""A full disk or a read-only destination: one line, nothing half-published, and a rerun finishes the job.

The disk fills for real (RLIMIT_FSIZE in the child: writes past the limit fail with
EFBIG, as on a full disk); the read-only destination is a directory tree made
immutable (`chattr +i` as root, where permissions do not bind) or unwritable.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from embedding_cache.store import EmbeddingStore
from pipeline.core.recipes import sha256_file
from tests.support.commands import cli, run_command, tcjepa
from tests.support.training import sets, train_args


def _file_size_limit(max_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


# coverage.py, when it measures the commands, writes a data file of a few hundred KiB as each one exits.
COVERAGE_DATA_BYTES = 1 << 20


def _cli(*args: object, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """`tcjepa ARGS`, with files limited to `max_file_bytes`; under a limit too small for coverage.py's data file the
    command is not measured (its save would fail after the command's own error line)."""
    if max_file_bytes is None:
        return run_command(cli(*args), check=False)
    env = dict(os.environ)
    if max_file_bytes < COVERAGE_DATA_BYTES:
        env = {k: v for k, v in env.items() if not k.startswith("COVERAGE_PROCESS_")}
    return run_command(cli(*args), check=False, preexec_fn=_file_size_limit(max_file_bytes), env=env)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 and an `error:` line last, with no traceback (progress lines before it are fine)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and sum(x.startswith("error: ") for x in lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` with its sha256 (to show that nothing changed)."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


@contextmanager
def _read_only(root: Path) -> Iterator[None]:
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "-R", "+i", str(root)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without `chattr +i`: cannot make a directory read-only")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-R", "-i", str(root)], check=True)
    else:
        paths = [root, *root.rglob("*")]
        modes = {p: p.stat().st_mode for p in paths}
        for p in paths:
            p.chmod(modes[p] & 0o555)
        try:
            yield
        finally:
            for p in reversed(paths):
                p.chmod(modes[p])


def test_caption_import_with_a_full_disk_publishes_nothing_then_resumes(tmp_path, synth_dir):
    cache = tmp_path / "cache"
    full = _cli("caption", "--cache", cache, "--annotations", synth_dir / "captions.jsonl", max_file_bytes=4096)
    _assert_one_line_error(full, "cannot write", "File too large", "rerun")
    assert not any((cache / "captions").iterdir())
    assert tcjepa("cache", "verify", cache, "--no-progress").stdout.startswith("ok: 1 recipes, 0 shards")
    tcjepa("caption", "--cache", cache, "--annotations", synth_dir / "captions.jsonl")
    assert tcjepa("cache", "verify", cache, "--no-progress").stdout.startswith("ok: 1 recipes, 1 shards, 320 captions")


def test_embed_with_a_full_disk_publishes_nothing_then_resumes(tmp_path, annotated_cache, tiny_models):
    store = tmp_path / "store"
    args = [
        "embed",
        "--cache",
        annotated_cache,
        "--store",
        store,
        "--model",
        tiny_models / "t5",
        "--chunk-tokens",
        "64",
        "--shard-chunks",
        "4",
        "--no-progress",
    ]
    _assert_one_line_error(_cli(*args, max_file_bytes=16384), "cannot write", "File too large")
    assert EmbeddingStore(store).segment_ids() == [] and not (store / ".staging").exists()
    tcjepa(*args)
    verified = tcjepa("store", "verify", store, "--no-progress").stdout
    assert verified.startswith("ok: 1 segments, 320 captions"), verified


def test_train_with_a_full_disk_keeps_no_half_checkpoint_then_runs_whole(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    run = tmp_path / "run"
    every = sets("log_every=1", "val_every=4", "checkpoint_every=2")
    args = train_args(synth_dir / "images", annotated_cache, annotated_store, run, "--steps", "4", *every)
    # The limit is above a batch in shared memory (DataLoader workers), below a checkpoint.
    _assert_one_line_error(_cli(*args, max_file_bytes=4_000_000), "cannot write", "File too large")
    assert not (run / "checkpoint.pt").exists() and not list(run.glob(".checkpoint.pt.*"))
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    tcjepa(*args)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4], "the rerun starts over from step 1, without the stopped run's lines"


def test_read_only_destinations_fail_in_one_line_and_change_nothing(
    tmp_path, synth_dir, annotated_cache, annotated_store, tiny_models
):
    cache, store, locked = tmp_path / "cache", tmp_path / "store", tmp_path / "locked"
    shutil.copytree(annotated_cache, cache)
    shutil.copytree(annotated_store, store)
    locked.mkdir()
    other = tmp_path / "other.jsonl"
    other.write_text(
        "".join(
            json.dumps({"image": str(synth_dir / "images" / f"{i:06d}.png"), "captions": [f"another caption {i}"]})
            + "\n"
            for i in range(3)
        )
    )
    before = {"cache": _tree(cache), "store": _tree(store)}
    with _read_only(cache), _read_only(store), _read_only(locked):
        _assert_one_line_error(_cli("caption", "--cache", cache, "--annotations", other), "cannot access", "writable")
        complete = _cli(
            "embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", "--no-progress"
        )
        assert complete.returncode == 0 and "encoded 0 captions" in complete.stdout, "a complete store is only read"
        _assert_one_line_error(
            _cli("embed", "--cache", annotated_cache, "--store", locked / "new", "--model", tiny_models / "t5"),
            "cannot access",
            "writable",
        )
        train = train_args(synth_dir / "images", annotated_cache, annotated_store, locked / "run", "--steps", "2")
        _assert_one_line_error(_cli(*train), "cannot access", "writable")
    assert {"cache": _tree(cache), "store": _tree(store)} == before
    assert not any(locked.iterdir())
