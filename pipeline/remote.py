"""Caches and stores on object storage (fsspec URLs: s3://, gs://, ...), mirrored to a local directory for reading.

The trainer memory-maps store shards and re-reads cache shards; both are immutable once
published, so a remote cache or store is copied once, file by file, into a local mirror,
and each copied file is checked against the checksum recorded when it was written (the
cache's per-shard manifests, the store's per-segment sha256). A later call fetches only
what was published since; a file arrives under a temporary name and is renamed when
whole, so a killed mirror resumes. Credentials and endpoints come from fsspec's usual
configuration (for S3: the AWS environment variables, e.g. ``AWS_ENDPOINT_URL`` for an
S3-compatible server).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.fsutil import atomic_write_bytes
from pipeline.recipes import sha256_file

DEFAULT_MIRROR = Path.home() / ".cache" / "tcjepa" / "mirror"


def is_remote(location: str | Path | None) -> bool:
    """A URL with a scheme other than file://; plain paths are local."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


def refuse_remote_writes(location: str | Path, option: str) -> None:
    """Writers publish with a file lock and renames, which object storage lacks: refuse in one line."""
    if is_remote(str(location)):
        raise UserError(f"{option} {location}: writing to object storage is not supported; write to a local directory and upload "
                        f"the finished tree (e.g. `aws s3 sync`); readers such as `tcjepa train` take the URL")


def _filesystem(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise UserError(f"{url}: cannot open ({str(exc).splitlines()[0]}); for s3:// install s3fs (`pip install tcjepa[remote]`)") from None
    return fs, root.rstrip("/")


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
        fs.get_file(remote, str(tmp))
    except FileNotFoundError:
        raise UserError(f"{remote}: listed but missing on the remote side; run `tcjepa cache verify` / `store verify` where it was written") from None
    if sha256 is not None and sha256_file(tmp) != sha256:
        tmp.unlink()
        raise UserError(f"{remote}: does not match the sha256 recorded when it was written (changed or damaged); not used")
    os.replace(tmp, local)


def mirror_cache(url: str, mirror: Path | None = None) -> Path:
    """A local copy of the caption cache at `url`, brought up to date; each shard checked against its manifest."""
    fs, root = _filesystem(url)
    local = mirror_path(url, mirror)
    if not fs.exists(f"{root}/CACHE.json"):
        raise UserError(f"{url} is not a caption cache (no CACHE.json)")
    for sub in ("recipes", "captions", "failures", "manifests", "tmp"):
        (local / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(local / "CACHE.json", fs.cat_file(f"{root}/CACHE.json"))
    for path in fs.glob(f"{root}/recipes/*.json"):
        _fetch(fs, path, local / "recipes" / Path(path).name)
    manifests = sorted(fs.glob(f"{root}/manifests/*.json"))
    fetched = 0
    for path in manifests:
        raw = fs.cat_file(path)
        doc = json.loads(raw)
        shard = doc["shard"]
        if (local / "captions" / f"{shard}.parquet").exists():
            continue
        for kind in ("failures", "captions"):  # captions last: a shard is there once its captions file is
            entry = doc["files"].get(kind)
            if entry is not None:
                _fetch(fs, f"{root}/{entry['path']}", local / entry["path"], entry["sha256"])
        atomic_write_bytes(local / "manifests" / Path(path).name, raw)
        fetched += 1
    print(f"mirror: {url} -> {local}: {fetched} new of {len(manifests)} shards", file=sys.stderr)
    return local


def mirror_store(url: str, mirror: Path | None = None) -> Path:
    """A local copy of the embedding store at `url`: the segments its root lists, each checked against its sha256."""
    from embedding_cache.store import EmbeddingStore
    from embedding_cache.verify import verify_segment

    fs, root = _filesystem(url)
    local = mirror_path(url, mirror)
    if not fs.exists(f"{root}/zarr.json"):
        raise UserError(f"{url} is not an embedding store (no zarr.json)")
    root_meta = fs.cat_file(f"{root}/zarr.json")
    segments = json.loads(root_meta)["attributes"]["tcjepa"]["segments"]
    (local / "segments").mkdir(parents=True, exist_ok=True)
    # The remote root first: segments are checked against its encoder (a store rebuilt under the same URL lists
    # new segments only, and the old ones left here are no longer read).
    atomic_write_bytes(local / "zarr.json", root_meta)
    _fetch(fs, f"{root}/segments/zarr.json", local / "segments" / "zarr.json")
    fetched = 0
    for segment in segments:
        final = local / "segments" / segment
        if final.exists():
            continue
        staging = local / ".staging" / segment
        shutil.rmtree(staging, ignore_errors=True)
        prefix = f"{root}/segments/{segment}/"
        for path in fs.find(prefix):
            _fetch(fs, path, staging / path[len(prefix):])
        store = EmbeddingStore(local)
        verify_segment(store, segment, staging)
        staging.rename(final)
        fetched += 1
    shutil.rmtree(local / ".staging", ignore_errors=True)
    print(f"mirror: {url} -> {local}: {fetched} new of {len(segments)} segments", file=sys.stderr)
    return local
