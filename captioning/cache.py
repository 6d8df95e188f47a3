"""The caption cache: append-only Parquet shards, JSON manifests, recipes, one lock.

Layout of a cache directory::

    CACHE.json                    format marker and version
    recipes/<hash>.json           {"hash", "name", "recipe"}: each recipe stored once
    captions/<shard>.parquet      one row per caption (CAPTION_SCHEMA); immutable
    failures/<shard>.parquet      images that could not be captioned (FAILURE_SCHEMA)
    manifests/<shard>.json        rows, bytes and sha256 of the shard's files, per-recipe counts; a compacted
                                  shard's also lists the shards it `replaces`
    .lock                         file lock held while a shard is checked and published

A caption is identified by (image_sha256, recipe, prompt_id, sample). A writer
takes the lock, drops rows already on disk, writes the shard under a temporary
name and renames it into `captions/`: whoever writes, `captions/*.parquet` holds
each caption exactly once, so ``datasets.load_dataset("parquet", ...)`` reads the
cache as it is. The shard files are the truth; a manifest missing after a crash
is rebuilt by the next writer.

`tcjepa cache compact` merges small shards: it writes the merged shard's manifest
(naming the shards it replaces) before its captions file, so from the moment that
file appears, readers skip the replaced shards, which are then deleted. tcjepa's
readers see every row exactly once throughout; a plain Parquet reader listing
`captions/` during that moment may see the merged rows twice.
On object storage (no lock, no rename) `captioning.remote_cache` publishes the
same shards through a log of conditional puts instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import FileLock

from pipeline.core.devices import usable_cpus
from pipeline.core.digests import SHA256_BYTES, DigestIndex, bytes_to_arrow, first_occurrence, hex_to_bytes
from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes, fsync_dir, fsync_file
from pipeline.core.recipes import canonical_json, recipe_hash, sha256_file, text_key

FORMAT = "tcjepa-caption-cache"
VERSION = 1
LOCK_TIMEOUT_S = 600.0
SUBDIRS = ("recipes", "captions", "failures", "manifests", "tmp")

CAPTION_SCHEMA = pa.schema(
    [
        pa.field("image_sha256", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("recipe", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("text_sha256", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=True),
    ]
)
CAPTION_KEY = ("image_sha256", "recipe", "prompt_id", "sample")

FAILURE_SCHEMA = pa.schema(
    [
        pa.field("image_sha256", pa.string(), nullable=True),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("recipe", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
    ]
)
FAILURE_KEY = ("image_sha256", "source_id", "recipe")


@dataclass(frozen=True)
class RecipeInfo:
    hash: str
    name: str | None
    recipe: dict[str, Any]

    @property
    def short(self) -> str:
        return self.hash[:12]


@dataclass
class CommitResult:
    shard: str | None
    captions_added: int
    captions_duplicate: int
    failures_added: int


@dataclass
class CacheInfo:
    shards: int
    captions: int
    images: int
    failures: int
    recipes: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, name: str) -> str:
        """The counts of cache `name`, then a line per recipe (`tcjepa cache info`)."""
        lines = [
            f"{name}: {self.images} images, {self.captions} captions, {self.shards} shards, {self.failures} failures"
        ]
        for r in self.recipes:
            lines.append(
                f"  recipe {r['hash'][:12]}  {r['kind']:<12} {r['name'] or '-':<24} {r['images']:>9} images "
                f"{r['captions']:>10} captions"
            )
        return "\n".join(lines)


def _made_by_a_creator(name: str) -> bool:
    """Entries that creating a cache makes before CACHE.json appears (its temporary included)."""
    return name in (".lock", *SUBDIRS) or (name.startswith(".CACHE.json.") and name.endswith(".tmp"))


def caption_row(
    image_sha256: str,
    source_id: str,
    recipe: str,
    prompt_id: str,
    sample: int,
    text: str,
    finish_reason: str,
    num_tokens: int | None = None,
) -> dict[str, Any]:
    """One row of CAPTION_SCHEMA; `text_sha256` is the caption's key in the embedding store."""
    return {
        "image_sha256": image_sha256,
        "source_id": source_id,
        "recipe": recipe,
        "prompt_id": prompt_id,
        "sample": sample,
        "text": text,
        "text_sha256": text_key(text).hex(),
        "finish_reason": finish_reason,
        "num_tokens": num_tokens,
    }


