"""The publish log (`pipeline.core.remote.PublishLog`): entries created only if absent, one winner per number, a
retried PUT that finds its own entry counts as published, and the ways S3 reports a lost race.

fsspec's in-memory file system has the conditional create the log relies on (`pipe_file(mode="create")` raises
FileExistsError), so the protocol runs in process; one test runs it against an S3 server.
"""

from __future__ import annotations

import uuid
from typing import Any

import botocore.exceptions
import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from s3fs.errors import translate_boto_error

from pipeline.core.errors import UserError
from pipeline.core.recipes import canonical_json
from pipeline.core.remote import PublishLog


@pytest.fixture
def remote() -> tuple[Any, str]:
    """An in-memory file system and a root of its own (the memory store is shared by every instance)."""
    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    root = f"/log-test-{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _log(remote, local) -> PublishLog:
    fs, root = remote
    return PublishLog(f"memory://{root}", fs, root, local)


def test_memory_file_systems_create_only_if_absent(remote):
    """What the in-process tests stand on: the conditional create S3 offers."""
    fs, root = remote
    fs.pipe_file(f"{root}/x", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{root}/x", b"second", mode="create")
    assert fs.cat_file(f"{root}/x") == b"first"


def test_entries_are_numbered_in_order_and_read_back_by_another_host(remote, tmp_path):
    a = _log(remote, tmp_path / "a")
    docs = [{"shard": f"s{i}", "rows": i} for i in range(3)]
    for i, doc in enumerate(docs):
        assert a.append(doc) == i
        a.keep(i, canonical_json(doc))
    assert a.remote() == a.seen() == [0, 1, 2] and a.unseen() == []
    assert a.entries() == docs
    b = _log(remote, tmp_path / "b")
    assert b.seen() == [] and b.entries() == []
    assert b.unseen() == [(i, canonical_json(doc)) for i, doc in enumerate(docs)], "oldest first, as written"


def test_a_writer_that_lost_the_race_gets_none_and_wins_the_next_number(remote, tmp_path):
    a, b = _log(remote, tmp_path / "a"), _log(remote, tmp_path / "b")
    assert a.append({"writer": "a"}) == 0
    assert b.append({"writer": "b"}) is None, "entry 0 is a's"
    fs, root = remote
    assert fs.cat_file(f"{root}/log/000000000000.json") == canonical_json({"writer": "a"}), "the winner's entry stays"
    for seq, raw in b.unseen():  # b looks again, acts on what it missed, and retries
        b.keep(seq, raw)
    assert b.append({"writer": "b"}) == 1
    assert b.entries() == [{"writer": "a"}]
    assert a.append({"writer": "a again"}) is None, "a has not kept entry 0's successor either"


def test_a_retried_put_that_finds_its_own_entry_is_a_success(remote, tmp_path):
    """The PUT landed but its response was lost: the retry finds the same bytes under its number."""
    log = _log(remote, tmp_path / "a")
    assert log.append({"mine": 1}) == 0
    assert log.append({"mine": 1}) == 0, "not kept yet, so the same number: found with the same bytes"
    assert log.append({"mine": 2}) is None, "other bytes under that number: someone else's"
    assert log.remote() == [0]


def test_names_that_are_not_entries_are_ignored(remote, tmp_path):
    fs, root = remote
    for name in ("000000000005.json.part", "readme.txt", "7.json", "000000000003.JSON"):
        fs.pipe_file(f"{root}/log/{name}", b"{}")
    log = _log(remote, tmp_path / "a")
    assert log.remote() == [] and log.unseen() == []
    assert log.append({"first": True}) == 0


class _RefusingOnce(MemoryFileSystem):
    """A memory file system whose next conditional create fails with `error` (as s3fs raises it) before writing;
    `winner` (bytes) is then written under that path, as by a writer whose PUT was in flight."""

    error: Exception | None = None
    winner: bytes | None = None

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if mode == "create" and self.error is not None:
            error, self.error = self.error, None
            if self.winner is not None:
                super().pipe_file(path, self.winner, mode="create")
            raise error
        return super().pipe_file(path, value, mode=mode, **kwargs)


def _s3_error(code: str, status: int, message: str, **extra: str) -> Exception:
    """The exception s3fs raises for an S3 error response (its own translation of botocore's)."""
    response = {"Error": {"Code": code, "Message": message, **extra}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return translate_boto_error(botocore.exceptions.ClientError(response, "PutObject"))


PRECONDITION = "At least one of the pre-conditions you specified did not hold"
CONFLICT = "A conflicting conditional operation is currently in progress against this resource. Try again."


@pytest.mark.parametrize(
    "error",
    [
        _s3_error("PreconditionFailed", 412, PRECONDITION, Condition="If-None-Match"),  # s3fs: FileExistsError
        _s3_error("PreconditionFailed", 412, PRECONDITION),  # s3fs: OSError(EINVAL)
        _s3_error("ConditionalRequestConflict", 409, CONFLICT),  # s3fs: OSError(EIO) naming the code
    ],
    ids=["412-if-none-match", "412", "409"],
)
@pytest.mark.parametrize("winner_landed", [True, False], ids=["winner-there", "winner-in-flight"])
def test_s3s_refusals_of_a_conditional_put_are_a_lost_race(tmp_path, error, winner_landed):
    """412 (the entry exists) and 409 (another PUT of it is in progress) mean: look again, then retry. When the
    winner's entry cannot be read yet, that is a lost race too, not an error."""
    fs = _RefusingOnce(skip_instance_cache=True)
    root = f"/log-test-{uuid.uuid4().hex}"
    fs.error, fs.winner = error, canonical_json({"writer": "other"}) if winner_landed else None
    log = PublishLog(f"memory://{root}", fs, root, tmp_path / "mirror")
    try:
        assert log.append({"writer": "me"}) is None
        assert log.remote() == ([0] if winner_landed else [])
        if winner_landed:
            for seq, raw in log.unseen():
                log.keep(seq, raw)
        assert log.append({"writer": "me"}) == (1 if winner_landed else 0)
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    "error",
    [_s3_error("AccessDenied", 403, "Access Denied"), _s3_error("NoSuchBucket", 404, "The bucket does not exist")],
    ids=["403", "404"],
)
def test_other_failures_of_the_put_are_one_line_errors(tmp_path, error):
    fs = _RefusingOnce(skip_instance_cache=True)
    fs.error = error
    log = PublishLog("memory://bucket/cache", fs, "/bucket/cache", tmp_path / "mirror")
    with pytest.raises(UserError, match=r"^memory://bucket/cache: \w+Error: ") as caught:
        log.append({"writer": "me"})
    assert "\n" not in str(caught.value)


@pytest.mark.s3
def test_the_log_on_an_s3_server(tmp_path, s3_env):
    """The same protocol against S3's own conditional put (moto): a lost race, a won retry, a retried PUT."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"log-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    a = PublishLog(f"s3://{bucket}/x", fs, f"{bucket}/x", tmp_path / "a")
    b = PublishLog(f"s3://{bucket}/x", fs, f"{bucket}/x", tmp_path / "b")
    assert a.append({"writer": "a"}) == 0
    assert b.append({"writer": "b"}) is None
    assert a.append({"writer": "a"}) == 0, "a retried PUT finds its own entry"
    for seq, raw in b.unseen():
        b.keep(seq, raw)
    assert b.append({"writer": "b"}) == 1
    assert fs.cat_file(f"{bucket}/x/log/000000000000.json") == canonical_json({"writer": "a"})
    assert [seq for seq, _ in a.unseen()] == [0, 1]
