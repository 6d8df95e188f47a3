"""Caches and stores on object storage (fsspec URLs: s3://, gs://, ...), mirrored to a local directory for reading.

The trainer memory-maps store shards and re-reads cache shards; both are immutable once
published, so a remote cache or store is copied once, file by file, into a local mirror,
and each copied file is checked against the checksum recorded when it was written (the
cache's per-shard manifests, the store's per-segment sha256). A later call fetches only
what was published since. One process at a time updates a mirror (a file lock); a file
arrives under a temporary name and is renamed when whole, and a shard or segment counts
as mirrored only once all of it is there, so a killed mirror resumes. Credentials and
endpoints come from fsspec's usual configuration (for S3: the AWS environment variables,
e.g. ``AWS_ENDPOINT_URL`` for an S3-compatible server).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from pipeline.errors import DataProblem, UserError
from pipeline.fsutil import atomic_write_bytes
from pipeline.recipes import sha256_file

DEFAULT_MIRROR = Path.home() / ".cache" / "tcjepa" / "mirror"
T = TypeVar("T")


def is_remote(location: str | Path | None) -> bool:
    """A URL (scheme://...); plain paths are local."""
    return isinstance(location, str) and "://" in location


def refuse_remote_writes(location: str | Path, option: str) -> None:
    """Writers publish with a file lock and renames, which object storage lacks: refuse in one line."""
    if is_remote(str(location)):
        raise UserError(f"{option} {location}: writing to object storage is not supported; give a local directory (a plain path) "
                        f"and upload the finished tree (e.g. `aws s3 sync`); readers such as `tcjepa train` take the URL")


def _remote_call(url: str, call: Callable[[], T]) -> T:
    """Run one fsspec call; any failure of the remote side (credentials, network, permissions) becomes one line."""
    try:
        return call()
    except (UserError, DataProblem):
        raise
    except Exception as exc:  # s3fs, botocore and aiohttp raise many unrelated types
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(f"{url}: {type(exc).__name__}: {detail[:200]}") from None


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UserError(f"{url}: cannot open ({str(exc).splitlines()[0]}); for s3:// install s3fs (`pip install tcjepa[remote]`)") from None
    return fs, root.rstrip("/")


def _remote_root(url: str, marker: str, what: str) -> tuple[Any, str]:
    """The file system and root of `url`, refusing a URL whose root lacks `marker`."""
    fs, root = _filesystem(url)
    if not _remote_call(url, lambda: fs.exists(f"{root}/{marker}")):
        raise UserError(f"{url} is not {what} (no {marker})")
    return fs, root


def mirror_path(url: str, mirror: Path | None = None) -> Path:
    """Where `url` is (or will be) mirrored: one directory per URL under `mirror`."""
    base = Path(mirror) if mirror is not None else DEFAULT_MIRROR
    return base / f"{Path(url.rstrip('/')).name}-{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}"


def _fetch(fs: Any, remote: str, local: Path, sha256: str | None = None) -> None:
    """Copy one file (skipped when present); with `sha256`, refuse a copy that does not match it."""
    if local.exists():
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.part")
    try:
        try:
            fs.get_file(remote, str(tmp))
        except FileNotFoundError:
            raise DataProblem(f"{remote}: listed but missing on the remote side") from None
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise UserError(f"{remote}: cannot fetch ({type(exc).__name__}: {detail[:200]})") from None
        if sha256 is not None and sha256_file(tmp) != sha256:
            raise DataProblem(f"{remote}: does not match the sha256 recorded when it was written (changed or damaged); not used")
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def _json(url: str, raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        raise DataProblem(f"{url}: not valid JSON") from None
    if not isinstance(doc, dict):
        raise DataProblem(f"{url}: not a JSON object")
    return doc


def mirror_cache(url: str, mirror: Path | None = None) -> Path:
    """A local copy of the caption cache at `url`, brought up to date; each shard checked against its manifest."""
    fs, root = _remote_root(url, "CACHE.json", "a caption cache")
    local = mirror_path(url, mirror)
    local.mkdir(parents=True, exist_ok=True)
    with FileLock(str(local / ".mirror.lock")):
        for sub in ("recipes", "captions", "failures", "manifests", "tmp"):
            (local / sub).mkdir(exist_ok=True)
        atomic_write_bytes(local / "CACHE.json", _remote_call(url, lambda: fs.cat_file(f"{root}/CACHE.json")))
        for path in _remote_call(url, lambda: fs.glob(f"{root}/recipes/*.json")):
            _fetch(fs, path, local / "recipes" / Path(path).name)
        manifests = sorted(_remote_call(url, lambda: fs.glob(f"{root}/manifests/*.json")))
        fetched = 0
        for path in manifests:
            stem = Path(path).stem
            if (local / "manifests" / f"{stem}.json").exists():  # written last: the shard is all here
                continue
            raw = _remote_call(url, lambda: fs.cat_file(path))
            doc = _json(path, raw)
            files = doc.get("files") if doc.get("shard") == stem else None
            if not isinstance(files, dict) or "captions" not in files:
                raise DataProblem(f"{path}: not the manifest of shard {stem}")
            for kind in ("failures", "captions"):
                entry = files.get(kind)
                if entry is None:
                    continue
                if not isinstance(entry, dict) or entry.get("path") != f"{kind}/{stem}.parquet" or "sha256" not in entry:
                    raise DataProblem(f"{path}: its {kind} entry does not name {kind}/{stem}.parquet with a sha256")
                _fetch(fs, f"{root}/{entry['path']}", local / entry["path"], entry["sha256"])
            atomic_write_bytes(local / "manifests" / f"{stem}.json", raw)
            fetched += 1
    print(f"mirror: {url} -> {local}: {fetched} new of {len(manifests)} shards", file=sys.stderr)
    return local


def mirror_store(url: str, mirror: Path | None = None) -> Path:
    """A local copy of the embedding store at `url`: the segments its root lists, each checked against its sha256."""
    from embedding_cache.store import STAGING, EmbeddingStore
    from embedding_cache.verify import verify_segment

    fs, root = _remote_root(url, "zarr.json", "an embedding store")
    local = mirror_path(url, mirror)
    local.mkdir(parents=True, exist_ok=True)
    with FileLock(str(local / ".mirror.lock")):
        root_meta = _remote_call(url, lambda: fs.cat_file(f"{root}/zarr.json"))
        meta = _json(f"{url}/zarr.json", root_meta).get("attributes", {}).get("tcjepa", {})
        segments = meta.get("segments")
        if not isinstance(segments, list) or not all(isinstance(s, str) and s and "/" not in s and s not in (".", "..") for s in segments):
            raise DataProblem(f"{url}/zarr.json: not a tcjepa embedding store root (no valid segment list)")
        (local / "segments").mkdir(exist_ok=True)
        # The remote root first: segments are checked against its encoder (a store rebuilt under the same URL lists
        # new segments only, and the old ones left here are no longer read).
        atomic_write_bytes(local / "zarr.json", root_meta)
        _fetch(fs, f"{root}/segments/zarr.json", local / "segments" / "zarr.json")
        store = EmbeddingStore(local)
        fetched = 0
        for segment in segments:
            final = local / "segments" / segment
            if final.exists():  # renamed in only once fetched whole and checked
                continue
            staging = local / STAGING / segment
            shutil.rmtree(staging, ignore_errors=True)
            prefix = f"{root}/segments/{segment}/"
            for path in _remote_call(url, lambda: fs.find(prefix)):
                relative = path[len(prefix):]
                if ".." in Path(relative).parts or Path(relative).is_absolute():
                    raise DataProblem(f"{path}: a file name that leaves its segment; not used")
                _fetch(fs, path, staging / relative)
            verify_segment(store, segment, staging)
            staging.rename(final)
            fetched += 1
        shutil.rmtree(local / STAGING, ignore_errors=True)
    print(f"mirror: {url} -> {local}: {fetched} new of {len(segments)} segments", file=sys.stderr)
    return local
