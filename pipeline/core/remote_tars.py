"""Image tar shards on object storage (fsspec URLs such as ``s3://bucket/shards/``): listed, read while the run index
is built, and fetched per node into a local mirror before training reads a byte of them.

Listing. A URL names one shard, or a prefix whose ``.tar`` shards are taken as a local folder's are: sorted, and
labelled by their path under the prefix, so their source ids are those of the same shards on local disk (captions
made from local copies join). Members come from the tar headers alone, read by byte range through a file object that
reads ahead only a few KiB (one request per member, none of the images' data beyond that), the shards in parallel.

Reading at index build. The sampled sha256 checks, and the hashing of images the caption cache has no record for,
read members by byte range, many requests at once (fsspec's ``cat_ranges``). Training never does.

Fetching. After the partition split a node needs only the shards its partitions' images lie in. Each is downloaded
under a temporary name (a killed download continues from where it stopped), every member the run index uses is
checked against the sha256 the index holds for it, and only then is it renamed in, as the store mirror checks each
segment against its recorded digest. A record beside each shard lists the members already checked, so a later start
(another run on the same shards) checks only what is new to it, and a copy that no longer matches is fetched anew.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes
from pipeline.core.refs import IMAGE_SUFFIXES, TABLE_SUFFIXES, TAR_SUFFIXES, ImageRef, tar_member_refs
from pipeline.core.remote import filesystem, mirror_lock, mirror_path, remote_call, remote_error

HEADER_READ_AHEAD = 4096  # bytes a header read fetches: the header (and any long-name block) and little else
LIST_THREADS = 16  # shards whose headers are read at once
RANGE_BATCH = 256  # members read by one `cat_ranges` call at index build
FETCH_THREADS = 8  # shards downloaded at once
PIECE = 32 << 20  # bytes of a shard per request while it is downloaded
_RECORD = np.dtype([("offset", "<i8"), ("size", "<i8"), ("sha256", "V32")])  # one checked member


def list_remote_tars(urls: list[str], threads: int = LIST_THREADS) -> dict[str, Sequence[ImageRef]]:
    """Refs of the image members of every shard each URL names (a shard, or a prefix of shards), keyed by URL, in
    the order a local folder of the same shards lists them. Every URL is checked before any header is read."""
    shards = {url: _shards(url) for url in urls}
    jobs = [shard for url in urls for shard in shards[url]]
    with ThreadPoolExecutor(threads) as pool:
        listed = iter(list(pool.map(lambda shard: _shard_refs(*shard), jobs)))
    return {url: [ref for _ in shards[url] for ref in next(listed)] for url in urls}


def _shards(url: str) -> list[tuple[str, str]]:
    """(shard URL, label) of each tar shard `url` names, sorted as a local folder's files are."""
    fs, path = filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise UserError(f"{url}: no such object or prefix") from None
    except Exception as exc:  # s3fs and botocore raise many unrelated types
        raise remote_error(url, exc) from None
    if info.get("type") != "directory":
        name = PurePosixPath(path).name
        if not name.lower().endswith(TAR_SUFFIXES):
            raise UserError(
                f"{url}: images on object storage are read from tar shards only (.tar, or a prefix of them)"
            )
        return [(url, name)]
    shards: list[PurePosixPath] = []
    others = 0
    for key in remote_call(url, fs.find, path):
        relative = PurePosixPath(key[len(path) :].lstrip("/"))
        name = relative.name.lower()
        if name.endswith(TAR_SUFFIXES):
            shards.append(relative)
        elif name.endswith((*IMAGE_SUFFIXES, *TABLE_SUFFIXES)):
            others += 1
    if others:
        raise UserError(
            f"{url}: holds {others} image or Parquet files besides tar shards; images on object storage are read from "
            "tar shards only (pack them into .tar shards, or train on a local copy)"
        )
    if not shards:
        raise UserError(f"{url}: no .tar shards under this prefix")
    return [(f"{url.rstrip('/')}/{shard.as_posix()}", shard.as_posix()) for shard in sorted(shards)]


def _shard_refs(url: str, label: str) -> Sequence[ImageRef]:
    fs, path = filesystem(url)

    def walk() -> Sequence[ImageRef]:
        with fs.open(path, "rb", block_size=HEADER_READ_AHEAD, cache_type="readahead") as f:
            return tar_member_refs(f, label, url, url)

    return remote_call(url, walk)


def read_ranges(refs: list[ImageRef]) -> list[bytes | None]:
    """Each ref's bytes (None: unreadable), tar members on object storage read by byte range, all at once
    (one `cat_ranges` call per protocol)."""
    out: list[bytes | None] = [None] * len(refs)
    protocols: dict[str, list[int]] = {}
    for i, ref in enumerate(refs):
        protocols.setdefault(ref.path.split("://", 1)[0], []).append(i)
    for rows in protocols.values():
        fs, _ = filesystem(refs[rows[0]].path)
        got = fs.cat_ranges(
            [filesystem(refs[i].path)[1] for i in rows],
            [refs[i].offset for i in rows],
            [refs[i].offset + refs[i].size for i in rows],
            on_error="return",
        )
        for i, data in zip(rows, got):
            if isinstance(data, bytes) and len(data) == refs[i].size:
                out[i] = data
    return out


