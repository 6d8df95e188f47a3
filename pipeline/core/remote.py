"""Caches and stores on object storage (fsspec URLs: s3://, gs://, ...): local mirrors for reading, a publication log
for writing.

Reading. The trainer memory-maps store shards and re-reads cache shards; both are immutable
once published, so a remote cache or store is copied once, file by file, into a local
mirror, and each copied file is checked against the checksum recorded when it was written
(the cache's manifests, the store's per-segment sha256). A later call fetches only what was
published since. One process at a time updates a mirror (a file lock); a file arrives under
a temporary name and is renamed when whole, and a shard or segment counts as mirrored only
once all of it is there, so a killed mirror resumes.

Writing. Object storage has no rename and no lock, but S3 has a conditional put: an object
created only if absent. A writer uploads its shard or segment under a unique name, then
creates the next entry of ``log/<seq>.json`` naming it; of two writers that race for one
entry exactly one succeeds, and the other fetches what was published, drops its rows that
are now there and tries the next entry. A shard or segment exists for readers once a log
entry (or, for trees uploaded whole, a manifest or the store root's list) names it; an
upload whose writer died before its entry is never read.

Credentials and endpoints come from fsspec's usual configuration (for S3: the AWS
environment variables, e.g. ``AWS_ENDPOINT_URL`` for an S3-compatible server).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from filelock import FileLock

from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes, user_cache_dir
from pipeline.core.recipes import canonical_json, sha256_file

WRITABLE_PROTOCOLS = ("s3", "s3a")
LOG = "log"
MIRROR_LOCK = ".mirror.lock"
_ENTRY = re.compile(r"^(\d{12})\.json$")
T = TypeVar("T")


class RemoteFileMissing(DataProblem):
    """A file that a listing or a log entry named is gone (deleted since, e.g. by a compaction: look again)."""


def is_remote(location: str | Path | None) -> TypeGuard[str]:
    """A URL (scheme://...); plain paths are local."""
    return isinstance(location, str) and "://" in location


def remote_call(url: str, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, one fsspec call; any failure of the remote side (credentials, network, permissions)
    becomes one line.

    FileExistsError passes through: it is how a conditional put that found the object reports.
    """
    try:
        return call(*args, **kwargs)
    except (UserError, DataProblem, FileExistsError):
        raise
    except Exception as exc:  # s3fs, botocore and aiohttp raise many unrelated types
        raise remote_error(url, exc) from None


def remote_error(url: str, exc: Exception) -> UserError:
    """The one line a failure of the remote side gets."""
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return UserError(f"{url}: {type(exc).__name__}: {detail[:200]}")


def filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UserError(
            f"{url}: cannot open ({str(exc).splitlines()[0]}); for s3:// install s3fs (`pip install tcjepa[remote]`)"
        ) from None
    return fs, root.rstrip("/")


def writable_filesystem(url: str, option: str) -> tuple[Any, str]:
    """The file system and root of a URL that writers may publish to: one whose conditional put tcjepa relies on."""
    protocol = url.split("://", 1)[0].lower()
    if protocol not in WRITABLE_PROTOCOLS:
        raise UserError(
            f"{option} {url}: tcjepa writes to object storage only through S3's conditional put (s3://); "
            f"give a local directory and upload the finished tree, or use an s3:// URL"
        )
    return filesystem(url)


def remote_root(url: str, marker: str, what: str) -> tuple[Any, str]:
    """The file system and root of `url`, refusing a URL whose root lacks `marker`."""
    fs, root = filesystem(url)
    if not remote_call(url, fs.exists, f"{root}/{marker}"):
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
    """``log/<seq>.json`` under a remote root; each entry is created only if absent, and a local copy is kept.

    The local copies (under the mirror's ``log/``) are the entries already acted on: the
    next entry to try is one past the highest sequence number seen, here or remotely.
    """

    def __init__(self, url: str, fs: Any, root: str, local: Path) -> None:
        self.url, self._fs, self._dir, self.local = url, fs, f"{root}/{LOG}", local / LOG

    @staticmethod
    def _numbers(names: Iterable[str]) -> list[int]:
        return sorted(int(m.group(1)) for m in map(_ENTRY.match, names) if m)

    def _name(self, seq: int) -> str:
        return f"{seq:012d}.json"

    def seen(self) -> list[int]:
        return self._numbers(p.name for p in self.local.glob("*.json")) if self.local.is_dir() else []

    def remote(self) -> list[int]:
        return self._numbers(remote_names(self._fs, self.url, self._dir))

    def unseen(self) -> list[tuple[int, bytes]]:
        """Remote entries not copied here yet, oldest first (raw bytes; `keep` them once acted on)."""
        seen = set(self.seen())
        out = []
        for seq in self.remote():
            if seq not in seen:
                path = f"{self._dir}/{self._name(seq)}"
                out.append((seq, remote_call(self.url, self._fs.cat_file, path)))
        return out

    def keep(self, seq: int, raw: bytes) -> None:
        self.local.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.local / self._name(seq), raw)

    def entries(self) -> list[dict[str, Any]]:
        """Every entry copied here, oldest first."""
        return [
            parse_json(f"{self._dir}/{self._name(s)}", (self.local / self._name(s)).read_bytes()) for s in self.seen()
        ]

    def append(self, doc: dict[str, Any]) -> int | None:
        """Create the next entry; its number, or None when another writer published first (look again, then retry).

        The caller `keep`s the entry once what it names is in the mirror.
        """
        seq = max([-1, *self.seen()]) + 1
        path, raw = f"{self._dir}/{self._name(seq)}", canonical_json(doc)
        try:
            self._fs.pipe_file(path, raw, mode="create")
        except Exception as exc:
            if not _lost_a_race(exc):
                raise remote_error(self.url, exc) from None
            # A PUT retried after a lost response finds its own entry: that is a success, not a lost race.
            try:
                there = self._fs.cat_file(path)
            except FileNotFoundError:  # a conflict reported while the winner's write was still landing
                return None
            except Exception as read_exc:
                raise remote_error(self.url, read_exc) from None
            return seq if there == raw else None
        return seq


def _lost_a_race(exc: Exception) -> bool:
    """A conditional put refused because the object exists or is being written (S3: 412, or 409
    ConditionalRequestConflict)."""
    text = f"{type(exc).__name__} {exc}"
    return isinstance(exc, FileExistsError) or any(
        k in text for k in ("PreconditionFailed", "pre-conditions", "ConditionalRequestConflict", "409")
    )


def create_if_absent(fs: Any, url: str, path: str, data: bytes) -> bytes:
    """Put `data` at `path` unless something is there already; returns what is there now."""
    try:
        remote_call(url, fs.pipe_file, path, data, mode="create")
        return data
    except FileExistsError:
        return remote_call(url, fs.cat_file, path)


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
