"""Caches and stores on object storage: an S3-compatible server (moto) on loopback, started by the tests themselves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from pipeline.errors import DataProblem
from pipeline.remote import mirror_cache, mirror_path, mirror_store
from tests.conftest import REPO, tcjepa
from tests.test_train import TINY

BUCKET = "tcjepa-test"


@pytest.fixture(scope="module")
def s3(annotated_cache, annotated_store):
    """The session's cache and store uploaded as plain trees (as `aws s3 sync` would), and the env that reaches them."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(str(annotated_cache), f"{BUCKET}/cache", recursive=True)
    fs.put(str(annotated_store), f"{BUCKET}/store", recursive=True)
    yield fs, {**os.environ}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_reads_a_remote_cache_and_store_through_a_local_mirror(tmp_path, s3, synth_dir, annotated_cache, annotated_store, capsys):
    _, env = s3
    common = [*TINY, "--steps", "2", "--set", "log_every=1", "--set", "val_every=2"]
    tcjepa("train", synth_dir / "images", "--cache", annotated_cache, "--store", annotated_store, "--out", tmp_path / "local", *common)
    remote = tcjepa("train", synth_dir / "images", "--cache", f"s3://{BUCKET}/cache", "--store", f"s3://{BUCKET}/store",
                    "--out", tmp_path / "remote", *common, "--set", f"mirror={tmp_path / 'mirror'}", env=env)
    assert "1 new of 1 shards" in remote.stderr and "1 new of 1 segments" in remote.stderr
    local, remote_lines = _metrics(tmp_path / "local"), _metrics(tmp_path / "remote")
    assert len(remote_lines) == len(local) == 3
    assert remote_lines == [{**m, "images_per_s": r["images_per_s"]} if "images_per_s" in m else m for m, r in zip(local, remote_lines)]
    mirror_store(f"s3://{BUCKET}/store", tmp_path / "mirror")
    assert "0 new of 1 segments" in capsys.readouterr().err, "a second mirror fetches only what is new"
    saved = yaml.safe_load((tmp_path / "remote" / "config.yaml").read_text())
    assert saved["store"] == f"s3://{BUCKET}/store", "the run records where its data lives, not the mirror"
    assert tcjepa("store", "verify", mirror_path(f"s3://{BUCKET}/store", tmp_path / "mirror"), "--no-progress").stdout.startswith("ok: ")
    env = {**env, "HOME": str(tmp_path / "home")}  # the default mirror lives under ~/.cache
    assert tcjepa("cache", "verify", f"s3://{BUCKET}/cache", "--no-progress", env=env).stdout.startswith("ok: 1 recipes, 1 shards, 320 captions")
    assert tcjepa("store", "verify", f"s3://{BUCKET}/store", "--no-progress", env=env).stdout.startswith("ok: 1 segments, 320 captions")


def test_damaged_remote_files_are_never_used(tmp_path, s3):
    fs, _ = s3
    shard = next(p for p in fs.find(f"{BUCKET}/store/segments") if "/tokens/c/" in p)
    good = fs.cat_file(shard)
    fs.pipe_file(shard, bytes([good[0] ^ 1]) + good[1:])
    try:
        with pytest.raises(DataProblem, match="tokens do not match the sha256"):
            mirror_store(f"s3://{BUCKET}/store", tmp_path / "mirror")
        assert not any((mirror_path(f"s3://{BUCKET}/store", tmp_path / "mirror") / "segments").glob("*/tokens"))
        # `store verify URL` fetches afresh: a mirror filled earlier (by the training test) does not hide the damage
        bad = tcjepa("store", "verify", f"s3://{BUCKET}/store", "--no-progress", check=False, env=s3[1])
        assert bad.returncode == 1 and "tokens do not match the sha256" in bad.stderr
    finally:
        fs.pipe_file(shard, good)
    parquet = next(iter(fs.glob(f"{BUCKET}/cache/captions/*.parquet")))
    good = fs.cat_file(parquet)
    fs.pipe_file(parquet, good[:-1] + bytes([good[-1] ^ 1]))
    try:
        with pytest.raises(DataProblem, match="does not match the sha256 recorded"):
            mirror_cache(f"s3://{BUCKET}/cache", tmp_path / "mirror")
    finally:
        fs.pipe_file(parquet, good)


def test_writers_refuse_object_storage_in_one_line(tmp_path, s3, synth_dir):
    _, env = s3
    proc = tcjepa("caption", "--cache", f"s3://{BUCKET}/new-cache", "--annotations", synth_dir / "captions.jsonl", check=False, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "writing to object storage is not supported" in proc.stderr
    assert not (REPO / "s3:").exists()