def _row_digests(table: pa.Table, key: tuple[str, ...]) -> np.ndarray:
    """16-byte digest per row of the key columns (nulls hashed as empty strings)."""
    columns = [table.column(name).to_pylist() for name in key]
    out = np.empty((table.num_rows, 16), dtype=np.uint8)
    for i, values in enumerate(zip(*columns)):
        joined = "\x1f".join("" if v is None else str(v) for v in values)
        out[i] = np.frombuffer(hashlib.sha256(joined.encode("utf-8")).digest()[:16], dtype=np.uint8)
    return out


class CaptionCache:
    """A caption cache directory; safe for several writer processes at once."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        marker = self.root / "CACHE.json"
        if not marker.is_file():
            raise UserError(
                f"{self.root} is not a caption cache (no CACHE.json); create one with `tcjepa caption ... --cache "
                f"{self.root}`"
            )
        meta = json.loads(marker.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise UserError(
                f"{self.root}: unsupported caption cache format {meta.get('format')!r} v{meta.get('version')}; this "
                f"tcjepa reads {FORMAT} v{VERSION}"
            )
        self._caption_index = DigestIndex()
        self._failure_index = DigestIndex()
        self._indexed_shards: set[str] = set()
        self._replaces: dict[str, list[str]] = {}  # compacted shard -> the shards it replaces (manifests are final)

    @classmethod
    def open_or_create(cls, root: str | Path) -> CaptionCache:
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise UserError(f"--cache {root} exists and is not a directory")
        if not (root / "CACHE.json").exists():
            # Another process may be creating the same cache: only what a creator makes is tolerated here.
            if root.exists() and any(not _made_by_a_creator(p.name) for p in root.iterdir()):
                raise UserError(
                    f"--cache {root} is a non-empty directory that is not a caption cache; choose an empty or new "
                    "directory"
                )
            for sub in SUBDIRS:
                (root / sub).mkdir(parents=True, exist_ok=True)
            with FileLock(str(root / ".lock"), timeout=LOCK_TIMEOUT_S):
                if not (root / "CACHE.json").exists():
                    atomic_write_bytes(root / "CACHE.json", canonical_json({"format": FORMAT, "version": VERSION}))
        return cls(root)

    def _lock(self) -> FileLock:
        return FileLock(str(self.root / ".lock"), timeout=LOCK_TIMEOUT_S)

    # ---- recipes -------------------------------------------------------------------------

    def add_recipe(self, recipe: dict[str, Any], name: str | None = None) -> str:
        """Store `recipe` once (first name wins) and return its hash."""
        digest = recipe_hash(recipe)
        path = self.root / "recipes" / f"{digest}.json"
        if not path.exists():
            with self._lock():
                if not path.exists():
                    atomic_write_bytes(path, canonical_json({"hash": digest, "name": name, "recipe": recipe}))
        return digest

    def recipes(self) -> dict[str, RecipeInfo]:
        out = {}
        for path in sorted((self.root / "recipes").glob("*.json")):
            doc = json.loads(path.read_text())
            out[doc["hash"]] = RecipeInfo(doc["hash"], doc.get("name"), doc["recipe"])
        return out

    def resolve_recipes(self, selectors: list[str]) -> list[str]:
        """Recipe hashes named by hash prefixes or names; with none named, the only recipe there is."""
        known = self.recipes()
        listing = ", ".join(f"{r.short} ({r.name or 'unnamed'})" for r in known.values()) or "none"
        if not selectors:
            if len(known) == 1:
                return list(known)
            if not known:
                raise UserError(f"caption cache {self.root} holds no recipes yet; caption or import some first")
            raise UserError(
                f"caption cache {self.root} holds several recipes; choose with --recipe (hash prefix or name): "
                f"{listing}"
            )
        chosen: list[str] = []
        for sel in selectors:
            hits = [h for h, r in known.items() if r.name == sel] or [h for h in known if h.startswith(sel)]
            if len(hits) != 1:
                problem = "matches no recipe" if not hits else "is ambiguous"
                raise UserError(f"--recipe {sel!r} {problem}; recipes in {self.root}: {listing}")
            if hits[0] not in chosen:
                chosen.append(hits[0])
        return chosen

    # ---- reading -------------------------------------------------------------------------

    def shard_ids(self) -> list[str]:
        """Published shards, oldest first: those with a captions file, less those a compacted shard replaces."""
        present = sorted(p.stem for p in (self.root / "captions").glob("*.parquet"))
        hidden = {old for shard in present if is_compacted(shard) for old in self.replaced_by(shard)}
        return [s for s in present if s not in hidden]

    def replaced_by(self, shard: str) -> list[str]:
        """The shards a compacted shard replaces (its manifest, written before its captions file, says so)."""
        if shard not in self._replaces:
            try:
                doc = json.loads((self.root / "manifests" / f"{shard}.json").read_text())
            except FileNotFoundError:  # being deleted: it is replaced itself, and its own list no longer matters
                return []
            self._replaces[shard] = [str(s) for s in doc.get("replaces", [])]
        return self._replaces[shard]

    def caption_files(self) -> list[str]:
        """Paths of every published caption shard, for ``datasets.load_dataset("parquet", data_files=...)``."""
        return [str(self.root / "captions" / f"{s}.parquet") for s in self.shard_ids()]

    def read_captions(
        self,
        columns: list[str] | None = None,
        recipes: list[str] | None = None,
        dictionary: list[str] | None = None,
        digests: list[str] | None = None,
    ) -> pa.Table:
        """All published captions (optionally some columns, some recipes) as one table; the `dictionary` columns
        dictionary-encoded as read (Parquet's own dictionary pages): a column whose values repeat (recipe, image_sha256,
        source_id) then costs an index per row, not a string. The `digests` columns (hex sha256: text_sha256,
        image_sha256) are decoded to 32-byte binary as each shard is read, a bad value as null: 32 bytes a row instead
        of 68, and the hex strings of all shards never held at once (at 10⁷ captions, 0.7 GB on rank 0)."""
        return _retry_if_compacted(lambda: self._read_captions(columns, recipes, dictionary, digests))

    def _read_captions(
        self,
        columns: list[str] | None,
        recipes: list[str] | None,
        dictionary: list[str] | None,
        digests: list[str] | None,
    ) -> pa.Table:
        wanted = (
            None if columns is None else list(dict.fromkeys([*columns, *(["recipe"] if recipes is not None else [])]))
        )

        def read(path: str) -> pa.Table:
            table = pq.read_table(path, columns=wanted, read_dictionary=dictionary)
            if recipes is not None:
                table = table.filter(pc.is_in(table.column("recipe"), value_set=pa.array(recipes, pa.string())))
            for name in digests or []:
                table = _decoded_digests(table, name)
            return table if columns is None else table.select(columns)

        tables = read_each(self.caption_files(), read)
        if not tables:
            schema = CAPTION_SCHEMA if columns is None else pa.schema([CAPTION_SCHEMA.field(c) for c in columns])
            for name in digests or []:
                schema = schema.set(schema.get_field_index(name), pa.field(name, pa.binary(SHA256_BYTES)))
            return schema.empty_table()
        return pa.concat_tables(tables)

    def complete_images(self, recipe: str, captions_per_image: int) -> set[str]:
        """Images that already have at least `captions_per_image` captions under `recipe`."""
        table = self.read_captions(columns=["image_sha256"], recipes=[recipe])
        if table.num_rows == 0:
            return set()
        counts = table.group_by("image_sha256").aggregate([("image_sha256", "count")])
        full = counts.filter(pc.greater_equal(counts.column("image_sha256_count"), captions_per_image))
        return set(full.column("image_sha256").to_pylist())

    def read_failures(self) -> pa.Table:
        """Every published failure record as one table."""

        def read() -> pa.Table:
            published = set(self.shard_ids())
            paths = sorted(p for p in (self.root / "failures").glob("*.parquet") if p.stem in published)
            tables = read_each(paths, pq.read_table)
            return pa.concat_tables(tables) if tables else FAILURE_SCHEMA.empty_table()

        return _retry_if_compacted(read)

    def info(self) -> CacheInfo:
        captions = self.read_captions(columns=["image_sha256", "recipe"])
        failures = self.read_failures()
        per_recipe: dict[str, dict[str, int]] = {}
        if captions.num_rows:
            grouped = captions.group_by("recipe").aggregate(
                [("image_sha256", "count"), ("image_sha256", "count_distinct")]
            )
            for row in grouped.to_pylist():
                per_recipe[row["recipe"]] = {
                    "captions": row["image_sha256_count"],
                    "images": row["image_sha256_count_distinct"],
                }
        recipes = []
        for h, r in self.recipes().items():
            counts = per_recipe.get(h, {"captions": 0, "images": 0})
            kind = r.recipe.get("kind", "?")
            recipes.append({"hash": h, "name": r.name, "kind": kind, **counts})
        images = len(set(captions.column("image_sha256").to_pylist())) if captions.num_rows else 0
        return CacheInfo(len(self.shard_ids()), captions.num_rows, images, failures.num_rows, recipes)

    # ---- writing -------------------------------------------------------------------------

    def _refresh_index(self) -> None:
        """Add the keys of shards published since the last look (call under the lock)."""
        for shard in self.shard_ids():
            if shard in self._indexed_shards:
                continue
            caps = pq.read_table(self.root / "captions" / f"{shard}.parquet", columns=list(CAPTION_KEY))
            self._caption_index.add(_row_digests(caps, CAPTION_KEY))
            fail_path = self.root / "failures" / f"{shard}.parquet"
            if fail_path.exists():
                fails = pq.read_table(fail_path, columns=list(FAILURE_KEY))
                self._failure_index.add(_row_digests(fails, FAILURE_KEY))
            self._indexed_shards.add(shard)

    def _clean_and_repair(self) -> None:
        """Under the lock: drop temporaries of dead writers and what a killed compaction left (replaced shards, a
        manifest whose shard never appeared), rebuild manifests lost in a crash."""
        for tmp in (self.root / "tmp").iterdir():
            tmp.unlink(missing_ok=True)
        self.remove_replaced()
        present = {p.stem for p in (self.root / "captions").glob("*.parquet")}
        for manifest in (self.root / "manifests").glob("*.json"):
            if manifest.stem not in present:  # a compaction killed before its shard appeared: nothing refers to it
                manifest.unlink()
        for orphan in (self.root / "failures").glob("*.parquet"):
            if orphan.stem not in present:
                orphan.unlink()
        for shard in self.shard_ids():
            if not (self.root / "manifests" / f"{shard}.json").exists():
                self._write_manifest(shard)

    def remove_replaced(self, replaced: Collection[str] = ()) -> list[str]:
        """Delete the shards that compacted shards here replace, and those in `replaced` (replaced by a compacted
        shard that is itself replaced since: a mirror two compactions behind never holds the first one), under the
        lock; returns their ids.

        Captions first (from then on the shard is not listed at all), then failures, then the manifest.
        """
        present = {p.stem for p in (self.root / "captions").glob("*.parquet")}
        named = {old for s in present if is_compacted(s) for old in self.replaced_by(s)} | set(replaced)
        gone = sorted(named & present)
        for shard in gone:
            for path in (
                self.root / "captions" / f"{shard}.parquet",
                self.root / "failures" / f"{shard}.parquet",
                self.root / "manifests" / f"{shard}.json",
            ):
                path.unlink(missing_ok=True)
            self._replaces.pop(shard, None)
        if gone:
            fsync_dir(self.root / "captions")
        return gone

    def replace_shards(
        self, old: list[str], captions: pa.Table, failures: pa.Table, note: dict[str, Any] | None = None
    ) -> str | None:
        """Publish the rows of shards `old` as one compacted shard, then delete them; None when one of them is no
        longer published (another compaction got there first), and nothing is changed.

        The merged shard's manifest, naming `old` (and holding `note`), is written before its captions file: the
        moment the shard exists for readers, they stop listing `old`. A kill at any point leaves every row readable
        exactly once.
        """
        with self._lock():
            self._clean_and_repair()
            if not set(old) <= set(self.shard_ids()):
                return None
            shard = new_shard_id(compacted=True)
            staged = self._stage(shard, captions.cast(CAPTION_SCHEMA), failures.cast(FAILURE_SCHEMA))
            doc = {**manifest_doc(shard, staged), **(note or {}), "replaces": sorted(old)}
            atomic_write_bytes(self.root / "manifests" / f"{shard}.json", canonical_json(doc))
            self._replaces[shard] = sorted(old)
            self._publish_staged(shard, staged, np.zeros((0, 16), np.uint8), np.zeros((0, 16), np.uint8))
            self._indexed_shards.discard(shard)  # its rows are indexed from the next look, if they were not yet
            self.remove_replaced()
        return shard

    def _write_manifest(self, shard: str) -> None:
        published = {kind: self.root / kind / f"{shard}.parquet" for kind in ("captions", "failures")}
        doc = manifest_doc(shard, {k: p for k, p in published.items() if p.exists()})
        atomic_write_bytes(self.root / "manifests" / f"{shard}.json", canonical_json(doc))

    def _new_rows(self, batch: RowBatch) -> tuple[pa.Table, pa.Table, np.ndarray, np.ndarray]:
        """The batch's rows not in the cache yet (call under the lock), and their digests."""
        self._refresh_index()
        new = ~self._caption_index.contains(batch.cap_digests)
        new_f = ~self._failure_index.contains(batch.fail_digests)
        return (
            batch.captions.filter(pa.array(new)),
            batch.failures.filter(pa.array(new_f)),
            batch.cap_digests[new],
            batch.fail_digests[new_f],
        )

    def _stage(self, shard: str, captions: pa.Table, failures: pa.Table) -> dict[str, Path]:
        """Write a shard's files under `tmp/`, flushed; returns them by kind (no failures file when there are none)."""
        staged = {}
        for kind, table in (("captions", captions), ("failures", failures)):
            if kind == "failures" and table.num_rows == 0:
                continue
            tmp = self.root / "tmp" / f"{kind}-{shard}.parquet"
            pq.write_table(table, tmp, compression="zstd")
            fsync_file(tmp)
            staged[kind] = tmp
        return staged

    def _publish_staged(
        self, shard: str, staged: dict[str, Path], cap_digests: np.ndarray, fail_digests: np.ndarray
    ) -> None:
        """Rename a staged shard into place, failures first: a shard id is "published" once its captions file exists."""
        for kind in ("failures", "captions"):
            if kind in staged:
                final = self.root / kind / f"{shard}.parquet"
                os.rename(staged[kind], final)
                fsync_dir(final.parent)
        self._caption_index.add(cap_digests)
        self._failure_index.add(fail_digests)
        self._indexed_shards.add(shard)

    def commit(
        self, captions: list[dict[str, Any]] | pa.Table, failures: list[dict[str, Any]] | pa.Table | None = None
    ) -> CommitResult:
        """Publish new captions (and failure records) as one shard; rows already in the cache are dropped.

        Either the whole shard becomes visible or nothing does.
        """
        batch = RowBatch.of(captions, failures, set(self.recipes()))
        with self._lock():
            self._clean_and_repair()
            cap_table, fail_table, cap_digests, fail_digests = self._new_rows(batch)
            if cap_table.num_rows == 0 and fail_table.num_rows == 0:
                return CommitResult(None, 0, batch.offered, 0)
            shard = new_shard_id()
            self._publish_staged(shard, self._stage(shard, cap_table, fail_table), cap_digests, fail_digests)
            self._write_manifest(shard)
        return CommitResult(shard, cap_table.num_rows, batch.offered - cap_table.num_rows, fail_table.num_rows)


