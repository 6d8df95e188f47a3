"""An embedding store on object storage: read through a local mirror (s3, gs, az, https), appended to by hosts (s3).

Reading. `local_store` is the one place a store location becomes a local directory: a
path is used as it is; a URL is mirrored: each published segment (or only those a run
needs) is fetched once into staging, checked against the sha256 recorded when it was
written, and renamed in whole.

Writing. A writer never downloads tokens: it keeps a local *keys mirror* (the store's root and,
for each published segment, its attributes, `keys` and `offsets`), which is all it needs to skip
captions already stored. Segments are built in the keys mirror's staging area as for a
local store, uploaded under their unique ids, and published by creating the next entry
of the remote log (``pipeline.core.remote``); a writer that loses the race for an entry fetches
the keys of what was published, drops those captions and tries again. After each
publication the remote root's segment list is brought up to date for plain zarr readers;
tcjepa's readers take the root's list and the log together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from embedding_cache.segment_check import verify_segment
from embedding_cache.store import STAGING, EmbeddingStore, PublishResult, SegmentWriter, write_empty_root
from embedding_cache.transform import ROOT_ARRAYS, StoreTransform, array_sha256, requested, root_arrays
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes
from pipeline.core.garbage import GarbageReport, claimed, collect_garbage, is_claim
from pipeline.core.logs import NODE
from pipeline.core.objects import ObjectRoot, Stored
from pipeline.core.recipes import canonical_json
from pipeline.core.remote import (
    CONDENSED,
    LOG,
    PublishLog,
    fetch,
    fetch_tree,
    is_remote,
    mirror_lock,
    mirror_path,
    parse_json,
    plain_name,
    remote_call,
    remote_names,
    remote_root,
    reset_if_rebuilt,
    writable_filesystem,
)

logger = logging.getLogger(__name__)

FETCHING = ".fetching"
# Where a creator uploads the fitted arrays (`fitted/<creator id>/projection`, ...), the root naming the winner's.
FITTED = "fitted"
# What a keys mirror keeps of each segment: enough to skip stored captions and to resolve a run's captions to token
# spans (`StoreKeys.spans`) without a token.
KEYS_MIRROR_ARRAYS = ("zarr.json", "keys", "offsets")


def remote_store_segments(objects: ObjectRoot, local: Path) -> tuple[Stored, list[str]]:
    """The remote root's `zarr.json` (with its ETag) and every published segment: the root's list, then those only
    the log names (read after the root, so that the list holds every segment the root's version lists and more).

    Log entries are copied under `local` as they are read (call under `mirror_lock`).
    """
    url = objects.url
    stored = objects.read("zarr.json")
    if stored is None:
        raise UserError(f"{url} is not an embedding store (no zarr.json)")
    meta = parse_json(f"{url}/zarr.json", stored.data).get("attributes", {}).get("tcjepa", {})
    segments = meta.get("segments")
    if not isinstance(segments, list) or not all(plain_name(s) for s in segments):
        raise DataProblem(f"{url}/zarr.json: not a tcjepa embedding store root (no valid segment list)")
    reset_if_rebuilt(local, canonical_json({k: v for k, v in meta.items() if k != "segments"}))
    log = PublishLog(objects, local)
    new = log.unseen()
    for seq, raw in new:
        doc = parse_json(f"{url}/{LOG}/{seq:012d}.json", raw)
        if not is_claim(doc) and not plain_name(doc.get("segment")):
            raise DataProblem(f"{url}/{LOG}/{seq:012d}.json: not a segment entry")
    log.keep_all(new)
    return stored, list(dict.fromkeys([*segments, *published_segments(log.entries())]))


def published_segments(entries: list[dict[str, Any]]) -> list[str]:
    """The segments that log entries publish, in order (gc claims publish none)."""
    return [e["segment"] for e in entries if not is_claim(e)]


def mirror_store(url: str, mirror: Path | None = None, only: Collection[str] | None = None) -> Path:
    """A local copy of the embedding store at `url`: every published segment (or those in `only`), each checked
    against its sha256.

    `only` is how a training node fetches just the segments that hold its run's captions (a store for ImageNet-21k
    with a large T5 runs to tens of TB); the local root lists every segment fetched, now or earlier.
    """
    fs, root = remote_root(url, "zarr.json", "an embedding store")
    local = mirror_path(url, mirror)
    local.mkdir(parents=True, exist_ok=True)
    with mirror_lock(local):
        stored, segments = remote_store_segments(ObjectRoot.of(url), local)
        if only is not None:
            only = set(only)
            unknown = sorted(only - set(segments))
            if unknown:
                raise DataProblem(
                    f"{url}: segment {unknown[0]} is not published there ({len(unknown)} missing); "
                    f"the store was rebuilt since the run's index was made: train with a new --out"
                )
        wanted = segments if only is None else [s for s in segments if s in only]
        (local / "segments").mkdir(exist_ok=True)
        _fetch_root_arrays(url, fs, root, local, json.loads(stored.data)["attributes"]["tcjepa"])
        # The remote root first: segments are checked against its encoder (a store rebuilt under the same URL lists
        # new segments only, and the old ones left here are no longer read). The local root lists them all.
        doc = _local_root(stored)

        def list_locally(listed: list[str]) -> None:
            doc["attributes"]["tcjepa"]["segments"] = listed
            atomic_write_bytes(local / "zarr.json", json.dumps(doc, indent=2).encode())

        # a reader meanwhile sees only whole segments
        list_locally([s for s in segments if (local / "segments" / s).exists()])
        fetch(fs, f"{root}/segments/zarr.json", local / "segments" / "zarr.json")
        store = EmbeddingStore(local)
        fetched = 0
        for segment in wanted:
            final = local / "segments" / segment
            if final.exists():  # renamed in only once fetched whole and checked
                continue
            staging = local / STAGING / segment
            shutil.rmtree(staging, ignore_errors=True)
            fetch_tree(url, fs, f"{root}/segments/{segment}", staging)
            verify_segment(store, segment, staging)
            staging.rename(final)
            fetched += 1
        list_locally([s for s in segments if (local / "segments" / s).exists()])
        shutil.rmtree(local / STAGING, ignore_errors=True)
    of = "" if only is None else f" this run needs (the store has {len(segments)})"
    logger.log(NODE, f"mirror: {url} -> {local}: {fetched} new of {len(wanted)} segments{of}")
    return local


def local_store(location: str | Path, mirror: Path | None = None, only: Collection[str] | None = None) -> Path:
    """The local directory of the store at `location`: a path as given, a URL mirrored first (every segment, or
    `only`)."""
    if is_remote(str(location)):
        return mirror_store(str(location), mirror, only)
    return Path(location)


class RemoteEmbeddingStore(EmbeddingStore):
    """The store at `url`; `local` is its keys mirror, where segments are also staged."""

    def __init__(self, url: str, keys_mirror: Path, fs: Any, remote_root: str, objects: ObjectRoot) -> None:
        super().__init__(keys_mirror)
        self.url, self._fs, self._remote, self._objects = url, fs, remote_root, objects
        self._log = PublishLog(objects, keys_mirror)

    @classmethod
    def open_or_create(
        cls,
        root: str | Path,
        encoder_recipe: dict[str, Any],
        width: int,
        mirror: Path | None = None,
        *,
        transform: StoreTransform | None = None,
    ) -> RemoteEmbeddingStore:
        """Open the store at the URL `root`, refusing one made with another encoder recipe, or create it (with the
        fitted arrays of `transform`, as `EmbeddingStore.open_or_create`); its keys mirror (under `mirror`) is
        brought up to date."""
        url = str(root)
        fs, remote_root = writable_filesystem(url, "--store")
        if not remote_call(url, fs.exists, f"{remote_root}/zarr.json"):
            _create(url, fs, remote_root, ObjectRoot.of(url), encoder_recipe, width, transform)
        store = cls.open(url, mirror)
        store.check_encoder(requested(encoder_recipe) if transform is not None else encoder_recipe)
        return store

    @classmethod
    def open(cls, url: str, mirror: Path | None = None) -> RemoteEmbeddingStore:
        """The existing store at `url`, its keys mirror brought up to date."""
        fs, remote_root = writable_filesystem(url, "--store")
        if not remote_call(url, fs.exists, f"{remote_root}/zarr.json"):
            raise UserError(f"--store {url} is not an embedding store (no zarr.json)")
        objects = ObjectRoot.of(url)
        local, stored = _keys_mirror(url, fs, remote_root, objects, mirror)
        if stored.etag is None:  # a writer updates the root by compare-and-swap, after each publication
            raise UserError(f"--store {url}: the object store gives no ETag, so its root cannot be swapped safely")
        return cls(url, local, fs, remote_root, objects)

    def _lock(self) -> FileLock:
        return mirror_lock(self.root)

    def _upload(self, segment: SegmentWriter) -> None:
        for dirpath, _, files in os.walk(segment.staging):
            for name in files:
                local = Path(dirpath) / name
                relative = local.relative_to(segment.staging).as_posix()
                remote_call(
                    self.url, self._fs.put_file, str(local), f"{self._remote}/segments/{segment.segment_id}/{relative}"
                )

    def publish(self, writer: SegmentWriter) -> PublishResult:
        """Upload a finished staging segment and publish it in the log; captions published by anyone are dropped."""
        dropped = 0
        source = writer
        with self._lock():
            # The next log entry detects any publication this mirror has not seen, so every entry seen must be in it.
            if not set(published_segments(self._log.entries())) <= set(self.segment_ids()):
                _sync_keys(self.url, self._fs, self._remote, self._objects, self.root)
            uploaded = False  # whether `source` is on the remote, under its own name
            while True:
                duplicate = self.published().contains(source.keys_array())
                if duplicate.any():
                    dropped += int(duplicate.sum())
                    source = self._replace(source, source.without(duplicate), uploaded)
                    uploaded = False
                if source.captions == 0:
                    source.discard()
                    return PublishResult(None, 0, 0, dropped)
                if not uploaded:
                    self._upload(source)
                    uploaded = True
                entry = {"segment": source.segment_id, "captions": source.captions, "tokens": source.tokens}
                seq = self._log.append(entry)
                if seq is not None:
                    break
                # Lost the race: the upload stays for the next try, which after catching up is one conditional put,
                # not a new upload, so that a writer that lost is not always slower to its next try than one with
                # nothing to catch up on (benchmarks/shared_writers.py, 8 writers uploading again after each loss:
                # one made hundreds of commits while seven waited). It is replaced only if the entries that won
                # hold some of its captions, or a gc claimed it.
                _sync_keys(self.url, self._fs, self._remote, self._objects, self.root)
                entries = self._log.entries()
                if source.segment_id in published_segments(entries):
                    # Its own entry: the put was refused but had landed (a PUT retried after a lost or conflicting
                    # answer), and the sync just mirrored it. Not a lost race: its captions would all look published
                    # by someone else, and the upload the entry names be removed.
                    break
                prefix = f"segments/{source.segment_id}/"
                if any(name.startswith(prefix) for name in claimed(entries)):
                    # a gc claimed this upload and may still be deleting it: upload the captions under a new name
                    source = self._replace(source, source.without(np.zeros(source.captions, dtype=bool)), False)
                    uploaded = False
            if seq is not None:  # else the sync mirrored its keys and kept its entry
                _keep_keys(self.root, source.segment_id, source.staging)
                self._log.keep(seq, canonical_json(entry))
            source.discard()
        self._update_remote_root()
        return PublishResult(source.segment_id, source.captions, source.tokens, dropped)

    def _replace(self, old: SegmentWriter, new: SegmentWriter, uploaded: bool) -> SegmentWriter:
        """`new` in place of `old`, whose staging is discarded and whose upload, if any, is removed: no entry names
        it, so nobody reads it (what a failed removal leaves, gc frees)."""
        old.discard()
        if uploaded:
            with contextlib.suppress(Exception):
                self._fs.rm(f"{self._remote}/segments/{old.segment_id}", recursive=True)
        return new

    def _update_remote_root(self) -> None:
        """List every published segment in the remote root, for plain zarr readers: a compare-and-swap on the version
        read, retried when another writer replaced it meanwhile (its list then holds what this one would write, or
        this one adds to it), never a blind overwrite."""
        while True:
            with self._lock():
                stored, segments = remote_store_segments(self._objects, self.root)
            doc = json.loads(stored.data)
            if doc["attributes"]["tcjepa"]["segments"] == segments:
                return
            if stored.etag is None:  # else every swap would be refused, for ever
                raise UserError(f"{self.url}: the object store gives no ETag, so its root cannot be swapped safely")
            doc["attributes"]["tcjepa"]["segments"] = segments
            if self._objects.replace("zarr.json", json.dumps(doc, indent=2).encode(), stored.etag):
                return


def collect_store_garbage(url: str, grace_s: float, delete: bool) -> GarbageReport:
    """`tcjepa store gc`: the uploaded segment files of the store at `url` that neither its root nor its log names."""
    writable_filesystem(url, "store gc")
    objects = ObjectRoot.of(url)

    def live_owners(entries: list[dict[str, Any]]) -> set[str]:
        """The segments the root or the log lists, and the creator whose fitted arrays the root names."""
        stored = objects.read("zarr.json")
        if stored is None:
            raise UserError(f"{url} is not an embedding store (no zarr.json)")
        meta = parse_json(f"{url}/zarr.json", stored.data).get("attributes", {}).get("tcjepa", {})
        fitted = str(meta.get(FITTED, "")).split("/")[1:]
        return {"zarr.json", *(meta.get("segments") or []), *published_segments(entries), *fitted}

    # segments/<id>/... and fitted/<creator>/...: owned by the second part of the name
    return collect_garbage(objects, ["segments", FITTED], lambda name: name.split("/")[1], live_owners, grace_s, delete)


def _create(
    url: str,
    fs: Any,
    root: str,
    objects: ObjectRoot,
    encoder: dict[str, Any],
    width: int,
    transform: StoreTransform | None,
) -> None:
    """Create the remote root unless another writer did; refuse a prefix holding anything else.

    The fitted arrays go up before `zarr.json`, so a reader never sees a root without them, and under a prefix of
    this creator's own (`fitted/<id>/`, which the root names): creators racing fit on their own hardware, whose
    arrays need not agree to the bit, and under shared names a loser's upload could replace the winner's arrays after
    the winner's root recorded their sha256s. The root is created only if absent; a loser's arrays are garbage.
    """
    # another creator may be done
    known = ("segments", LOG, CONDENSED, "zarr.json", FITTED, *ROOT_ARRAYS)
    others = [n for n in remote_names(fs, url, root) if n not in known]
    if remote_call(url, fs.exists, f"{root}/zarr.json"):
        return
    if others or any(n != "zarr.json" for n in remote_names(fs, url, f"{root}/segments")):
        raise UserError(f"--store {url} holds other objects and no zarr.json; choose a new prefix")
    creator = uuid.uuid4().hex  # also tells mirrors this store from one made later under the same URL
    with tempfile.TemporaryDirectory() as tmp:
        write_empty_root(Path(tmp), encoder, width, transform)
        doc = json.loads((Path(tmp) / "zarr.json").read_bytes())
        doc["attributes"]["tcjepa"]["id"] = creator
        if root_arrays(encoder):
            doc["attributes"]["tcjepa"][FITTED] = f"{FITTED}/{creator}"
        for name in root_arrays(encoder):
            for dirpath, _, files in os.walk(Path(tmp) / name):
                for file in files:
                    relative = (Path(dirpath) / file).relative_to(tmp).as_posix()
                    remote_call(url, fs.put_file, str(Path(dirpath) / file), f"{root}/{FITTED}/{creator}/{relative}")
        segments_group = (Path(tmp) / "segments" / "zarr.json").read_bytes()
        remote_call(url, fs.pipe_file, f"{root}/segments/zarr.json", segments_group)
        objects.create_or_read("zarr.json", json.dumps(doc, indent=2).encode())


def _set_local_segments(local: Path, segments: list[str]) -> None:
    doc = json.loads((local / "zarr.json").read_bytes())
    doc["attributes"]["tcjepa"]["segments"] = segments
    atomic_write_bytes(local / "zarr.json", json.dumps(doc, indent=2).encode())


def _keep_keys(local: Path, segment: str, source: Path) -> None:
    """Move a segment's attributes, keys and offsets from `source` into the keys mirror and list it there."""
    final = local / "segments" / segment
    shutil.rmtree(final, ignore_errors=True)  # not listed yet: left by a process killed here
    final.mkdir(parents=True)
    for name in KEYS_MIRROR_ARRAYS:
        os.rename(source / name, final / name)
    listed = EmbeddingStore(local).segment_ids()
    _set_local_segments(local, [*listed, segment])


