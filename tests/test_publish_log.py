"""The publish log (`pipeline.core.remote.PublishLog`) over `pipeline.core.objects.ObjectRoot`: entries created only
if absent, one winner per number, a retried PUT that finds its own entry counts as published, lost races told by the
error's type alone, listings that start after the entries held, condensed blocks for new mirrors, and
compare-and-swap.

obstore's in-memory store has the conditional puts S3, GCS and Azure have (create if absent, replace if the ETag
still matches), so the protocol runs in process; one test runs it against an S3 server (moto) and Azure Blob (Azurite).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from obstore.exceptions import AlreadyExistsError, GenericError, PermissionDeniedError, PreconditionError
from obstore.store import MemoryStore

from pipeline.core.errors import UserError
from pipeline.core.objects import ObjectRoot
from pipeline.core.recipes import canonical_json
from pipeline.core.remote import CONDENSED, LOG, PublishLog
from tests.support.object_servers import bucket_on


@pytest.fixture
def objects() -> ObjectRoot:
    return ObjectRoot("memory://bucket/cache", MemoryStore())


def _entry(objects: ObjectRoot, seq: int) -> bytes:
    stored = objects.read(f"{LOG}/{seq:012d}.json")
    assert stored is not None
    return stored.data


def test_entries_are_numbered_in_order_and_read_back_by_another_host(objects, tmp_path):
    a = PublishLog(objects, tmp_path / "a")
    docs = [{"shard": f"s{i}", "rows": i} for i in range(3)]
    for i, doc in enumerate(docs):
        assert a.append(doc) == i
        a.keep(i, canonical_json(doc))
    assert a.seen() == [0, 1, 2] and a.unseen() == [] and a.unseen_numbers() == []
    assert a.entries() == docs
    b = PublishLog(objects, tmp_path / "b")
    assert b.seen() == [] and b.entries() == [] and b.unseen_numbers() == [0, 1, 2]
    assert b.unseen() == [(i, canonical_json(doc)) for i, doc in enumerate(docs)], "oldest first, as written"


def test_a_writer_that_lost_the_race_gets_none_and_wins_the_next_number(objects, tmp_path):
    a, b = PublishLog(objects, tmp_path / "a"), PublishLog(objects, tmp_path / "b")
    assert a.append({"writer": "a"}) == 0
    assert b.append({"writer": "b"}) is None, "entry 0 is a's"
    assert _entry(objects, 0) == canonical_json({"writer": "a"}), "the winner's entry stays"
    for seq, raw in b.unseen():  # b looks again, acts on what it missed, and retries
        b.keep(seq, raw)
    assert b.append({"writer": "b"}) == 1
    assert b.entries() == [{"writer": "a"}]
    assert a.append({"writer": "a again"}) is None, "a has not kept entry 0's successor either"


def test_a_retried_put_that_finds_its_own_entry_is_a_success(objects, tmp_path):
    """The PUT landed but its response was lost: the retry finds the same bytes under its number."""
    log = PublishLog(objects, tmp_path / "a")
    assert log.append({"mine": 1}) == 0
    assert log.append({"mine": 1}) == 0, "not kept yet, so the same number: found with the same bytes"
    assert log.append({"mine": 2}) is None, "other bytes under that number: someone else's"
    assert objects.names(LOG) == ["000000000000.json"]


def test_names_that_are_not_entries_are_ignored(objects, tmp_path):
    for name in ("000000000005.json.part", "readme.txt", "7.json", "000000000003.JSON", "sub/000000000001.json"):
        objects.create(f"{LOG}/{name}", b"{}")
    log = PublishLog(objects, tmp_path / "a")
    assert log.unseen_numbers() == [] and log.unseen() == []
    assert log.append({"first": True}) == 0


def test_a_sync_lists_only_after_the_entries_held_and_reads_only_new_ones(objects, tmp_path):
    """The cost of looking again does not grow with the history: one listing that starts after the newest entry held
    without a gap, and one read per new entry."""
    writer = PublishLog(objects, tmp_path / "writer")
    for i in range(2200):
        objects.create(f"{LOG}/{i:012d}.json", canonical_json({"i": i}))
    reader = PublishLog(objects, tmp_path / "reader")
    reader.keep_all(reader.unseen())
    assert reader.seen() == list(range(2200)) and reader.entries() == [{"i": i} for i in range(2200)]
    assert len(list((tmp_path / "reader" / LOG).iterdir())) == 2 + 200, "two local blocks of 1,000, 200 copies"
    assert writer.append({"i": "new"}) is None, "entry 0 is taken"
    writer.keep_all(writer.unseen())
    assert writer.append({"i": "new"}) == 2200
    objects.requests.clear()
    objects.bytes_read = 0
    assert reader.unseen() == [(2200, canonical_json({"i": "new"}))]
    assert objects.requests == {"list": 2, "get": 1}, "condensed blocks after 2199, then entries after it"
    assert objects.bytes_read == len(canonical_json({"i": "new"}))
    (tmp_path / "reader" / LOG / f"{2100:012d}.json").unlink()  # a hole in the copies: listed from there again
    assert reader.unseen_numbers() == [2100, 2200]


def test_a_new_mirror_reads_condensed_blocks_and_the_entries_after_them(objects, tmp_path):
    writers = [PublishLog(objects, tmp_path / f"w{k}", condense_every=4) for k in range(2)]
    docs = []
    for i in range(10):  # two writers taking turns, each looking again before it appends
        log = writers[i % 2]
        for seq, raw in log.unseen():
            log.keep(seq, raw)
        doc = {"writer": i % 2, "i": i}
        seq = log.append(doc)
        assert seq == i
        log.keep(seq, canonical_json(doc))
        docs.append(doc)
    assert objects.names(CONDENSED) == ["000000000003.json", "000000000007.json"], "by whichever writer crossed"
    fresh = PublishLog(objects, tmp_path / "fresh", condense_every=4)
    objects.requests.clear()
    got = fresh.unseen()
    assert [seq for seq, _ in got] == list(range(10))
    assert [raw for _, raw in got] == [canonical_json(d) for d in docs], "the same bytes as the entries"
    assert objects.requests == {"list": 2, "get": 4}, "two blocks, then entries 8 and 9"


def test_where_nothing_lists_after_a_name_a_sync_reads_in_turn_as_cheaply(tmp_path):
    """Azure's listing cannot start after a name (obstore pages through the whole prefix): there the log is read by
    name, the block that holds the next number, then entry after entry to the first missing one. What a sync costs
    does not grow with the history either: the new entries and two reads of names not there yet, no listing."""
    objects = ObjectRoot("memory://bucket/cache", MemoryStore(), lists_after=False)
    writers = [PublishLog(objects, tmp_path / f"w{k}", condense_every=4) for k in range(2)]
    for i in range(10):  # two writers taking turns, each looking again before it appends
        log = writers[i % 2]
        log.keep_all(log.unseen())
        assert log.append({"i": i}) == i
        log.keep(i, canonical_json({"i": i}))
    fresh = PublishLog(objects, tmp_path / "fresh", condense_every=4)
    objects.requests.clear()
    assert fresh.unseen() == [(i, canonical_json({"i": i})) for i in range(10)]
    assert objects.requests == {"get": 2 + 1 + 2 + 1}, "blocks 3 and 7, no block 11; entries 8 and 9, no 10"
    fresh.keep_all(fresh.unseen())
    for i in range(10, 2010):
        objects.create(f"{LOG}/{i:012d}.json", canonical_json({"i": i}))
    fresh.keep_all(fresh.unseen())
    objects.requests.clear()
    assert writers[0].append({"i": "late"}) is None, "entry 10 is taken"
    writers[0].keep_all(writers[0].unseen())
    assert writers[0].append({"i": "late"}) == 2010
    objects.requests.clear()
    assert fresh.unseen() == [(2010, canonical_json({"i": "late"}))]
    assert objects.requests == {"get": 3}, "no block 2011, entry 2010, no entry 2011: as at 10 entries"
    fresh.keep_all(fresh.unseen())
    (tmp_path / "fresh" / LOG / f"{2009:012d}.json").unlink()  # a hole in the copies: read from there again
    assert [seq for seq, _ in fresh.unseen()] == [2009], "2010 is held"
    gone = PublishLog(ObjectRoot("memory://bucket/new", MemoryStore(), lists_after=False), tmp_path / "fresh")
    with pytest.raises(UserError, match=r"entry 2010, held here, is not there: .* made anew"):
        gone.append({"i": "after a rebuild"})  # its number would be past the new log's end, never read by name
    objects.delete(f"{CONDENSED}/{7:012d}.json")  # a block its writer died before writing: entries one by one
    assert [seq for seq, _ in PublishLog(objects, tmp_path / "new", condense_every=4).unseen()] == list(range(2011))
    objects.delete(f"{CONDENSED}/{3:012d}.json")  # one that is not the block its name says (another size): the same
    objects.create(f"{CONDENSED}/{3:012d}.json", canonical_json({"first": 2, "entries": ['{"i":2}', '{"i":3}']}))
    assert [seq for seq, _ in PublishLog(objects, tmp_path / "newer", condense_every=4).unseen()] == list(range(2011))


def test_a_writer_that_lacks_a_copy_writes_no_block(objects, tmp_path):
    """A block is written only from entries held here: a writer that would have to guess writes none (readers then
    read the entries one by one)."""
    a = PublishLog(objects, tmp_path / "a", condense_every=4)
    for i in range(3):
        objects.create(f"{LOG}/{i:012d}.json", canonical_json({"i": i}))
    for seq, raw in a.unseen():
        if seq != 1:
            a.keep(seq, raw)
    assert a.append({"i": 3}) == 3 and objects.names(CONDENSED) == []
    assert [seq for seq, _ in PublishLog(objects, tmp_path / "b", condense_every=4).unseen()] == [0, 1, 2, 3]


class _Refusing:
    """An obstore store whose next put raises `error` (a typed obstore error with a message no server sends) before
    writing; `winner` (bytes) is then written under that path, as by a writer whose PUT was in flight."""

    def __init__(self, error: Exception | None, winner: bytes | None) -> None:
        self.inner, self.error, self.winner = MemoryStore(), error, winner

    def put(self, path: str, data: bytes, **kwargs: Any) -> Any:
        if self.error is not None:
            error, self.error = self.error, None
            if self.winner is not None:
                self.inner.put(path, self.winner, mode="create")
            raise error
        return self.inner.put(path, data, **kwargs)

    def get(self, path: str) -> Any:
        return self.inner.get(path)

    def list(self, prefix: str, **kwargs: Any) -> Any:
        return self.inner.list(prefix, **kwargs)


@pytest.mark.parametrize(
    "error",
    [AlreadyExistsError("the bucket says: no"), PreconditionError("¿condición? 200 OK")],
    ids=["already-exists", "precondition"],
)
@pytest.mark.parametrize("winner_landed", [True, False], ids=["winner-there", "winner-in-flight"])
def test_a_refused_conditional_put_is_a_lost_race_by_its_type_alone(tmp_path, error, winner_landed):
    """Whatever the message says, the type decides: look again, then retry. When the winner's entry cannot be read
    yet, that is a lost race too, not an error."""
    store = _Refusing(error, canonical_json({"writer": "other"}) if winner_landed else None)
    objects = ObjectRoot("memory://bucket/cache", store)
    log = PublishLog(objects, tmp_path / "mirror")
    assert log.append({"writer": "me"}) is None
    assert log.unseen_numbers() == ([0] if winner_landed else [])
    for seq, raw in log.unseen():
        log.keep(seq, raw)
    assert log.append({"writer": "me"}) == (1 if winner_landed else 0)


@pytest.mark.parametrize(
    "error",
    [
        PermissionDeniedError("409 ConditionalRequestConflict PreconditionFailed"),
        GenericError("412 Precondition Failed: At least one of the pre-conditions you specified did not hold"),
    ],
    ids=["denied-naming-409", "generic-naming-412"],
)
def test_other_failures_of_the_put_are_one_line_errors_whatever_they_say(tmp_path, error):
    """No decision on an error's text: a failure that names 409 or 412 but is not typed as a refusal is an error."""
    objects = ObjectRoot("memory://bucket/cache", _Refusing(error, None))
    with pytest.raises(UserError, match=r"^memory://bucket/cache: \w+Error: ") as caught:
        PublishLog(objects, tmp_path / "mirror").append({"writer": "me"})
    assert "\n" not in str(caught.value)


