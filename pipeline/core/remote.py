"""Caches and stores on object storage (fsspec URLs: s3://, az://, gs://, ...): local mirrors for reading, a publication
log for writing (s3:// and az://).

Reading. The trainer memory-maps store shards and re-reads cache shards; both are immutable
once published, so a remote cache or store is copied once, file by file, into a local
mirror, and each copied file is checked against the checksum recorded when it was written
(the cache's manifests, the store's per-segment sha256). A later call fetches only what was
published since. One process at a time updates a mirror (a file lock); a file arrives under
a temporary name and is renamed when whole, and a shard or segment counts as mirrored only
once all of it is there, so a killed mirror resumes.

Writing. Object storage has no rename and no lock, but it has a conditional put: an object
created only if absent (`pipeline.core.objects`, typed outcomes). A writer uploads its shard
or segment under a unique name, then creates the next entry of ``log/<seq>.json`` naming it;
of two writers that race for one entry exactly one succeeds, and the other fetches what was
published, drops its rows that are now there and tries the next entry. A shard or segment
exists for readers once a log entry (or, for trees uploaded whole, a manifest or the store
root's list) names it; an upload whose writer died before its entry is never read.

Credentials and endpoints come from each cloud's usual configuration, read by fsspec (s3fs,
adlfs) for files and by obstore for the log: for S3 the AWS environment variables (e.g.
``AWS_ENDPOINT_URL`` for an S3-compatible server); for Azure ``AZURE_STORAGE_ACCOUNT_NAME``
with ``AZURE_STORAGE_ACCOUNT_KEY`` (or ``AZURE_STORAGE_SAS_TOKEN``; for the Azurite emulator
``AZURE_STORAGE_CONNECTION_STRING`` for fsspec and ``AZURE_STORAGE_USE_EMULATOR=true`` with
``AZURITE_BLOB_STORAGE_URL`` for obstore). gs:// is read; writing it is not tested, so writers refuse it: the GCS
emulator on PyPI (gcp-storage-emulator) serves only the JSON API, while obstore speaks the XML
API (it answered 501), and fake-gcs-server is on neither PyPI nor npm.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from filelock import FileLock

from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes, user_cache_dir
from pipeline.core.objects import ObjectRoot
from pipeline.core.recipes import canonical_json, sha256_file

logger = logging.getLogger(__name__)
# The schemes writers publish to: a conditional put through obstore, files through fsspec, each tested on a server
# on loopback (moto, Azurite).
WRITABLE_PROTOCOLS = ("s3", "s3a", "az")
INSTALL_HINT = {"s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs", "gs": "gcsfs", "gcs": "gcsfs"}
LOG = "log"
CONDENSED = "log-condensed"
CONDENSE_EVERY = 1000  # entries per condensed block: a new mirror of a 10^6-entry log reads 1,000 blocks
MIRROR_LOCK = ".mirror.lock"
_ENTRY = re.compile(r"^(\d{12})\.json$")
_LOCAL_BLOCK = re.compile(r"^(\d{12})-(\d{12})\.json$")
T = TypeVar("T")


class RemoteFileMissing(DataProblem):
    """A file that a listing or a log entry named is gone (deleted since, e.g. by a compaction: look again)."""


def is_remote(location: str | Path | None) -> TypeGuard[str]:
    """A URL (scheme://...); plain paths are local."""
    return isinstance(location, str) and "://" in location


def remote_call(url: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, one fsspec call; any failure of the remote side (credentials, network, permissions)
    becomes one line."""
    try:
        return call(*args, **kwargs)
    except (UserError, DataProblem):
        raise
    except Exception as exc:  # s3fs, botocore and aiohttp raise many unrelated types
        raise remote_error(url, exc) from None


def remote_error(url: str, exc: Exception) -> UserError:
    """The one line a failure of the remote side gets."""
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return UserError(f"{url}: {type(exc).__name__}: {detail[:200]}")


def filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    scheme, _, rest = url.partition("://")
    if scheme.lower() == "az" and "@" in rest.split("/", 1)[0]:
        # adlfs reads az://CONTAINER@ACCOUNT.../PATH as that container, obstore as a container named by the host:
        # the files and the log would part ways
        raise UserError(
            f"{url}: give az://CONTAINER/PATH and the account in AZURE_STORAGE_ACCOUNT_NAME, not CONTAINER@HOST"
        )

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        scheme = url.split("://", 1)[0].lower()
        package = INSTALL_HINT.get(scheme, "the fsspec back-end of this scheme")
        raise UserError(
            f"{url}: cannot open ({str(exc).splitlines()[0]}); install {package} (`pip install tcjepa[remote]`)"
        ) from None
    return fs, root.rstrip("/")


def writable_filesystem(url: str, option: str) -> tuple[Any, str]:
    """The file system and root of a URL that writers may publish to: one whose conditional put tcjepa relies on."""
    protocol = url.split("://", 1)[0].lower()
    if protocol not in WRITABLE_PROTOCOLS:
        raise UserError(
            f"{option} {url}: tcjepa writes to object storage only where its conditional put is tested (s3://, "
            f"az://); give a local directory and upload the finished tree, or use an s3:// or az:// URL"
        )
    fs, root = filesystem(url)
    require_bucket(fs, url, root)
    return fs, root


def require_bucket(fs: Any, url: str, root: str) -> None:
    """Refuse a URL whose bucket does not exist in one line that says so: a reader would otherwise find no cache
    there, and a writer's first put would fail with the server's 404."""
    bucket = root.split("/", 1)[0]
    fs.invalidate_cache(bucket)
    if not remote_call(url, fs.exists, bucket):
        raise UserError(f"{url}: the bucket {bucket!r} does not exist (or these credentials cannot see it); create it")


def remote_root(url: str, marker: str, what: str) -> tuple[Any, str]:
    """The file system and root of `url`, refusing a URL whose root lacks `marker` (or whose bucket is missing)."""
    fs, root = filesystem(url)
    if not remote_call(url, fs.exists, f"{root}/{marker}"):
        require_bucket(fs, url, root)
        raise UserError(f"{url} is not {what} (no {marker})")
    return fs, root


def remote_names(fs: Any, url: str, path: str) -> list[str]:
    """Names directly under `path` as the server lists them now (no cached listing); none when it does not exist."""

    def listing() -> list[str]:
        try:
            return fs.ls(path, detail=False)
        # nothing there yet (another writer may create it a moment later: that is news for next time)
        except FileNotFoundError:
            return []

    fs.invalidate_cache(path)
    entries = remote_call(url, listing)
    return sorted(Path(str(e).rstrip("/")).name for e in entries)


def mirror_path(url: str, mirror: Path | None = None, suffix: str = "") -> Path:
    """Where `url` is (or will be) mirrored: one directory per URL under `mirror`."""
    base = Path(mirror) if mirror is not None else user_cache_dir() / "mirror"
    return base / f"{Path(url.rstrip('/')).name}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}{suffix}"


def mirror_lock(local: Path) -> FileLock:
    """The one lock of a mirror directory: held by whoever adds to it (a mirror update or a writer's commit)."""
    return FileLock(str(local / MIRROR_LOCK))


def fetch(fs: Any, remote: str, local: Path, sha256: str | None = None) -> None:
    """Copy one file (skipped when present); with `sha256`, refuse a copy that does not match it."""
    if local.exists():
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.part")
    try:
        try:
            fs.get_file(remote, str(tmp))
        except FileNotFoundError:
            raise RemoteFileMissing(f"{remote}: listed but missing on the remote side") from None
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise UserError(f"{remote}: cannot fetch ({type(exc).__name__}: {detail[:200]})") from None
        if sha256 is not None and sha256_file(tmp) != sha256:
            raise DataProblem(
                f"{remote}: does not match the sha256 recorded when it was written (changed or damaged); not used"
            )
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def parse_json(url: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise DataProblem(f"{url}: not valid JSON") from None
    if not isinstance(doc, dict):
        raise DataProblem(f"{url}: not a JSON object")
    return doc


def plain_name(name: Any) -> bool:
    """A shard or segment id that stays inside its directory."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


class PublishLog:
    """``log/<seq>.json`` under a remote root, each entry created only if absent; a local copy of each entry acted on
    is kept under the mirror's ``log/``.

    The next entry to try is one past the highest number held here. Reading new entries lists only the names after
    the entries this mirror holds without a gap (on a back-end that cannot list after a name, Azure's, it reads them
    by name in turn), so a sync costs the same however long the history. Every
    `condense_every` entries, the writer of the last one also writes them as one ``log-condensed/<last>.json``
    (created only if absent), and a new mirror reads those blocks instead of each entry: N / `condense_every`
    objects, not N. The local copies are condensed the same way (``<first>-<last>.json``), so that the mirror's
    ``log/`` holds N / `condense_every` files, not N.
    """

    def __init__(self, objects: ObjectRoot, local: Path, condense_every: int = CONDENSE_EVERY) -> None:
        self.objects, self.local, self.condense_every = objects, local / LOG, condense_every

    @staticmethod
    def _number(name: str) -> int | None:
        match = _ENTRY.match(name)
        return int(match.group(1)) if match else None

    @staticmethod
    def _name(seq: int) -> str:
        return f"{seq:012d}.json"

    def _held(self) -> list[tuple[int, int]]:
        """The entries held here, as sorted (first, last) ranges: single copies and local blocks, one directory scan."""
        if not self.local.is_dir():
            return []
        singles, blocks = [], []
        for entry in os.scandir(self.local):
            if match := _ENTRY.match(entry.name):
                singles.append(int(match.group(1)))
            elif match := _LOCAL_BLOCK.match(entry.name):
                blocks.append((int(match.group(1)), int(match.group(2))))
        blocks.sort()
        starts = [first for first, _ in blocks]

        def in_a_block(seq: int) -> bool:  # a copy left by a process killed while condensing: the block has it
            k = bisect.bisect_right(starts, seq) - 1
            return k >= 0 and seq <= blocks[k][1]

        return sorted([*blocks, *((seq, seq) for seq in singles if not in_a_block(seq))])

    def seen(self) -> list[int]:
        """The numbers of the entries held here."""
        return [seq for first, last in self._held() for seq in range(first, last + 1)]

    @staticmethod
    def _held_through(held: list[tuple[int, int]]) -> int:
        """The highest number up to which every entry is held (-1 when entry 0 is not)."""
        through = -1
        for first, last in held:
            if first > through + 1:
                break
            through = max(through, last)
        return through

    def _listed_after(self, prefix: str, after: int) -> list[int]:
        names = self.objects.names(prefix, self._name(after) if after >= 0 else None)
        return [seq for seq in map(self._number, names) if seq is not None]

    def _position(self) -> tuple[int, set[int]]:
        """(the number up to which every entry is held here, or -1; the numbers held beyond it, after a hole)."""
        held = self._held()
        after = self._held_through(held)
        return after, {seq for first, last in held if last > after for seq in range(first, last + 1)}

    def unseen_numbers(self) -> list[int]:
        """Numbers of the remote entries not copied here (one listing, no entry read; on a back-end that lists after a
        name)."""
        after, beyond = self._position()
        return [seq for seq in self._listed_after(LOG, after) if seq not in beyond]

    def unseen(self) -> list[tuple[int, bytes]]:
        """Remote entries not copied here yet, oldest first (raw bytes; `keep` them once acted on)."""
        after, beyond = self._position()
        if not self.objects.lists_after:
            return self._read_in_turn(after, beyond)
        found: dict[int, bytes] = {}
        cursor = after  # every entry up to here is held or found
        for last in self._listed_after(CONDENSED, after):
            block = self._remote_block(last)
            if not block:
                break
            if block[0][0] > cursor + 1:  # a block is missing before this one (its writer died before writing it)
                entries, whole = self._entries_by_name(range(cursor + 1, block[0][0]), beyond)
                found.update(entries)
                if not whole:
                    break  # an entry is missing too: the listing below reads on from `cursor`
            found.update((seq, raw) for seq, raw in block if seq > after and seq not in beyond)
            cursor = max(cursor, block[-1][0])
        for seq in self._listed_after(LOG, cursor):
            if seq in beyond or seq in found:
                continue
            stored = self.objects.read(f"{LOG}/{self._name(seq)}")
            if stored is None:
                raise RemoteFileMissing(f"{self.objects.url}/{LOG}/{self._name(seq)}: listed but missing")
            found[seq] = stored.data
        return sorted(found.items())

    def _read_in_turn(self, after: int, beyond: set[int]) -> list[tuple[int, bytes]]:
        """`unseen` where the back-end cannot list after a name (Azure): the condensed block that holds the next
        number, or where there is none that block's entries one by one, and so on up to the first entry that does not
        exist. A writer creates the number one past the highest it holds after catching up, so the log has no hole
        for a missing number to hide entries behind; a sync reads the new entries and two names that are not there
        yet, however long the history."""
        found: dict[int, bytes] = {}
        cursor, size = after, self.condense_every
        while True:
            last = (cursor + 1) // size * size + size - 1
            block = self._block_by_name(last)
            if block:
                found.update((seq, raw) for seq, raw in block if seq > after and seq not in beyond)
            else:  # no block (not yet, or its writer died before writing it): its entries, then the next block
                entries, whole = self._entries_by_name(range(cursor + 1, last + 1), beyond)
                found.update(entries)
                if not whole:
                    return sorted(found.items())
            cursor = last

    def _block_by_name(self, last: int) -> list[tuple[int, bytes]]:
        """The condensed block ending at `last`, or nothing where there is none, or one that is not the block of
        `condense_every` entries its name says (damaged, or written with another size): its entries are then read."""
        name = f"{CONDENSED}/{self._name(last)}"
        stored = self.objects.read(name)
        if stored is None:
            return []
        try:
            block = _block_entries(f"{self.objects.url}/{name}", stored.data)
        except DataProblem as exc:
            block = []
            logger.warning(f"{exc}; its entries are read one by one")
        first = last - self.condense_every + 1
        if block and [seq for seq, _ in block] != list(range(first, last + 1)):
            logger.warning(f"{self.objects.url}/{name}: not entries {first} to {last}; they are read one by one")
            return []
        return block

    def _entries_by_name(self, numbers: range, beyond: set[int]) -> tuple[dict[int, bytes], bool]:
        """The remote entries `numbers` (those held beyond a hole skipped), each read by its name, up to the first
        that does not exist; and whether every one did."""
        found: dict[int, bytes] = {}
        for seq in numbers:
            if seq not in beyond:
                stored = self.objects.read(f"{LOG}/{self._name(seq)}")
                if stored is None:
                    return found, False
                found[seq] = stored.data
        return found, True

    def _remote_block(self, last: int) -> list[tuple[int, bytes]]:
        name = f"{CONDENSED}/{self._name(last)}"
        stored = self.objects.read(name)
        if stored is None:
            raise RemoteFileMissing(f"{self.objects.url}/{name}: listed but missing on the remote side")
        return _block_entries(f"{self.objects.url}/{name}", stored.data)

    def keep(self, seq: int, raw: bytes) -> None:
        """Copy entry `seq` here; when it is the last of a block whose copies are all here, they become one local
        block."""
        self.local.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.local / self._name(seq), raw)
        if (seq + 1) % self.condense_every:
            return
        first = seq + 1 - self.condense_every
        copies = [self.local / self._name(n) for n in range(first, seq + 1)]
        if all(path.exists() for path in copies):  # else a hole (kept out of order): the copies stay single
            self._keep_block(first, [path.read_bytes() for path in copies])
            for path in copies:
                path.unlink()

    def keep_all(self, entries: list[tuple[int, bytes]]) -> None:
        """`keep` each of `entries` (as `unseen` returns them), a whole block in one local file: a new mirror of a
        long log writes N / `condense_every` files, not N."""
        given, size = dict(entries), self.condense_every
        starts = {seq - seq % size for seq in given}
        whole = {first for first in starts if all(n in given for n in range(first, first + size))}
        for first in sorted(whole):
            self._keep_block(first, [given[n] for n in range(first, first + size)])
        for seq in sorted(given):
            if seq - seq % size not in whole:
                self.keep(seq, given[seq])

    def _keep_block(self, first: int, raws: list[bytes]) -> None:
        """Entries `first, first + 1, ...` held here as one local block file."""
        self.local.mkdir(parents=True, exist_ok=True)
        block = canonical_json({"first": first, "entries": [raw.decode() for raw in raws]})
        atomic_write_bytes(self.local / f"{first:012d}-{first + len(raws) - 1:012d}.json", block)

    def _local_raw(self, held: list[tuple[int, int]]) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        for first, last in held:
            if first == last and (self.local / self._name(first)).exists():
                out.append((first, (self.local / self._name(first)).read_bytes()))
            else:
                path = self.local / f"{first:012d}-{last:012d}.json"
                out.extend(_block_entries(str(path), path.read_bytes()))
        return out

    def entries(self) -> list[dict[str, Any]]:
        """Every entry copied here, oldest first."""
        url = f"{self.objects.url}/{LOG}"
        return [parse_json(f"{url}/{self._name(seq)}", raw) for seq, raw in self._local_raw(self._held())]

    def append(self, doc: dict[str, Any]) -> int | None:
        """Create the next entry; its number, or None when another writer published first (look again, then retry).

        The caller `keep`s the entry once what it names is in the mirror.
        """
        held = self._held()
        seq = max([-1, *(last for _, last in held)]) + 1
        name, raw = f"{LOG}/{self._name(seq)}", canonical_json(doc)
        if not self.objects.lists_after and seq > 0 and self.objects.read(f"{LOG}/{self._name(seq - 1)}") is None:
            # Read by name, an entry past a hole is never seen: the log held here is not the remote's (deleted and
            # made anew since this mirror last looked), and a sync resets the mirror.
            raise UserError(
                f"{self.objects.url}/{LOG}: entry {seq - 1}, held here, is not there: it was deleted or made anew "
                "since this mirror last looked; run again"
            )
        if not self.objects.create(name, raw):
            # A PUT retried after a lost response finds its own entry: that is a success, not a lost race.
            there = self.objects.read(name)
            if there is None or there.data != raw:  # None: the winner's write is still landing
                return None
        if (seq + 1) % self.condense_every == 0:
            self._condense(held, seq, raw)
        return seq

    def _condense(self, held: list[tuple[int, int]], last: int, raw: bytes) -> None:
        """Write entries `last - condense_every + 1 ..= last` as one block, if every one of them is held here (a
        block is an optimisation: readers read the entries one by one without it)."""
        first = last - self.condense_every + 1
        copies = dict(self._local_raw([(a, b) for a, b in held if b >= first]))
        if not all(seq in copies for seq in range(first, last)):
            return
        entries = [copies[seq].decode() for seq in range(first, last)] + [raw.decode()]
        try:
            self.objects.create(f"{CONDENSED}/{self._name(last)}", canonical_json({"first": first, "entries": entries}))
        except UserError as exc:  # the entry is published; without its block, readers read the entries one by one
            logger.warning(f"{exc} (the log's condensed block {last} is not written; nothing is lost)")


def _block_entries(where: str, data: bytes) -> list[tuple[int, bytes]]:
    """The numbered entries of a condensed block (remote or local)."""
    doc = parse_json(where, data)
    first, entries = doc.get("first"), doc.get("entries")
    if not isinstance(first, int) or not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise DataProblem(f"{where}: not a condensed log block")
    return [(first + i, entry.encode()) for i, entry in enumerate(entries)]


def reset_if_rebuilt(local: Path, identity: bytes) -> None:
    """Empty the mirror `local` when the remote it copies was deleted and made anew under the same URL (call under
    `mirror_lock`).

    `identity` is what the remote was created with (a writer adds a random id); the mirror's
    copies and log entries of the old remote would otherwise pass for the new one's.
    """
    marker = local / ".remote-identity"
    if marker.exists() and marker.read_bytes() != identity:
        for entry in local.iterdir():
            if entry.name not in (MIRROR_LOCK, marker.name):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if not marker.exists() or marker.read_bytes() != identity:
        atomic_write_bytes(marker, identity)


def fetch_tree(url: str, fs: Any, prefix: str, into: Path) -> None:
    """Copy every file under the remote `prefix` into `into`, refusing names that leave it."""
    prefix = prefix.rstrip("/") + "/"
    for path in remote_call(url, fs.find, prefix):
        relative = path[len(prefix) :]
        if ".." in Path(relative).parts or Path(relative).is_absolute():
            raise DataProblem(f"{path}: a file name that leaves its segment; not used")
        fetch(fs, path, into / relative)