def _sync_keys(url: str, fs: Any, root: str, objects: ObjectRoot, local: Path) -> Stored:
    """Fetch the attributes, keys and offsets of every remote segment the keys mirror lacks (call under
    `mirror_lock`); a segment that a mirror made before offsets were kept lacks only those, and gets them. Returns
    the remote root as read."""
    stored, segments = remote_store_segments(objects, local)
    remote_meta = json.loads(stored.data)["attributes"]["tcjepa"]
    if not (local / "zarr.json").exists():  # new, or emptied because the remote was made anew
        doc = _local_root(stored)
        doc["attributes"]["tcjepa"]["segments"] = []
        atomic_write_bytes(local / "zarr.json", json.dumps(doc, indent=2).encode())
    fetch(fs, f"{root}/segments/zarr.json", local / "segments" / "zarr.json")
    _fetch_root_arrays(url, fs, root, local, remote_meta)
    listed = EmbeddingStore(local).segment_ids()
    shutil.rmtree(local / FETCHING, ignore_errors=True)
    for segment in segments:
        into = local / FETCHING / segment
        prefix = f"{root}/segments/{segment}"
        if segment in listed:
            final = local / "segments" / segment
            if not (final / "offsets").exists():
                fetch_tree(url, fs, f"{prefix}/offsets", into / "offsets")
                _check_array(url, segment, into, json.loads((final / "zarr.json").read_bytes()), "offsets")
                os.rename(into / "offsets", final / "offsets")
            continue
        fetch(fs, f"{prefix}/zarr.json", into / "zarr.json")
        for name in KEYS_MIRROR_ARRAYS[1:]:
            fetch_tree(url, fs, f"{prefix}/{name}", into / name)
        _check_keys(url, segment, into, remote_meta["encoder_hash"])
        _keep_keys(local, segment, into)
        listed.append(segment)
    shutil.rmtree(local / FETCHING, ignore_errors=True)
    return stored


