"""A caption cache on object storage: read through a local mirror (s3, gs, az, https), written by several hosts (s3).

Reading. `local_cache` is the one place a cache location becomes a local directory: a
path is used as it is; a URL is mirrored (``pipeline.core.remote``): each shard's files
are fetched once, checked against the sha256 in its manifest, and the manifest is written
last, so a killed mirror resumes. The mirror holds exactly the shards the remote has
published, by manifest or in the order of its log.

Writing. A commit drops rows the mirror already
holds, uploads the new shard under its unique name and creates the next log entry with
its manifest; if another writer took that entry first, the commit fetches what was
published, drops its rows that are now there, uploads the rest as a new shard and tries
again. Only then does the shard join the mirror, so the mirror never holds a row twice.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from filelock import FileLock

from captioning.cache import (
    CAPTION_SCHEMA,
    FAILURE_SCHEMA,
    FORMAT,
    SUBDIRS,
    VERSION,
    CaptionCache,
    CommitResult,
    RowBatch,
    manifest_doc,
    new_shard_id,
)
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes
from pipeline.core.garbage import GarbageReport, claimed, collect_garbage, is_claim
from pipeline.core.logs import NODE
from pipeline.core.objects import ObjectRoot
from pipeline.core.recipes import canonical_json, recipe_hash
from pipeline.core.remote import (
    CONDENSED,
    LOG,
    PublishLog,
    RemoteFileMissing,
    fetch,
    is_remote,
    mirror_lock,
    mirror_path,
    parse_json,
    plain_name,
    remote_call,
    remote_error,
    remote_names,
    remote_root,
    reset_if_rebuilt,
    writable_filesystem,
)

logger = logging.getLogger(__name__)


def _fetch_cache_shard(fs: Any, root: str, local: Path, stem: str, source: str, doc: dict[str, Any]) -> None:
    """Fetch one shard's files named by its manifest `doc`, each checked, then write the manifest (last)."""
    files = doc.get("files") if doc.get("shard") == stem else None
    if not plain_name(stem) or not isinstance(files, dict) or "captions" not in files:
        raise DataProblem(f"{source}: not the manifest of shard {stem}")
    for kind in ("failures", "captions"):
        entry = files.get(kind)
        if entry is None:
            continue
        if not isinstance(entry, dict) or entry.get("path") != f"{kind}/{stem}.parquet" or "sha256" not in entry:
            raise DataProblem(f"{source}: its {kind} entry does not name {kind}/{stem}.parquet with a sha256")
        fetch(fs, f"{root}/{entry['path']}", local / entry["path"], entry["sha256"])
    atomic_write_bytes(local / "manifests" / f"{stem}.json", canonical_json(doc))


def sync_cache_mirror(url: str, fs: Any, root: str, local: Path, objects: ObjectRoot) -> int:
    """Bring the mirror `local` up to date with the cache at `url` (call under `mirror_lock`); returns shards fetched.

    A shard is published by a manifest (a tree uploaded whole) or by a log entry (a remote writer). A shard that a
    compacted shard replaces is not fetched; one deleted while this sync ran is found replaced on a second look.
    """
    try:
        return _sync_cache_mirror(url, fs, root, local, objects)
    except RemoteFileMissing:  # most likely compacted away since the listing: the log now says by which shard
        return _sync_cache_mirror(url, fs, root, local, objects)