COMPACTED = "compacted"


def new_shard_id(compacted: bool = False) -> str:
    """Unique across hosts and processes, and sorted by creation time; a compacted shard's says so."""
    tag = f"{COMPACTED}-" if compacted else ""
    return f"{time.time_ns():020d}-{tag}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_compacted(shard: str) -> bool:
    """Only compacted shards replace others, so only their manifests need reading to list the cache."""
    return f"-{COMPACTED}-" in shard


COMPACTION_PATIENCE_S = 300.0  # how long a read keeps re-listing while a compaction deletes the shards it listed


P = TypeVar("P", str, Path)
READ_THREADS = min(16, usable_cpus())  # shards read at once (a cache of 10⁷ captions has thousands)


def _decoded_digests(table: pa.Table, name: str) -> pa.Table:
    """`table` with its hex column `name` as 32-byte binary, a value that is not a hex sha256 as null: whether it
    matters is the caller's to say (a bad key of a recipe a run does not train on does not stop that run)."""
    binary = pa.field(name, pa.binary(SHA256_BYTES))
    decoded = pa.chunked_array([_sha256_bytes(chunk) for chunk in table.column(name).chunks], binary.type)
    return table.set_column(table.schema.get_field_index(name), binary, decoded)


def _sha256_bytes(hexes: pa.Array) -> pa.Array:
    """32-byte binary of hex sha256s: the whole chunk at once, or, where a value is bad, value by value."""
    try:
        return bytes_to_arrow(hex_to_bytes(hexes, SHA256_BYTES))
    except ValueError:
        return pa.array([_from_hex(h) for h in hexes.to_pylist()], pa.binary(SHA256_BYTES))


