"""Image tar shards on object storage (moto S3 on loopback): listed as the same shards on disk are, read by byte range
while the index is built, fetched per node into a mirror and checked member by member against the index."""

from __future__ import annotations

import gzip
import hashlib
import tarfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.errors import DataProblem, UserError
from pipeline.core.refs import ImageRef
from pipeline.core.remote_tars import ShardMembers, fetch_shards, shard_mirror
from pipeline.core.sources import list_images, read_images
from tests.support.commands import cli, torchrun, two_nodes
from tests.support.object_servers import s3_bucket
from tests.support.processes import finish, start
from tests.support.training import TINY_TRAIN, assert_close_runs, metrics, sets

pytestmark = pytest.mark.s3
BUCKET = "tcjepa-tars"


@pytest.fixture(scope="module")
def bucket(s3_server):
    """An s3fs file system on the session's server, with this module's bucket."""
    return s3_bucket(s3_server, BUCKET)


def _write_shard(path: Path, images: list[Path], prefix: str = "") -> None:
    """An uncompressed WebDataset-style shard: each image with a caption member beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for image in images:
            tar.add(image, arcname=f"{prefix}{image.name}")
            caption = path.parent / f"{image.stem}.txt"
            caption.write_text("a caption")
            tar.add(caption, arcname=f"{prefix}{image.stem}.txt")
            caption.unlink()


def _sha(data: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(data).digest(), np.uint8)


def _members(refs: list[ImageRef], local: Path) -> ShardMembers:
    """What an index built from the shard at `local` would hold for these members."""
    data = local.read_bytes()
    return ShardMembers(
        np.array([r.offset for r in refs], np.int64),
        np.array([r.size for r in refs], np.int64),
        np.stack([_sha(data[r.offset : r.offset + r.size]) for r in refs]),
        [r.source_id for r in refs],
    )


def test_remote_shards_list_and_read_as_the_same_shards_on_disk(tmp_path, bucket, s3_env, synth_dir):
    images = sorted((synth_dir / "images").iterdir())
    local = tmp_path / "tars"
    # `a/b.tar` sorts before `a-b.tar` in a local folder (by path parts); a long member name takes extra header blocks
    _write_shard(local / "a-b.tar", images[:3])
    _write_shard(local / "a" / "b.tar", images[3:6], prefix=f"{'deep/' * 30}")
    _write_shard(local / "z.tar", images[6:8])
    (local / "notes.txt").write_text("not a shard")
    bucket.put(str(local), f"{BUCKET}/listed", recursive=True)

    here = list_images([local])
    there = list_images([f"s3://{BUCKET}/listed"])
    assert [r.source_id for r in there] == [r.source_id for r in here]
    assert here[0].source_id.startswith("a/b.tar::deep/") and len(here) == 8
    assert [(r.offset, r.size, r.kind) for r in there] == [(r.offset, r.size, r.kind) for r in here]
    assert {r.path for r in there} == {f"s3://{BUCKET}/listed/{name}" for name in ("a-b.tar", "a/b.tar", "z.tar")}
    one = list_images([f"s3://{BUCKET}/listed/z.tar"])
    assert [r.source_id for r in one] == [r.source_id for r in list_images([local / "z.tar"])]
    assert list(read_images(there)) == list(read_images(here)), "members read by byte range are the bytes on disk"


def test_remote_inputs_that_cannot_be_read_are_refused_in_one_line(tmp_path, bucket, s3_env, synth_dir):
    shard = tmp_path / "s.tar"
    _write_shard(shard, sorted((synth_dir / "images").iterdir())[:2])
    bucket.pipe_file(f"{BUCKET}/gz/s.tar.gz", gzip.compress(shard.read_bytes()))
    with pytest.raises(UserError, match=r"s3://.*/gz/s.tar.gz: compressed tar shard; .* decompress it first"):
        list_images([f"s3://{BUCKET}/gz"])
    with pytest.raises(UserError, match=r"^s3://tcjepa-tars/absent.tar: no such object or prefix$"):
        list_images([f"s3://{BUCKET}/absent.tar"])
    bucket.pipe_file(f"{BUCKET}/loose/x.png", b"png")
    with pytest.raises(UserError, match="holds 1 image or Parquet files besides tar shards"):
        list_images([f"s3://{BUCKET}/loose"])
    with pytest.raises(UserError, match="no such file or directory"):  # local inputs are checked before remote ones
        list_images([tmp_path / "absent", f"s3://{BUCKET}/gz"])


def test_a_fetched_shard_is_checked_against_the_index_and_a_killed_fetch_resumes(tmp_path, bucket, s3_env, synth_dir):
    local = tmp_path / "shard-0.tar"
    _write_shard(local, sorted((synth_dir / "images").iterdir())[:6])
    url = f"s3://{BUCKET}/fetch/shard-0.tar"
    bucket.put_file(str(local), url)
    refs = list_images([url])
    members = {url: _members(refs, local)}
    good = local.read_bytes()

    mirror = tmp_path / "mirror"
    done = fetch_shards(members, mirror)
    copy = shard_mirror(url, mirror)
    assert (done.shards, done.fetched, done.bytes) == (1, 1, len(good)) and copy.read_bytes() == good
    assert fetch_shards(members, mirror).fetched == 0, "a checked copy is not fetched again"
    damaged = bytearray(good)
    damaged[refs[0].offset] ^= 0xFF
    copy.write_bytes(bytes(damaged))
    assert fetch_shards(members, mirror).fetched == 0, "a copy once checked is trusted on later starts"
    assert fetch_shards(members, mirror, recheck=True).fetched == 1 and copy.read_bytes() == good, "unless rechecked"

    # Killed mid-download: what it left is continued (the same bytes) or, when it is not the shard, fetched afresh.
    for left in (good[: len(good) // 2], b"\0" * (len(good) // 3)):
        resumed = tmp_path / f"resumed-{len(left)}"
        part = shard_mirror(url, resumed)
        part = part.with_name(f".{part.name}.part")
        part.parent.mkdir(parents=True)
        part.write_bytes(left)
        assert fetch_shards(members, resumed).fetched == 1
        assert shard_mirror(url, resumed).read_bytes() == good and not part.exists()

    # Changed on the remote side after the index was built: refused, and nothing of it is left in the mirror.
    victim = refs[2]
    changed = bytearray(good)
    changed[victim.offset] ^= 0xFF
    bucket.pipe_file(url, bytes(changed))
    fresh = tmp_path / "fresh"
    with pytest.raises(DataProblem, match=rf"^{url}: image shard-0.tar::{victim.source_id.split('::')[1]} does not "):
        fetch_shards(members, fresh)
    assert [p.name for p in shard_mirror(url, fresh).parent.iterdir()] == [".mirror.lock"]

    # A new index of the changed shard: the copy checked for the old one no longer passes, and is fetched anew.
    local.write_bytes(bytes(changed))
    again = fetch_shards({url: _members(refs, local)}, mirror)
    assert again.fetched == 1 and copy.read_bytes() == bytes(changed)


@pytest.mark.slow
@pytest.mark.distributed
def test_partitioned_nodes_fetch_only_their_shards_and_train_as_on_the_local_copies(
    tmp_path, bucket, s3_env, synth_dir
):
    """Four shards of ten images on S3 and `--partitions 4` without text on two nodes (two torchrun agents, each its
    own HOME and so its own mirror): each node fetches its two partitions' shards, and the run trains exactly as one
    process does on local copies of the shards."""
    from train.data_index import TrainIndex
    from train.partitions import node_partitions, node_shards, partition_run

    images = sorted((synth_dir / "images").iterdir())
    shards = tmp_path / "shards"
    for k in range(4):
        _write_shard(shards / f"shard-{k}.tar", images[10 * k : 10 * (k + 1)])
    url = f"s3://{BUCKET}/e2e"
    bucket.put(str(shards), f"{BUCKET}/e2e", recursive=True)

    common = [*TINY_TRAIN, "--conditioning", "none", "--partitions", "4", "--steps", "3"]
    common += sets("log_every=1", "val_every=2", "checkpoint_every=3", "bf16=false")
    one = start(cli("train", shards, "--out", tmp_path / "local", *common))
    command = torchrun("train", url, "--out", tmp_path / "remote", *common, launch=two_nodes("tars"))
    nodes = [start(command, env={**s3_env, "HOME": str(tmp_path / f"node{k}")}) for k in range(2)]
    errs = [err for _, err in finish([*nodes, one], timeout=300)[:2]]
    assert_close_runs(metrics(tmp_path / "local"), metrics(tmp_path / "remote"))

    index = TrainIndex.load(tmp_path / "remote" / "index.parquet")
    assert {r.path for r in index.refs} == {f"{url}/shard-{k}.tar" for k in range(4)}, "the saved index names URLs"
    split = partition_run(index, 4, 8, 0, by_segment=False)
    held = []
    for k in range(2):
        expected = node_shards(index, split, node_partitions(k, 2, 4))
        mirror = tmp_path / f"node{k}" / ".cache" / "tcjepa" / "mirror"
        fetched = sorted(p.name for p in shard_mirror(f"{url}/x.tar", mirror).parent.glob("*.tar"))
        assert fetched == sorted(u.rsplit("/", 1)[1] for u in expected.urls) and len(fetched) == 2
        held += fetched
        said = f"node {k} of 2: 2 of the 4 image shards the run reads"
        assert any(said in err for err in errs), errs
    assert sorted(held) == [f"shard-{k}.tar" for k in range(4)], "the nodes' shards are disjoint"