def test_replace_is_a_compare_and_swap(objects):
    assert objects.create_or_read("root.json", b"v1") == b"v1"
    assert objects.create_or_read("root.json", b"other") == b"v1", "the first writer's bytes"
    first = objects.read("root.json")
    assert first is not None and objects.replace("root.json", b"v2", first.etag)
    assert not objects.replace("root.json", b"v3", first.etag), "changed since it was read"
    assert not objects.replace("new.json", b"x", "stale-etag")
    now = objects.read("root.json")
    assert now is not None and now.data == b"v2" and now.etag != first.etag
    assert objects.replace("new.json", b"x", None) and not objects.replace("new.json", b"y", None)


@pytest.mark.s3
def test_the_log_and_compare_and_swap_on_each_object_store_server(tmp_path, object_server):
    """The same protocol against each back-end's own conditional puts (S3 on moto, Azure Blob on Azurite), through
    `ObjectRoot.of` and the environment, as a writer meets them."""
    scheme, server, _ = object_server
    bucket = f"log-{uuid.uuid4().hex[:12]}"
    fs = bucket_on(server, scheme, bucket)
    url = f"{scheme}://{bucket}/x"
    a, b = PublishLog(ObjectRoot.of(url), tmp_path / "a"), PublishLog(ObjectRoot.of(url), tmp_path / "b")
    assert a.objects.lists_after == (scheme == "s3"), "Azure's List Blobs cannot start after a name: read in turn"
    assert a.append({"writer": "a"}) == 0
    assert b.append({"writer": "b"}) is None
    assert a.append({"writer": "a"}) == 0, "a retried PUT finds its own entry"
    for seq, raw in b.unseen():
        b.keep(seq, raw)
    assert b.append({"writer": "b"}) == 1
    assert fs.cat_file(f"{bucket}/x/log/000000000000.json") == canonical_json({"writer": "a"})
    assert [seq for seq, _ in a.unseen()] == [0, 1]
    objects = ObjectRoot.of(url)
    assert objects.create_or_read("zarr.json", b"v1") == b"v1"
    first = objects.read("zarr.json")
    assert first is not None and objects.replace("zarr.json", b"v2", first.etag)
    assert not objects.replace("zarr.json", b"v3", first.etag)
    with pytest.raises(UserError, match=rf"^{scheme}://no-such-bucket-here/x: "):
        ObjectRoot.of(f"{scheme}://no-such-bucket-here/x").create("a", b"1")