def _from_hex(value: str | None) -> bytes | None:
    """A hex sha256's 32 bytes; None for anything else."""
    try:
        raw = bytes.fromhex(value) if value is not None else b""
    except ValueError:
        return None
    return raw if len(raw) == SHA256_BYTES else None


def read_each(paths: Sequence[P], read: Callable[[P], pa.Table]) -> list[pa.Table]:
    """`read` of each path, in the paths' order, READ_THREADS at a time: Parquet decoding releases the GIL, and at
    start-up rank 0 reads every shard while the other ranks wait."""
    if len(paths) < 2:
        return [read(path) for path in paths]
    with ThreadPoolExecutor(min(READ_THREADS, len(paths)), thread_name_prefix="tcjepa-read") as pool:
        return list(pool.map(read, paths))


def _retry_if_compacted(read: Callable[[], pa.Table], patience_s: float = COMPACTION_PATIENCE_S) -> pa.Table:
    """`read()` again when a shard it listed was deleted meanwhile (a compaction replaced it); the next listing
    names the shard that holds those rows now. Each retry follows a deletion, i.e. progress of a compaction, which
    ends; a reader slower than the compaction's steps retries until it does, within `patience_s`."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return read()
        except FileNotFoundError as exc:
            if time.monotonic() > deadline:
                raise UserError(
                    f"shards kept disappearing for {patience_s:.0f} s while reading ({exc.filename}); "
                    "read the cache again when its compaction has finished"
                ) from exc


def manifest_doc(shard: str, files: dict[str, Path]) -> dict[str, Any]:
    """A shard's manifest: rows, bytes and sha256 of each of its files (by kind), and its captions per recipe."""
    entries = {}
    recipes: dict[str, int] = {}
    for kind, path in files.items():
        meta = pq.read_metadata(path)
        entries[kind] = {
            "path": f"{kind}/{shard}.parquet",
            "rows": meta.num_rows,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        }
        if kind == "captions":
            table = pq.read_table(path, columns=["recipe", "image_sha256"])
            for row in table.group_by("recipe").aggregate([("image_sha256", "count")]).to_pylist():
                recipes[row["recipe"]] = row["image_sha256_count"]
    return {
        "shard": shard,
        "files": entries,
        "recipes": recipes,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


@dataclass
class RowBatch:
    """Rows offered to a commit: cast to the schemas, recipes checked, duplicates within the batch dropped."""

    captions: pa.Table
    failures: pa.Table
    cap_digests: np.ndarray
    fail_digests: np.ndarray
    offered: int

    @classmethod
    def of(
        cls,
        captions: list[dict[str, Any]] | pa.Table,
        failures: list[dict[str, Any]] | pa.Table | None,
        known_recipes: set[str],
    ) -> RowBatch:
        cap_table = (
            captions if isinstance(captions, pa.Table) else pa.Table.from_pylist(captions, schema=CAPTION_SCHEMA)
        )
        fail_table = (
            failures if isinstance(failures, pa.Table) else pa.Table.from_pylist(failures or [], schema=FAILURE_SCHEMA)
        )
        cap_table, fail_table = cap_table.cast(CAPTION_SCHEMA), fail_table.cast(FAILURE_SCHEMA)
        unknown = (
            set(cap_table.column("recipe").to_pylist()) | set(fail_table.column("recipe").to_pylist())
        ) - known_recipes
        if unknown:
            raise ValueError(f"rows refer to recipes not stored in the cache: {sorted(unknown)}")
        cap_digests = _row_digests(cap_table, CAPTION_KEY)
        keep = first_occurrence(cap_digests)
        fail_digests = _row_digests(fail_table, FAILURE_KEY)
        keep_f = first_occurrence(fail_digests)
        return cls(
            cap_table.filter(pa.array(keep)),
            fail_table.filter(pa.array(keep_f)),
            cap_digests[keep],
            fail_digests[keep_f],
            int(keep.sum()),
        )