def _fetch_root_arrays(url: str, fs: Any, root: str, local: Path, meta: dict[str, Any]) -> None:
    """Copy the fitted arrays the store's recipe names (projection, channel scales) once, from where its root
    (attributes `meta`) says they are: they never change after the store is made, so a sync that finds them here asks
    nothing about them. (Listing them on every sync was 6 of ~11 requests per try of a writer that lost a race for its
    log entry.) They arrive in staging and are checked against the recipe's sha256s before they are renamed into
    place, so a damaged copy is never kept."""
    recipe = meta["encoder"]
    wanted = [name for name in root_arrays(recipe) if not (local / name).exists()]
    if not wanted:
        return
    where = meta.get(FITTED, "")  # stores made before creators had prefixes of their own: the root itself
    if where and (not isinstance(where, str) or not re.fullmatch(rf"{FITTED}/[0-9a-f]{{32}}", where)):
        raise DataProblem(f"{url}/zarr.json: {FITTED} {where!r} is not where a creator's fitted arrays go")
    remote = f"{url}/{where}" if where else url
    staging = local / STAGING / FITTED
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name in wanted:
            fetch_tree(url, fs, f"{root}/{where}/{name}" if where else f"{root}/{name}", staging / name)
            if not (staging / name).exists():
                raise DataProblem(f"{remote}/{name}: missing, and the store's recipe needs it")
        for name in root_arrays(recipe):  # the sha256s the recipe records, those already here included
            if not (staging / name).exists():
                shutil.copytree(local / name, staging / name)
        try:
            StoreTransform.load(staging, recipe)
        except DataProblem as exc:  # named by where it came from, not by the staging copy
            raise DataProblem(str(exc).replace(str(staging), remote)) from None
        for name in wanted:
            (staging / name).rename(local / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _local_root(stored: Stored) -> dict[str, Any]:
    """The remote root's document for a mirror's own root: the mirror keeps the fitted arrays in its root, so the
    remote's `fitted` (where its creator put them) is not carried over."""
    doc = json.loads(stored.data)
    doc["attributes"]["tcjepa"].pop(FITTED, None)
    return doc


def _keys_mirror(url: str, fs: Any, root: str, objects: ObjectRoot, mirror: Path | None) -> tuple[Path, Stored]:
    """The keys mirror of the store at `url`, brought up to date, and the remote root as it was read."""
    local = mirror_path(url, mirror, suffix="-keys")
    local.mkdir(parents=True, exist_ok=True)
    with mirror_lock(local):
        stored = _sync_keys(url, fs, root, objects, local)
    return local, stored


def mirror_store_keys(url: str, mirror: Path | None = None) -> Path:
    """The keys mirror of the store at `url` (a URL obstore opens), brought up to date: the root and each segment's
    attributes, keys and offsets, never its tokens. Enough to find which segments hold given captions, and where,
    before fetching any."""
    fs, root = remote_root(url, "zarr.json", "an embedding store")
    local, _ = _keys_mirror(url, fs, root, ObjectRoot.of(url), mirror)
    logger.log(NODE, f"mirror: {url} -> {local}: keys of {len(EmbeddingStore(local).segment_ids())} segments")
    return local


def _check_keys(url: str, segment: str, into: Path, encoder_hash: str) -> None:
    meta = json.loads((into / "zarr.json").read_bytes())
    encoder = meta.get("attributes", {}).get("encoder_hash")
    if encoder != encoder_hash:
        raise DataProblem(f"{url}/segments/{segment}: written for encoder {str(encoder)[:12]}, not the store's")
    for name in KEYS_MIRROR_ARRAYS[1:]:
        _check_array(url, segment, into, meta, name)


def _check_array(url: str, segment: str, into: Path, meta: dict[str, Any], name: str) -> None:
    """Refuse a fetched array of a segment whose sha256 is not the one recorded when it was written."""
    import zarr

    values = zarr.open_array(str(into / name), mode="r")[:]
    if array_sha256(np.asarray(values)) != meta.get("attributes", {}).get("sha256", {}).get(name):
        raise DataProblem(
            f"{url}/segments/{segment}: {name} do not match the sha256 recorded when they were written; not used"
        )


def open_store_for_writing(
    location: str | Path,
    encoder: dict[str, Any],
    width: int,
    mirror: Path | None = None,
    transform: StoreTransform | None = None,
) -> EmbeddingStore:
    """A local store directory (created if missing, with `transform`'s fitted arrays), or an s3:// or az:// store
    through its keys mirror."""
    if is_remote(str(location)):
        return RemoteEmbeddingStore.open_or_create(str(location), encoder, width, mirror, transform=transform)
    return EmbeddingStore.open_or_create(Path(location), encoder, width, transform=transform)


def open_existing_store(
    location: str | Path, encoder: dict[str, Any], mirror: Path | None = None
) -> EmbeddingStore | None:
    """The store at `location` checked against `encoder`, or None when there is none yet (a dry run creates nothing)."""
    if is_remote(str(location)):
        fs, root = writable_filesystem(str(location), "--store")
        if not remote_call(str(location), fs.exists, f"{root}/zarr.json"):
            return None
        store: EmbeddingStore = RemoteEmbeddingStore.open(str(location), mirror)
    elif (Path(location) / "zarr.json").exists():
        store = EmbeddingStore(Path(location))
    else:
        return None
    store.check_encoder(encoder)
    return store