@pytest.mark.parametrize(("lists_after", "requests"), [(True, {"list": 2, "get": 6}), (False, {"get": 9})])
def test_a_missing_block_does_not_hide_the_entries_before_the_next_one(tmp_path, lists_after, requests):
    """The writer of a block's last entry died before writing the block: a new mirror reads that stretch entry by
    entry, then the blocks after it, and gets every entry in one sync (a gc reads once: an entry it missed would be
    deleted data). Listed: the blocks, entries 0-3, blocks 7 and 11, the entries after 11. Read by name: no block 3,
    entries 0-3, blocks 7 and 11, no block 15, no entry 12. (Before, every entry after the gap was read by name.)"""
    objects = ObjectRoot("memory://bucket/cache", MemoryStore(), lists_after=lists_after)
    log = PublishLog(objects, tmp_path / "writer", condense_every=4)
    for i in range(12):
        assert log.append({"i": i}) == i
        log.keep(i, canonical_json({"i": i}))
    assert objects.names(CONDENSED) == ["000000000003.json", "000000000007.json", "000000000011.json"]
    objects.delete(f"{CONDENSED}/000000000003.json")
    fresh = PublishLog(objects, tmp_path / "fresh", condense_every=4)
    objects.requests.clear()
    assert [seq for seq, _ in fresh.unseen()] == list(range(12))
    assert objects.requests == requests


