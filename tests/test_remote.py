"""Caches and stores on object storage: an S3-compatible server (moto) and Azure Blob storage (Azurite) on loopback,
started by the tests themselves; the tests that write run on both."""

from __future__ import annotations

import hashlib
import json
import shutil
from typing import Any

import numpy as np
import pytest
import yaml

from captioning.remote_cache import mirror_cache
from embedding_cache.remote_store import mirror_store
from pipeline.core.errors import DataProblem
from pipeline.core.remote import mirror_path
from tests.support.commands import start_tcjepa, tcjepa, torchrun, two_nodes
from tests.support.object_servers import s3_bucket
from tests.support.processes import finish, kill_when, start
from tests.support.repo import REPO
from tests.support.stores import assert_same_embeddings
from tests.support.training import EXACT_STEPS, TINY_TRAIN, assert_close_runs, metrics

pytestmark = pytest.mark.s3
BUCKET = "tcjepa-test"


@pytest.fixture(scope="module")
def uploaded(s3_server, annotated_cache, annotated_store):
    """The session's cache and store uploaded as plain trees (as `aws s3 sync` would), once per module."""
    fs = s3_bucket(s3_server, BUCKET)
    fs.put(str(annotated_cache), f"{BUCKET}/cache", recursive=True)
    fs.put(str(annotated_store), f"{BUCKET}/store", recursive=True)
    return fs


@pytest.fixture
def s3(uploaded, s3_env):
    """(file system, environment of the subprocesses) for a test on the uploaded bucket."""
    return uploaded, s3_env