def _sync_cache_mirror(url: str, fs: Any, root: str, local: Path, objects: ObjectRoot) -> int:
    marker = remote_call(url, fs.cat_file, f"{root}/CACHE.json")
    reset_if_rebuilt(local, marker)
    for sub in ("recipes", "captions", "failures", "manifests", "tmp"):
        (local / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(local / "CACHE.json", marker)
    for name in remote_names(fs, url, f"{root}/recipes"):
        if name.endswith(".json"):
            fetch(fs, f"{root}/recipes/{name}", local / "recipes" / name)
    log = PublishLog(objects, local)
    entries = [(seq, raw, parse_json(f"{url}/{LOG}/{seq:012d}.json", raw)) for seq, raw in log.unseen()]
    replaced = {str(old) for _, _, doc in entries for old in doc.get("replaces", [])}
    fetched = 0
    for name in remote_names(fs, url, f"{root}/manifests"):
        stem = name.removesuffix(".json")
        # The manifest is written last, so a shard that has one here is all here.
        if name.endswith(".json") and stem not in replaced and not (local / "manifests" / name).exists():
            path = f"{root}/manifests/{name}"
            doc = parse_json(path, remote_call(url, fs.cat_file, path))
            replaced.update(str(old) for old in doc.get("replaces", []))
            _fetch_cache_shard(fs, root, local, stem, path, doc)
            fetched += 1
    for seq, raw, doc in entries:
        stem = str(doc.get("shard"))
        if not is_claim(doc) and stem not in replaced and not (local / "manifests" / f"{stem}.json").exists():
            _fetch_cache_shard(fs, root, local, stem, f"{url}/{LOG}/{seq:012d}.json", doc)
            fetched += 1
        log.keep(seq, raw)
    CaptionCache(local).remove_replaced(replaced)
    return fetched


def mirror_cache(url: str, mirror: Path | None = None) -> Path:
    """A local copy of the caption cache at `url`, brought up to date; each shard checked against its manifest."""
    fs, root = remote_root(url, "CACHE.json", "a caption cache")
    local = mirror_path(url, mirror)
    local.mkdir(parents=True, exist_ok=True)
    with mirror_lock(local):
        fetched = sync_cache_mirror(url, fs, root, local, ObjectRoot.of(url))
        total = len(list((local / "manifests").glob("*.json")))
    logger.log(NODE, f"mirror: {url} -> {local}: {fetched} new of {total} shards")
    return local


def local_cache(location: str | Path, mirror: Path | None = None) -> Path:
    """The local directory of the cache at `location`: a path as given, a URL mirrored (brought up to date) first."""
    if is_remote(str(location)):
        return mirror_cache(str(location), mirror)
    return Path(location)


class RemoteCaptionCache(CaptionCache):
    """The cache at `url`, read through the local mirror at `local`, committed to through the remote log."""

    def __init__(self, url: str, local: Path, fs: Any, root: str, objects: ObjectRoot) -> None:
        super().__init__(local)
        self.url, self._fs, self._remote, self._objects = url, fs, root, objects
        self._log = PublishLog(objects, local)

    @classmethod
    def open_or_create(cls, root: str | Path, mirror: Path | None = None) -> RemoteCaptionCache:
        """Open the cache at the URL `root`, or create it; its mirror (under `mirror`) is brought up to date."""
        url = str(root)
        fs, remote_root = writable_filesystem(url, "--cache")
        if not remote_call(url, fs.exists, f"{remote_root}/CACHE.json"):
            # Another creator may have finished between the two looks.
            known = (*SUBDIRS, LOG, CONDENSED, "CACHE.json")
            others = [n for n in remote_names(fs, url, remote_root) if n not in known]
            if others and not remote_call(url, fs.exists, f"{remote_root}/CACHE.json"):
                raise UserError(
                    f"--cache {url} holds other objects ({', '.join(others[:3])}) and no CACHE.json; choose a new "
                    "prefix"
                )
        # The random id tells mirrors this cache from one made later under the same URL.
        marker = canonical_json({"format": FORMAT, "version": VERSION, "id": uuid.uuid4().hex})
        objects = ObjectRoot.of(url)
        objects.create_or_read("CACHE.json", marker)
        local = mirror_path(url, mirror)
        local.mkdir(parents=True, exist_ok=True)
        with mirror_lock(local):
            sync_cache_mirror(url, fs, remote_root, local, objects)
        return cls(url, local, fs, remote_root, objects)

    def _lock(self) -> FileLock:
        return mirror_lock(self.root)

    def add_recipe(self, recipe: dict[str, Any], name: str | None = None) -> str:
        """Store `recipe` on the remote once (the first writer's name wins), then in the mirror."""
        digest = recipe_hash(recipe)
        path = self.root / "recipes" / f"{digest}.json"
        if not path.exists():
            doc = canonical_json({"hash": digest, "name": name, "recipe": recipe})
            stored = self._objects.create_or_read(f"recipes/{digest}.json", doc)
            with self._lock():
                atomic_write_bytes(path, stored)
        return digest

    def _upload(self, shard: str, staged: dict[str, Path]) -> None:
        for kind, tmp in staged.items():
            remote_call(self.url, self._fs.put_file, str(tmp), f"{self._remote}/{kind}/{shard}.parquet")

    def _claimed(self, shard: str) -> bool:
        """Whether a gc claimed this shard's upload (and may be deleting it)."""
        return any(Path(name).stem == shard for name in claimed(self._log.entries()))

    def _published(self, shard: str) -> bool:
        """Whether an entry of the log held here publishes `shard` (a compaction may have replaced it since)."""
        return any(entry.get("shard") == shard for entry in self._log.entries())

    @staticmethod
    def _discard(staged: dict[str, Path]) -> None:
        """Remove the staged copies of an upload (not the upload)."""
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)

    def _withdraw(self, shard: str, staged: dict[str, Path]) -> None:
        """Remove an upload that no entry names (never read) and will not be published."""
        for kind in staged:
            with contextlib.suppress(Exception):
                self._fs.rm_file(f"{self._remote}/{kind}/{shard}.parquet")
        self._discard(staged)

    def commit(
        self, captions: list[dict[str, Any]] | pa.Table, failures: list[dict[str, Any]] | pa.Table | None = None
    ) -> CommitResult:
        """Publish new rows as one shard on the remote and in the mirror; rows published by anyone are dropped."""
        batch = RowBatch.of(captions, failures, set(self.recipes()))
        with self._lock():
            self._clean_and_repair()
            shard, rows = "", (0, 0)  # the upload, if any (`staged`), and the rows it holds
            staged: dict[str, Path] = {}
            while True:
                cap_table, fail_table, cap_digests, fail_digests = self._new_rows(batch)
                # After a lost race the upload is tried again as it is (one conditional put), unless the entries that
                # won published some of its rows (this batch's new rows only shrink: the same count is the same
                # rows) or a gc claimed it; see RemoteEmbeddingStore.publish.
                if staged and (rows != (cap_table.num_rows, fail_table.num_rows) or self._claimed(shard)):
                    self._withdraw(shard, staged)
                    staged = {}
                if cap_table.num_rows == 0 and fail_table.num_rows == 0:
                    return CommitResult(None, 0, batch.offered, 0)
                if not staged:
                    shard, rows = new_shard_id(), (cap_table.num_rows, fail_table.num_rows)
                    staged = self._stage(shard, cap_table, fail_table)
                    doc = manifest_doc(shard, staged)
                    self._upload(shard, staged)
                seq = self._log.append(doc)
                if seq is not None:
                    break
                sync_cache_mirror(self.url, self._fs, self._remote, self.root, self._objects)
                if self._published(shard):  # its own entry landed, though refused: published, not a lost race
                    self._discard(staged)
                    return CommitResult(shard, rows[0], batch.offered - rows[0], rows[1])
            self._publish_staged(shard, staged, cap_digests, fail_digests)
            atomic_write_bytes(self.root / "manifests" / f"{shard}.json", canonical_json(doc))
            self._log.keep(seq, canonical_json(doc))
        return CommitResult(shard, cap_table.num_rows, batch.offered - cap_table.num_rows, fail_table.num_rows)

    def replace_shards(
        self, old: list[str], captions: pa.Table, failures: pa.Table, note: dict[str, Any] | None = None
    ) -> str | None:
        """Publish the rows of shards `old` as one compacted shard through the log, then delete `old` in the mirror
        and on the remote side; None when one of them is no longer published (nothing changed).

        Mirrors that have not synced past `old` skip them once they see this entry; one that listed them just
        before they were deleted looks again (see `sync_cache_mirror`).
        """
        with self._lock():
            sync_cache_mirror(self.url, self._fs, self._remote, self.root, self._objects)
            self._clean_and_repair()
            while True:
                if not set(old) <= set(self.shard_ids()):
                    return None
                shard = new_shard_id(compacted=True)
                staged = self._stage(shard, captions.cast(CAPTION_SCHEMA), failures.cast(FAILURE_SCHEMA))
                doc = {**manifest_doc(shard, staged), **(note or {}), "replaces": sorted(old)}
                self._upload(shard, staged)
                seq = self._log.append(doc)
                if seq is not None:
                    atomic_write_bytes(self.root / "manifests" / f"{shard}.json", canonical_json(doc))
                    self._publish_staged(shard, staged, np.zeros((0, 16), np.uint8), np.zeros((0, 16), np.uint8))
                    self._log.keep(seq, canonical_json(doc))
                    break
                sync_cache_mirror(self.url, self._fs, self._remote, self.root, self._objects)
                if self._published(shard):  # its own entry landed, though refused: the sync published it here
                    self._discard(staged)
                    break
                self._withdraw(shard, staged)
            self._indexed_shards.discard(shard)
            self.remove_replaced()
        for old_shard in old:  # the manifest first: a mirror listing manifests then never finds files missing
            for kind, suffix in (("manifests", "json"), ("captions", "parquet"), ("failures", "parquet")):
                try:
                    self._fs.rm_file(f"{self._remote}/{kind}/{old_shard}.{suffix}")
                except FileNotFoundError:
                    continue
                except Exception as exc:
                    raise remote_error(self.url, exc) from None
        return shard


def collect_cache_garbage(url: str, grace_s: float, delete: bool) -> GarbageReport:
    """`tcjepa cache gc`: the uploaded shard files of the cache at `url` that no log entry (or manifest) names."""
    writable_filesystem(url, "cache gc")
    objects = ObjectRoot.of(url)
    if objects.read("CACHE.json") is None:
        raise UserError(f"{url} is not a caption cache (no CACHE.json)")

    def live_shards(entries: list[dict[str, Any]]) -> set[str]:
        named = {str(e.get("shard")) for e in entries} | {n.removesuffix(".json") for n in objects.names("manifests")}
        return named - {str(old) for e in entries for old in e.get("replaces", [])}

    return collect_garbage(
        objects, ["captions", "failures"], lambda name: Path(name).stem, live_shards, grace_s, delete
    )


def open_cache_for_writing(location: str | Path, mirror: Path | None = None) -> CaptionCache:
    """A local cache directory, or an s3:// or az:// cache through a mirror under `mirror`."""
    if is_remote(str(location)):
        return RemoteCaptionCache.open_or_create(str(location), mirror)
    return CaptionCache.open_or_create(Path(location))