def test_a_copy_left_beside_its_local_block_is_held_once(objects, tmp_path):
    """A process killed while condensing its copies leaves single copies beside the block: they count once."""
    log = PublishLog(objects, tmp_path / "mirror", condense_every=4)
    for i in range(4):
        log.keep(i, canonical_json({"i": i}))
    assert sorted(p.name for p in (tmp_path / "mirror" / LOG).iterdir()) == ["000000000000-000000000003.json"]
    (tmp_path / "mirror" / LOG / "000000000002.json").write_bytes(canonical_json({"i": 2}))
    assert log.seen() == [0, 1, 2, 3] and log.entries() == [{"i": i} for i in range(4)]


class _NoBlocks(_Refusing):
    """A store that refuses to write condensed blocks (a failure on the way)."""

    def put(self, path: str, data: bytes, **kwargs: Any) -> Any:
        if path.startswith(CONDENSED):
            raise GenericError("the network went away")
        return self.inner.put(path, data, **kwargs)


def test_an_entry_whose_block_cannot_be_written_is_still_published(tmp_path):
    objects = ObjectRoot("memory://bucket/cache", _NoBlocks(None, None))
    log = PublishLog(objects, tmp_path / "mirror", condense_every=2)
    assert log.append({"i": 0}) == 0
    log.keep(0, canonical_json({"i": 0}))
    assert log.append({"i": 1}) == 1, "published; only its block is missing"
    assert objects.names(CONDENSED) == []