@pytest.mark.slow
def test_train_reads_a_remote_cache_and_store_through_a_local_mirror(
    tmp_path, s3, synth_dir, annotated_cache, annotated_store, capsys
):
    _, env = s3
    common = [*TINY_TRAIN, "--steps", "2", "--set", "log_every=1", "--set", "val_every=2"]
    tcjepa(
        "train",
        synth_dir / "images",
        "--cache",
        annotated_cache,
        "--store",
        annotated_store,
        "--out",
        tmp_path / "local",
        *common,
    )
    remote = tcjepa(
        "train",
        synth_dir / "images",
        "--cache",
        f"s3://{BUCKET}/cache",
        "--store",
        f"s3://{BUCKET}/store",
        "--out",
        tmp_path / "remote",
        *common,
        "--set",
        f"mirror={tmp_path / 'mirror'}",
        env=env,
    )
    assert "1 new of 1 shards" in remote.stderr and "1 new of 1 segments" in remote.stderr
    local, remote_lines = metrics(tmp_path / "local"), metrics(tmp_path / "remote")
    assert len(remote_lines) == len(local) == 3
    assert remote_lines == [
        {**m, "images_per_s": r["images_per_s"]} if "images_per_s" in m else m for m, r in zip(local, remote_lines)
    ]
    mirror_store(f"s3://{BUCKET}/store", tmp_path / "mirror")
    assert "0 new of 1 segments" in capsys.readouterr().err, "a second mirror fetches only what is new"
    with pytest.raises(DataProblem, match="segment gone-segment is not published there .* train with a new --out"):
        # what a saved index names, rebuilt away
        mirror_store(f"s3://{BUCKET}/store", tmp_path / "mirror", only={"gone-segment"})
    saved = yaml.safe_load((tmp_path / "remote" / "config.yaml").read_text())
    assert saved["store"] == f"s3://{BUCKET}/store", "the run records where its data lives, not the mirror"
    assert tcjepa(
        "store", "verify", mirror_path(f"s3://{BUCKET}/store", tmp_path / "mirror"), "--no-progress"
    ).stdout.startswith("ok: ")
    env = {**env, "HOME": str(tmp_path / "home")}  # the default mirror lives under ~/.cache
    assert tcjepa("cache", "verify", f"s3://{BUCKET}/cache", "--no-progress", env=env).stdout.startswith(
        "ok: 1 recipes, 1 shards, 320 captions"
    )
    assert tcjepa("store", "verify", f"s3://{BUCKET}/store", "--no-progress", env=env).stdout.startswith(
        "ok: 1 segments, 320 captions"
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_training_fetches_only_the_segments_that_hold_its_captions(
    tmp_path, s3, synth_dir, annotated_cache, annotated_store
):
    """A remote store of two segments (the first 12 images' captions, then the rest) and a run on those 12 images on
    two nodes: rank 0 builds the index from the store's keys, and each node fetches only the segment holding its
    captions. The metrics match a one-process run on the local store."""
    from captioning.cache import CaptionCache
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import RemoteEmbeddingStore
    from embedding_cache.store import EmbeddingStore, TokenLayout

    _, env = s3
    subset = tmp_path / "images"
    subset.mkdir()
    for image in sorted((synth_dir / "images").iterdir())[:12]:
        shutil.copy(image, subset / image.name)
    shas = {hashlib.sha256(p.read_bytes()).hexdigest() for p in subset.iterdir()}
    table = CaptionCache(annotated_cache).read_captions(columns=["image_sha256", "text_sha256"]).to_pylist()
    ours = {row["text_sha256"] for row in table if row["image_sha256"] in shas}
    local = EmbeddingStore(annotated_store)
    url = f"s3://{BUCKET}/two-segment-store"
    remote = RemoteEmbeddingStore.open_or_create(url, local.encoder, local.width, tmp_path / "writer")
    reader = EmbeddingReader(annotated_store)
    all_keys = np.concatenate([local.read_keys(s) for s in local.segment_ids()])
    for chosen in (
        [k for k in all_keys if k.tobytes().hex() in ours],
        [k for k in all_keys if k.tobytes().hex() not in ours],
    ):
        writer = remote.new_segment(TokenLayout(64, 4))
        for key in chosen:
            writer.append(key.tobytes(), reader.get_key(key.tobytes()))
        writer.finish()
        remote.publish(writer)

    common = [*TINY_TRAIN, "--steps", "2", "--set", "log_every=1", "--set", "val_every=2", "--set", "bf16=false"]
    tcjepa(
        "train",
        subset,
        "--cache",
        annotated_cache,
        "--store",
        annotated_store,
        "--out",
        tmp_path / "local",
        *common,
        env=env,
    )
    # Two nodes of one process each (two torchrun agents meeting at a c10d rendezvous), each with its own HOME and
    # so its own default mirror, as on two machines.
    args = ["train", subset, "--cache", f"s3://{BUCKET}/cache", "--store", url, "--out", tmp_path / "remote", *common]
    command = torchrun(*args, launch=two_nodes("subset"))
    nodes = [start(command, env={**env, "HOME": str(tmp_path / f"node{k}")}) for k in range(2)]
    errs = [err for _, err in finish(nodes, timeout=300)]
    assert sum("1 new of 1 segments this run needs (the store has 2)" in err for err in errs) == 2, errs
    for k in range(2):
        mirrors = tmp_path / f"node{k}" / ".cache" / "tcjepa" / "mirror"
        fetched = mirror_path(url, mirrors) / "segments"
        assert len(list(fetched.glob("*/tokens"))) == 1, "the other segment's tokens are never fetched"
        assert (
            mirror_path(url, mirrors, suffix="-keys").exists() == mirror_path(f"s3://{BUCKET}/cache", mirrors).exists()
        ), "only the node of rank 0 reads the store's keys and the cache, to build the index"
    assert_close_runs(metrics(tmp_path / "local"), metrics(tmp_path / "remote"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_partitioned_nodes_read_only_their_segments_and_match_one_node_and_resume_on_one(
    tmp_path, s3, synth_dir, annotated_cache, annotated_store
):
    """A remote store of four segments (the captions of four groups of 10 images) and `--partitions 4`: two nodes
    train exactly as one does, each fetching only its two partitions' segments; stopped at step 4, the run
    continues on one node (which fetches the rest) as if it had never stopped."""
    from captioning.cache import CaptionCache
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import RemoteEmbeddingStore
    from embedding_cache.store import EmbeddingStore, TokenLayout
    from train.data_index import TrainIndex
    from train.partitions import node_partitions, node_segments, partition_run

    _, env = s3
    images = sorted((synth_dir / "images").iterdir())
    table = CaptionCache(annotated_cache).read_captions(columns=["image_sha256", "text_sha256"]).to_pylist()
    local = EmbeddingStore(annotated_store)
    reader = EmbeddingReader(annotated_store)
    url = f"s3://{BUCKET}/four-segment-store"
    remote = RemoteEmbeddingStore.open_or_create(url, local.encoder, local.width, tmp_path / "writer")
    written: set[str] = set()
    for group in range(4):
        shas = {hashlib.sha256(p.read_bytes()).hexdigest() for p in images[10 * group : 10 * (group + 1)]}
        keys = sorted({row["text_sha256"] for row in table if row["image_sha256"] in shas} - written)
        written |= set(keys)
        writer = remote.new_segment(TokenLayout(64, 4))
        for key in keys:
            writer.append(bytes.fromhex(key), reader.get_key(bytes.fromhex(key)))
        writer.finish()
        remote.publish(writer)

    keep = ["--partitions", "4", "--set", "checkpoint_keep=4"]
    args = ["train", synth_dir / "images", "--cache", f"s3://{BUCKET}/cache", "--store", url, *TINY_TRAIN]
    args += [*EXACT_STEPS, *keep]
    tcjepa(*args, "--out", tmp_path / "one", env={**env, "HOME": str(tmp_path / "one-node")})
    command = torchrun(*args, "--out", tmp_path / "two", launch=two_nodes("partitions"))
    nodes = [start(command, env={**env, "HOME": str(tmp_path / f"node{k}")}) for k in range(2)]
    errs = [err for _, err in finish(nodes, timeout=400)]
    assert_close_runs(metrics(tmp_path / "one"), metrics(tmp_path / "two"))

    index = TrainIndex.load(tmp_path / "two" / "index.parquet")
    split = partition_run(index, 4, 8, 0, by_segment=True)
    for k in range(2):
        expected = node_segments(index, split, node_partitions(k, 2, 4))
        fetched = mirror_path(url, tmp_path / f"node{k}" / ".cache" / "tcjepa" / "mirror") / "segments"
        assert sorted(p.parent.name for p in fetched.glob("*/tokens")) == sorted(expected.names)
        assert len(expected.names) == 2 and expected.shared == 0, "the groups share no caption text"
        said = f"node {k} of 2: partitions {2 * k}–{2 * k + 1} of 4, 2 of the 4 store segments the run reads, 0 of"
        assert any(said in err for err in errs), errs

    # Back to the checkpoint of step 4 (as if the two nodes had stopped there), then on one node.
    run = tmp_path / "two"
    shutil.copy(run / "checkpoints" / "step-00000004.pt", run / "checkpoint.pt")
    for later in (6, 8):
        for path in (run / "checkpoints").glob(f"step-{later:08d}.*"):
            path.unlink()
    resumed = tcjepa(*args, "--out", run, env={**env, "HOME": str(tmp_path / "node0")}, fresh=True)
    assert "resuming" in resumed.stderr and "2 new of 4 segments this run needs" in resumed.stderr
    assert_close_runs(metrics(tmp_path / "one"), metrics(run))


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


def test_a_commit_that_loses_the_race_for_its_log_entry_publishes_only_what_is_new(tmp_path, object_bucket):
    """Two hosts (two mirrors) on one remote cache (s3://, az://): B publishes first, A's entry number is taken, A
    looks again."""
    from captioning.annotations import PROMPT_ID
    from captioning.cache import caption_row
    from captioning.remote_cache import RemoteCaptionCache

    fs, root, bucket, env = object_bucket
    url = f"{root}/raced-cache"
    a = RemoteCaptionCache.open_or_create(url, tmp_path / "host-a")
    b = RemoteCaptionCache.open_or_create(url, tmp_path / "host-b")
    recipe = {"kind": "annotations", "test": "race"}
    assert a.add_recipe(recipe, "first") == b.add_recipe(recipe, "second")
    digest = a.add_recipe(recipe)
    rows = [
        caption_row(f"{i // 4:064x}", f"img{i // 4}", digest, PROMPT_ID, i % 4, f"caption {i}", "stop")
        for i in range(320)
    ]
    assert b.commit(rows[:200]).captions_added == 200
    result = a.commit(rows[100:])
    assert (result.captions_added, result.captions_duplicate) == (120, 100)
    assert a.commit(rows).captions_added == 0, "the mirror now holds everything"
    assert len(fs.ls(f"{bucket}/raced-cache/log")) == 2
    assert len(fs.ls(f"{bucket}/raced-cache/captions")) == 2, "the losing upload was withdrawn"
    report = tcjepa("cache", "verify", url, "--no-progress", env=env)
    assert report.stdout.startswith("ok: 1 recipes, 2 shards, 320 captions"), report.stdout
    assert a.recipes()[digest].name == b.recipes()[digest].name == "first", "the first writer's recipe name wins"

    # the cache deleted and made anew under the same URL: the old mirror is emptied, not taken for the new cache
    fs.rm(f"{bucket}/raced-cache", recursive=True)
    fresh = RemoteCaptionCache.open_or_create(url, tmp_path / "host-a")
    assert fresh.info().captions == 0 and not fresh.recipes()
    digest = fresh.add_recipe(recipe)
    assert fresh.commit(rows[:10]).captions_added == 10


def test_a_lost_race_whose_rows_nobody_published_is_won_by_the_same_upload(tmp_path, object_bucket):
    """A cache commit and a store segment whose entry numbers another writer took, with rows and keys of their own:
    after catching up, each tries its entry again for the upload it made (one upload each, nothing withdrawn), as
    a writer must to ever win against one that has nothing to catch up on."""
    from captioning.annotations import PROMPT_ID
    from captioning.cache import caption_row
    from captioning.remote_cache import RemoteCaptionCache, collect_cache_garbage
    from embedding_cache.remote_store import RemoteEmbeddingStore, collect_store_garbage
    from embedding_cache.store import TokenLayout

    fs, root, bucket, env = object_bucket
    a = RemoteCaptionCache.open_or_create(f"{root}/cache", tmp_path / "cache-a")
    b = RemoteCaptionCache.open_or_create(f"{root}/cache", tmp_path / "cache-b")
    digest = a.add_recipe({"kind": "annotations", "test": "race"})
    assert b.add_recipe({"kind": "annotations", "test": "race"}) == digest
    rows = [
        caption_row(f"{i // 4:064x}", f"img{i // 4}", digest, PROMPT_ID, i % 4, f"caption {i}", "stop")
        for i in range(80)
    ]
    uploads: list[str] = []
    upload = a._upload
    a._upload = lambda shard, staged: uploads.append(shard) or upload(shard, staged)
    assert b.commit(rows[:40]).captions_added == 40
    result = a.commit(rows[40:])  # its mirror has not seen B's entry: it loses that number
    assert (result.captions_added, result.captions_duplicate) == (40, 0)
    assert uploads == [result.shard], "the first upload published, none withdrawn"
    assert tcjepa("cache", "verify", f"{root}/cache", "--no-progress", env=env).stdout.startswith(
        "ok: 1 recipes, 2 shards, 80 captions"
    )
    assert collect_cache_garbage(f"{root}/cache", 0.0, delete=False).found == 0

    stores = [RemoteEmbeddingStore.open_or_create(f"{root}/store", {"kind": "t"}, 4, tmp_path / k) for k in "ab"]
    segments: list[str] = []
    upload_segment = stores[0]._upload
    stores[0]._upload = lambda segment: segments.append(segment.segment_id) or upload_segment(segment)
    rng = np.random.default_rng(0)
    for store in (stores[1], stores[0]):  # B first: A has not seen its entry
        writer = store.new_segment(TokenLayout(8, 2))
        for _ in range(10):
            writer.append(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), np.ones((2, 4), np.float16))
        writer.finish()
        published = store.publish(writer)
    assert (published.captions, published.duplicates_dropped) == (10, 0)
    assert segments == [published.segment], "the first upload published, none withdrawn"
    assert tcjepa("store", "verify", f"{root}/store", "--no-progress", env=env).stdout.startswith(
        "ok: 2 segments, 20 captions"
    )
    assert collect_store_garbage(f"{root}/store", 0.0, delete=False).found == 0


class _OwnEntryAnsweredAsRefused:
    """An obstore store whose first create of a log entry lands but is answered as refused, the entry then not
    readable at once: what a writer sees when its PUT is retried after a lost answer (or refused while the first try
    is still in flight) and the winner is itself."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.landed = inner, None

    def put(self, path: str, data: bytes, **kwargs: Any) -> Any:
        from obstore.exceptions import AlreadyExistsError

        if self.landed is None and path.startswith("log/") and kwargs.get("mode") == "create":
            self.inner.put(path, data, **kwargs)
            self.landed = path
            raise AlreadyExistsError("ConditionalRequestConflict")
        return self.inner.put(path, data, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        if path == self.landed:
            self.landed = ""  # once: still landing
            raise FileNotFoundError(path)
        return self.inner.get(path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_writer_whose_refused_entry_had_landed_keeps_its_upload(tmp_path, object_bucket):
    """A cache commit, a compaction and a store segment whose entry's create was refused though it landed: after
    catching up, each finds its own upload published and keeps it (before, it took its rows for another writer's
    and removed the upload its entry names)."""
    from captioning.annotations import PROMPT_ID
    from captioning.cache import caption_row
    from captioning.compact import _read_group
    from captioning.remote_cache import RemoteCaptionCache, collect_cache_garbage
    from embedding_cache.remote_store import RemoteEmbeddingStore, collect_store_garbage
    from embedding_cache.store import TokenLayout

    fs, root, bucket, env = object_bucket
    cache = RemoteCaptionCache.open_or_create(f"{root}/cache", tmp_path / "cache")
    digest = cache.add_recipe({"kind": "annotations", "test": "own entry"})
    rows = [
        caption_row(f"{i // 4:064x}", f"img{i // 4}", digest, PROMPT_ID, i % 4, f"caption {i}", "stop")
        for i in range(40)
    ]
    assert cache.commit(rows[:20]).captions_added == 20
    refusing = cache._objects.store = _OwnEntryAnsweredAsRefused(cache._objects.store)
    result = cache.commit(rows[20:])
    assert refusing.landed == "" and (result.captions_added, result.captions_duplicate) == (20, 0)
    refusing.landed = None
    shards = cache.shard_ids()
    compacted = cache.replace_shards(shards, *_read_group(cache, shards))
    assert refusing.landed == "" and compacted in cache.shard_ids()
    assert tcjepa("cache", "verify", f"{root}/cache", "--no-progress", env=env).stdout.startswith(
        "ok: 1 recipes, 1 shards, 40 captions"
    )
    assert collect_cache_garbage(f"{root}/cache", 0.0, delete=False).found == 0

    store = RemoteEmbeddingStore.open_or_create(f"{root}/store", {"kind": "t"}, 4, tmp_path / "store")
    refusing = store._objects.store = _OwnEntryAnsweredAsRefused(store._objects.store)
    writer = store.new_segment(TokenLayout(8, 2))
    rng = np.random.default_rng(0)
    for _ in range(10):
        writer.append(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), np.ones((2, 4), np.float16))
    writer.finish()
    published = store.publish(writer)
    assert refusing.landed == "" and (published.captions, published.duplicates_dropped) == (10, 0)
    assert store.segment_ids() == [published.segment]
    assert tcjepa("store", "verify", f"{root}/store", "--no-progress", env=env).stdout.startswith(
        "ok: 1 segments, 10 captions"
    )
    assert collect_store_garbage(f"{root}/store", 0.0, delete=False).found == 0


@pytest.mark.distributed
def test_four_processes_write_one_remote_cache_at_once(tmp_path, object_bucket, synth_dir, annotated_cache):
    """Two hosts sharing a mirror directory and two with their own, all importing the same captions (s3://, az://)."""
    _, root, _, env = object_bucket
    url = f"{root}/shared-cache"
    mirrors = [tmp_path / "m1", tmp_path / "m1", tmp_path / "m2", tmp_path / "m3"]
    procs = [
        start_tcjepa("caption", "--cache", url, "--annotations", synth_dir / "captions.jsonl", "--mirror", m, env=env)
        for m in mirrors
    ]
    added = sum(int(out.split(" captions added")[0].split()[-1]) for out, _ in finish(procs))
    assert added == 320
    report = tcjepa("cache", "verify", url, "--no-progress", env=env)
    assert " 320 captions" in report.stdout, report.stdout
    local = tcjepa("cache", "info", annotated_cache, "--json").stdout
    remote = tcjepa("cache", "info", mirror_path(url, tmp_path / "m2"), "--json").stdout
    assert json.loads(local)["recipes"] == json.loads(remote)["recipes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_hosts_append_to_one_remote_store(tmp_path, object_bucket, annotated_cache, annotated_store, tiny_models):
    """A lost race at the store level (in process), then two `tcjepa embed` processes at once on one remote store
    (s3://, az://)."""
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import RemoteEmbeddingStore
    from embedding_cache.store import TokenLayout

    fs, prefix, bucket, env = object_bucket
    encoder = {"kind": "test-encoder"}
    url = f"{prefix}/raced-store"
    a = RemoteEmbeddingStore.open_or_create(url, encoder, 4, tmp_path / "host-a")
    b = RemoteEmbeddingStore.open_or_create(url, encoder, 4, tmp_path / "host-b")
    rng = np.random.default_rng(0)
    keys = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(150)]
    vectors = [rng.standard_normal((1 + i % 5, 4)).astype(np.float16) for i in range(150)]
    for store, chosen in ((b, range(0, 100)), (a, range(50, 150))):
        writer = store.new_segment(TokenLayout(8, 2))
        for i in chosen:
            writer.append(keys[i], vectors[i])
        writer.finish()
        result = store.publish(writer)
    assert (result.captions, result.duplicates_dropped) == (50, 50)
    mirror = mirror_store(url, tmp_path / "reader")
    assert tcjepa("store", "verify", mirror, "--no-progress").stdout.startswith("ok: 2 segments, 150 captions")
    reader = EmbeddingReader(mirror)
    for key, vector in zip(keys, vectors):
        np.testing.assert_array_equal(reader.get_key(key), vector)
    root = json.loads(fs.cat_file(f"{bucket}/raced-store/zarr.json"))
    assert len(root["attributes"]["tcjepa"]["segments"]) == 2, "plain zarr readers see the root list"
    assert not (tmp_path / "host-a" / "segments").exists() or not any((tmp_path / "host-a").rglob("tokens")), (
        "writers keep keys only"
    )

    url = f"{prefix}/embedded-store"
    args = ["embed", "--cache", annotated_cache, "--store", url, "--model", tiny_models / "t5", "--no-progress"]
    args += ["--chunk-tokens", "256", "--shard-chunks", "4", "--window", "32", "--segment-mb", "0.1"]

    def published() -> bool:
        fs.invalidate_cache()
        return fs.exists(f"{bucket}/embedded-store/log")

    procs = [start_tcjepa(*args, "--mirror", tmp_path / f"embed-{k}", env=env) for k in range(2)]
    kill_when(procs[0], published)  # a host dies once a segment is published; its rerun resumes beside the other
    procs[0] = start_tcjepa(*args, "--mirror", tmp_path / "embed-0", env=env)
    finish(procs)
    assert tcjepa(
        "store", "verify", url, "--no-progress", env={**env, "HOME": str(tmp_path / "home")}
    ).stdout.startswith("ok: ")
    assert_same_embeddings(mirror_store(url, tmp_path / "reader"), annotated_store)


def test_creators_racing_with_different_fits_leave_the_winners_arrays(tmp_path, object_bucket, monkeypatch):
    """Two hosts create one projected store at once, their fits not equal to the bit (other hardware): B uploads
    its arrays, then A uploads its own, then B's root wins and A's loses. Every reader must get B's arrays, the ones
    B's root records (under shared names A's upload replaced them, and every reader refused the store); A's are
    garbage that gc frees. A damaged copy is refused as it is mirrored, not kept."""
    import threading

    from embedding_cache.remote_store import RemoteEmbeddingStore, collect_store_garbage, mirror_store
    from embedding_cache.store import EmbeddingStore
    from embedding_cache.transform import fit_transform
    from pipeline.core.objects import ObjectRoot

    fs, root, bucket, env = object_bucket
    url = f"{root}/store"
    request = {"kind": "test-encoder", "projection": {"dim": 4}}
    fits = {
        host: fit_transform(np.random.default_rng(seed).standard_normal((64, 8)).astype(np.float32), "float16", 4, 16)
        for host, seed in (("A", 1), ("B", 2))
    }
    b_waits, a_uploaded, b_created = threading.Event(), threading.Event(), threading.Event()
    create_or_read = ObjectRoot.create_or_read

    def in_turn(self: ObjectRoot, name: str, data: bytes, *args: Any) -> bytes:
        if name == "zarr.json" and threading.current_thread().name == "B":
            b_waits.set()
            assert a_uploaded.wait(60)
            try:
                return create_or_read(self, name, data, *args)
            finally:
                b_created.set()
        if name == "zarr.json" and threading.current_thread().name == "A":
            a_uploaded.set()
            assert b_created.wait(60)
        return create_or_read(self, name, data, *args)

    monkeypatch.setattr(ObjectRoot, "create_or_read", in_turn)
    opened: dict[str, Any] = {}

    def create(host: str) -> None:
        entries, transform = fits[host]
        try:
            opened[host] = RemoteEmbeddingStore.open_or_create(
                url, {**request, **entries}, 4, tmp_path / host, transform=transform
            )
        except Exception as exc:  # reported below, in the test's thread
            opened[host] = exc

    threads = {host: threading.Thread(target=create, args=(host,), name=host) for host in "BA"}
    threads["B"].start()
    assert b_waits.wait(60), "B uploaded its arrays first"
    threads["A"].start()
    for thread in threads.values():
        thread.join(120)
    assert all(isinstance(store, RemoteEmbeddingStore) for store in opened.values()), opened
    want = fits["B"][1]
    for store in (*opened.values(), EmbeddingStore(mirror_store(url, tmp_path / "reader"))):
        got = store.transform
        assert got.projection is not None and want.projection is not None
        np.testing.assert_array_equal(got.projection.components, want.projection.components)
    report = collect_store_garbage(url, 0.0, delete=True)
    assert report.deleted > 0, "A's arrays, which no root names"
    fresh = EmbeddingStore(mirror_store(url, tmp_path / "after-gc")).transform.projection
    assert fresh is not None and np.array_equal(fresh.components, want.projection.components)

    fitted = json.loads(fs.cat_file(f"{bucket}/store/zarr.json"))["attributes"]["tcjepa"]["fitted"]
    local = json.loads((mirror_store(url, tmp_path / "reader") / "zarr.json").read_bytes())["attributes"]["tcjepa"]
    assert "fitted" not in local, "a mirror keeps the arrays in its own root (uploaded whole, it is a store)"
    chunks = [p for p in fs.find(f"{bucket}/store/{fitted}/projection") if "/c/" in p]
    fs.pipe_file(chunks[0], fs.cat_file(chunks[0])[::-1])
    with pytest.raises(DataProblem, match=rf"^{url}/{fitted}/projection/\w+: does not match the sha256"):
        mirror_store(url, tmp_path / "damaged")
    assert not list((tmp_path / "damaged").rglob("projection")), "not kept: the next sync fetches it again"
    fs.rm(f"{bucket}/store/{fitted}", recursive=True)
    with pytest.raises(DataProblem, match=rf"store/{fitted}/projection: (listed but )?missing"):
        mirror_store(url, tmp_path / "damaged")


def test_the_store_root_is_listed_by_compare_and_swap_never_blindly(tmp_path, object_bucket, monkeypatch):
    """The root's segment list is replaced only in the version it was read from: when another writer replaces the
    root between this writer's read and its write (here with a stale list, as a blind writer would), the swap is
    refused, the root read again, and the list written holds every published segment."""
    from embedding_cache.remote_store import RemoteEmbeddingStore
    from embedding_cache.store import TokenLayout
    from pipeline.core.errors import UserError
    from pipeline.core.objects import ObjectRoot, Stored

    fs, root_url, bucket, _ = object_bucket
    url = f"{root_url}/swapped-store"
    store = RemoteEmbeddingStore.open_or_create(url, {"kind": "test-encoder"}, 4, tmp_path / "host")
    objects, swaps = store._objects, []

    class Interrupted(ObjectRoot):
        def replace(self, name: str, data: bytes, etag: str | None) -> bool:
            if not swaps:  # another writer lands first, with the list it read before anything was published
                stale = json.loads(objects.read(name).data)
                stale["attributes"]["tcjepa"]["segments"] = []
                assert objects.replace(name, json.dumps(stale).encode(), objects.read(name).etag)
            swaps.append(name)
            return objects.replace(name, data, etag)

    store._objects = Interrupted(url, objects.store)
    writer = store.new_segment(TokenLayout(8, 2))
    writer.append(bytes(range(32)), np.ones((2, 4), np.float16))
    writer.finish()
    result = store.publish(writer)
    assert swaps == ["zarr.json", "zarr.json"], "refused once, then written on the version read again"
    root = json.loads(fs.cat_file(f"{bucket}/swapped-store/zarr.json"))
    assert root["attributes"]["tcjepa"]["segments"] == [result.segment]

    plain_read = ObjectRoot.read

    def without_etag(self: ObjectRoot, name: str) -> Stored | None:  # a server that gives none
        stored = plain_read(self, name)
        return None if stored is None else Stored(stored.data, None)

    class NoETag(ObjectRoot):  # no swap can then be made safely, so none is tried
        read = without_etag

        def replace(self, name: str, data: bytes, etag: str | None) -> bool:
            raise AssertionError("a swap without an ETag: a blind write, or one refused for ever")

    store._objects = NoETag(url, objects.store)
    writer = store.new_segment(TokenLayout(8, 2))
    writer.append(bytes(range(1, 33)), np.ones((2, 4), np.float16))
    writer.finish()
    with pytest.raises(UserError, match="gives no ETag"):
        store.publish(writer)
    monkeypatch.setattr(ObjectRoot, "read", without_etag)  # a writer opening the store is refused before it writes
    with pytest.raises(UserError, match=rf"^--store {url}: the object store gives no ETag"):
        RemoteEmbeddingStore.open(url, tmp_path / "another")


def test_writers_refuse_other_object_stores_in_one_line(tmp_path, s3, synth_dir):
    _, env = s3
    proc = tcjepa(
        "caption",
        "--cache",
        "memory://bucket/new-cache",
        "--annotations",
        synth_dir / "captions.jsonl",
        check=False,
        env=env,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "only where its conditional put is tested (s3://, az://)" in proc.stderr
    proc = tcjepa("cache", "gc", "az://cache@account.blob.core.windows.net/x", check=False, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not CONTAINER@HOST" in proc.stderr
    fs, _ = s3
    fs.pipe_file(f"{BUCKET}/not-a-cache/readme.txt", b"hello")
    proc = tcjepa(
        "caption",
        "--cache",
        f"s3://{BUCKET}/not-a-cache",
        "--annotations",
        synth_dir / "captions.jsonl",
        check=False,
        env=env,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "holds other objects" in proc.stderr
    assert not (REPO / "s3:").exists() and not (REPO / "memory:").exists()


def test_a_missing_bucket_is_named_in_one_line_by_readers_and_writers(tmp_path, object_bucket, synth_dir):
    """Not "no CACHE.json" for a reader nor the server's 404 on a writer's first put: the bucket (Azure: container),
    and what to do."""
    _, root, _, env = object_bucket
    scheme = root.split("://")[0]
    url = f"{scheme}://no-such-bucket/cache"
    for args in (
        ("cache", "info", url),
        ("store", "verify", f"{scheme}://no-such-bucket/store"),
        ("caption", "--cache", url, "--annotations", synth_dir / "captions.jsonl", "--mirror", tmp_path / "m"),
        ("cache", "gc", url),
    ):
        proc = tcjepa(*args, check=False, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert "the bucket 'no-such-bucket' does not exist (or these credentials cannot see it)" in proc.stderr
    proc = tcjepa("cache", "info", f"{root}/absent-cache", check=False, env=env)
    assert proc.returncode == 2 and "is not a caption cache (no CACHE.json)" in proc.stderr, "the bucket is there"


def test_an_int8_projected_store_on_s3_keeps_its_fitted_arrays(tmp_path, s3, annotated_cache, tiny_models, monkeypatch):
    """The projection and channel scales go up with the root, come down with every mirror (keys mirror included, for
    a resumed writer) once, and are checked there; the vectors equal a local store's of the same recipe."""
    from embedding_cache import remote_store
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import mirror_store_keys
    from embedding_cache.store import EmbeddingStore

    fs, env = s3
    url = f"s3://{BUCKET}/int8-projected"
    args = ["--cache", annotated_cache, "--model", tiny_models / "t5", "--store-dtype", "int8", "--project-dim", "16"]
    small = ["--chunk-tokens", "256", "--shard-chunks", "4", "--window", "64", "--segment-mb", "0.2", "--no-progress"]
    tcjepa("embed", "--store", url, *args, *small, "--mirror", tmp_path / "writer", env=env)
    fitted = json.loads(fs.cat_file(f"{BUCKET}/int8-projected/zarr.json"))["attributes"]["tcjepa"]["fitted"]
    assert fs.exists(f"{BUCKET}/int8-projected/{fitted}/projection/components/zarr.json"), "its creator's prefix"
    again = tcjepa("embed", "--store", url, *args, *small, "--mirror", tmp_path / "writer2", env=env).stdout
    assert "320 already stored" in again
    keys = mirror_store_keys(url, tmp_path / "keys")
    assert (keys / "projection" / "mean" / "zarr.json").exists()
    assert EmbeddingStore(keys).transform.projection is not None
    listed: list[str] = []
    fetch_tree = remote_store.fetch_tree
    monkeypatch.setattr(remote_store, "fetch_tree", lambda *a: listed.append(a[2]) or fetch_tree(*a))
    mirror_store_keys(url, tmp_path / "keys")
    assert listed == [], "a sync with nothing new published lists nothing, fitted arrays included"

    tcjepa("embed", "--store", tmp_path / "local", *args, *small, fresh=True)  # another string-hash seed
    local, mirrored = EmbeddingStore(tmp_path / "local"), EmbeddingStore(mirror_store(url, tmp_path / "reader"))
    assert local.encoder_hash == mirrored.encoder_hash and mirrored.width == 16
    assert tcjepa("store", "verify", mirrored.root, "--no-progress").stdout.startswith("ok: ")
    got, want = EmbeddingReader(mirrored.root), EmbeddingReader(local.root)
    for segment in want.segment_ids:
        for key in local.read_keys(segment):
            np.testing.assert_array_equal(got.get_key(key.tobytes()), want.get_key(key.tobytes()))