# ---- a node's shards, fetched and checked ---------------------------------------------------------------------


@dataclass(frozen=True)
class ShardMembers:
    """What a run uses of one shard: its members' byte ranges and the sha256 the run index holds for each."""

    offsets: np.ndarray  # int64 [k]
    sizes: np.ndarray  # int64 [k]
    sha256: np.ndarray  # uint8 [k, 32]
    source_ids: Sequence[Any]  # each member's source id (anything whose str() is it), for an error

    def records(self) -> np.ndarray:
        out = np.empty(len(self.offsets), _RECORD)
        out["offset"], out["size"] = self.offsets, self.sizes
        out["sha256"] = np.ascontiguousarray(self.sha256, dtype=np.uint8).view("V32").reshape(-1)
        return out


@dataclass(frozen=True)
class FetchedShards:
    shards: int
    fetched: int  # of them, downloaded now (the others were in the mirror already)
    bytes: int  # the local copies' size
    directories: list[Path]


def shard_mirror(url: str, mirror: Path | None = None) -> Path:
    """Where the shard at `url` is copied: its name, in one mirror directory per remote prefix."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return mirror_path(parent, mirror) / name


def fetch_shards(
    members: dict[str, ShardMembers], mirror: Path | None = None, recheck: bool = False, threads: int = FETCH_THREADS
) -> FetchedShards:
    """Copy each shard of `members` into the local mirror unless there already, each renamed in only once every member
    the run uses matches its sha256 (one that does not is a DataProblem, and nothing of that shard is used).

    `recheck` checks copies already in the mirror again in full, not only members no earlier run checked.
    """
    targets = {url: shard_mirror(url, mirror) for url in members}
    directories = sorted({path.parent for path in targets.values()})
    with ExitStack() as locks:
        for directory in directories:
            directory.mkdir(parents=True, exist_ok=True)
            locks.enter_context(mirror_lock(directory))
        with ThreadPoolExecutor(threads) as pool:
            fetched = sum(pool.map(lambda url: _fetch_shard(url, targets[url], members[url], recheck), members))
    return FetchedShards(len(members), fetched, sum(p.stat().st_size for p in targets.values()), directories)


def _fetch_shard(url: str, final: Path, members: ShardMembers, recheck: bool) -> bool:
    """Make `final` a checked copy of the shard at `url` (call under the directory's mirror lock); whether it was
    downloaded now."""
    wanted = members.records()
    checked = final.with_name(f".{final.name}.checked")
    if final.exists():
        done = np.empty(0, _RECORD) if recheck or not checked.exists() else np.frombuffer(checked.read_bytes(), _RECORD)
        todo = np.flatnonzero(~np.isin(wanted, done))
        if not len(todo):
            return False
        if _first_mismatch(final, members, todo) is None:
            atomic_write_bytes(checked, np.union1d(done, wanted).tobytes())
            return False
        # not the shard this index was built from (the remote changed since, and a new index with it): fetched anew
        final.unlink()
    part = final.with_name(f".{final.name}.part")
    everything = np.arange(len(wanted))
    resumed = part.exists()
    _download(url, part)
    bad = _first_mismatch(part, members, everything)
    if bad is not None and resumed:  # what a killed download left may be of another version: once more, afresh
        part.unlink()
        _download(url, part)
        bad = _first_mismatch(part, members, everything)
    if bad is not None:
        part.unlink()
        raise DataProblem(
            f"{url}: image {members.source_ids[bad]} does not match the sha256 in the run's index (the shard changed "
            "since the index was built); not used. Restore the shard, or delete the run's index.parquet to rebuild "
            "the index"
        )
    atomic_write_bytes(checked, np.unique(wanted).tobytes())
    os.replace(part, final)
    return True


def _download(url: str, part: Path) -> None:
    """Append to `part` what it lacks of the object at `url` (all of it when `part` is new)."""
    fs, path = filesystem(url)
    try:
        size = int(fs.size(path))
    except FileNotFoundError:
        raise DataProblem(f"{url}: gone from object storage since the run's index was built") from None
    except Exception as exc:  # s3fs and botocore raise many unrelated types
        raise remote_error(url, exc) from None
    with open(part, "ab") as out:
        position = out.tell()
        if position > size:
            out.truncate(0)
            position = 0
        while position < size:
            data = remote_call(url, fs.cat_file, path, start=position, end=min(size, position + PIECE))
            if not data:
                raise DataProblem(f"{url}: ended at byte {position} of the {size} it was listed with")
            out.write(data)
            position += len(data)


def _first_mismatch(path: Path, members: ShardMembers, rows: np.ndarray) -> int | None:
    """The first of `rows` whose bytes in the file at `path` do not have the member's sha256, or None."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for row in rows.tolist():
            data = os.pread(fd, int(members.sizes[row]), int(members.offsets[row]))
            if hashlib.sha256(data).digest() != members.sha256[row].tobytes():
                return int(row)
    finally:
        os.close(fd)
    return None
