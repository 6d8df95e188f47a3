"""`tcjepa cache verify`: prove a caption cache is whole before it is shared or embedded.

Checks, stopping at the first problem: each stored recipe's file name, recorded
hash and content agree; every published shard has a manifest and every manifest a
shard; each shard file has the rows, size and sha256 its manifest records, the
cache's schema, and only stored recipes; per-recipe counts match the manifest;
each caption's `text_sha256` is the hash of its text; and each caption key
(image, recipe, prompt, sample) occurs once in the whole cache.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock

from captioning.cache import (
    CAPTION_KEY,
    CAPTION_SCHEMA,
    FAILURE_SCHEMA,
    LOCK_TIMEOUT_S,
    CaptionCache,
    _row_digests,
    is_compacted,
)
from pipeline.core.digests import as_digests, first_repeat
from pipeline.core.errors import DataProblem
from pipeline.core.recipes import recipe_hash, sha256_file, text_key


@dataclass
class CacheVerifyReport:
    shards: int = 0
    captions: int = 0
    failures: int = 0
    recipes: int = 0
    bytes_hashed: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        notes = "".join(f"; note: {n}" for n in self.notes)
        return (
            f"ok: {self.recipes} recipes, {self.shards} shards, {self.captions} captions, {self.failures} failures, "
            f"{self.bytes_hashed / 2**20:.1f} MiB hashed in {self.seconds:.1f} s{notes}"
        )


def _verify_recipes(root: Path) -> set[str]:
    known = set()
    for path in sorted((root / "recipes").glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            recorded, actual = doc["hash"], recipe_hash(doc["recipe"])
        except (ValueError, KeyError, TypeError):
            raise DataProblem(f"{path}: not a recipe record (needs JSON with 'hash' and 'recipe')") from None
        if not recorded == actual == path.stem:
            raise DataProblem(
                f"{path}: file name, recorded hash {str(recorded)[:12]} and content hash {actual[:12]} disagree"
            )
        known.add(actual)
    return known


def _schema_difference(actual: pa.Schema, expected: pa.Schema) -> str:
    if actual.names != expected.names:
        return f"columns {actual.names}, expected {expected.names}"
    field = next(f for f, g in zip(actual, expected) if not f.equals(g))
    want = expected.field(field.name)
    have = f"{field.type}{'' if field.nullable else ' not null'}"
    return f"column {field.name!r} is {have}, expected {want.type}{'' if want.nullable else ' not null'}"


def _verify_file(
    root: Path, shard: str, kind: str, entry: dict[str, Any] | None, schema: pa.Schema, report: CacheVerifyReport
) -> pa.Table | None:
    """Check one shard file against its manifest entry and the schema; returns its table."""
    path = root / kind / f"{shard}.parquet"
    if entry is None:
        if path.exists():
            raise DataProblem(f"{path}: not recorded in manifests/{shard}.json")
        return None
    if not path.exists():
        raise DataProblem(f"manifests/{shard}.json records {kind}/{shard}.parquet, which is missing")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise DataProblem(f"{path}: {size} bytes, its manifest records {entry.get('bytes')}")
    if sha256_file(path) != entry.get("sha256"):
        raise DataProblem(f"{path}: sha256 does not match its manifest (changed or corrupted on disk)")
    report.bytes_hashed += size
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataProblem(f"{path}: unreadable Parquet ({str(exc).splitlines()[0]})") from None
    if table.num_rows != entry.get("rows"):
        raise DataProblem(f"{path}: {table.num_rows} rows, its manifest records {entry.get('rows')}")
    if not table.schema.equals(schema, check_metadata=False):
        raise DataProblem(f"{path}: schema differs from the cache's ({_schema_difference(table.schema, schema)})")
    return table


def _verify_shard(root: Path, shard: str, known: set[str], report: CacheVerifyReport) -> np.ndarray:
    """Check one shard and its manifest; returns the 16-byte digests of its caption keys."""
    manifest_path = root / "manifests" / f"{shard}.json"
    if not manifest_path.exists():
        raise DataProblem(
            f"captions/{shard}.parquet has no manifest (a writer died before writing it; the next `tcjepa caption` "
            "into this cache rebuilds it)"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise DataProblem(f"{manifest_path}: not a shard manifest") from None
    if manifest.get("shard") != shard or not isinstance(files, dict):
        raise DataProblem(f"{manifest_path}: records shard {manifest.get('shard')!r}, not {shard!r}")
    for kind, entry in files.items():
        if not isinstance(entry, dict) or entry.get("path") != f"{kind}/{shard}.parquet":
            raise DataProblem(f"{manifest_path}: its {kind} entry does not name {kind}/{shard}.parquet")
    captions = _verify_file(root, shard, "captions", files.get("captions"), CAPTION_SCHEMA, report)
    if captions is None:
        raise DataProblem(f"{manifest_path}: records no captions file")
    failures = _verify_file(root, shard, "failures", files.get("failures"), FAILURE_SCHEMA, report)
    recipes_seen = set(captions.column("recipe").to_pylist())
    if failures is not None:
        recipes_seen |= set(failures.column("recipe").to_pylist())
        report.failures += failures.num_rows
    if recipes_seen - known:
        raise DataProblem(
            f"captions/{shard}.parquet: rows of recipe {sorted(recipes_seen - known)[0][:12]}, which the cache does "
            "not store"
        )
    counts: dict[str, int] = {}
    for recipe in captions.column("recipe").to_pylist():
        counts[recipe] = counts.get(recipe, 0) + 1
    if counts != manifest.get("recipes"):
        raise DataProblem(f"{manifest_path}: per-recipe counts differ from the shard's rows")
    for i, (text, recorded) in enumerate(
        zip(captions.column("text").to_pylist(), captions.column("text_sha256").to_pylist())
    ):
        if text_key(text).hex() != recorded:
            raise DataProblem(f"captions/{shard}.parquet row {i}: text_sha256 is not the hash of its text")
    report.shards += 1
    report.captions += captions.num_rows
    return as_digests(_row_digests(captions, CAPTION_KEY))


def _snapshot(cache: CaptionCache) -> tuple[list[str], set[str]]:
    """Shard ids and manifest ids, listed under the writers' lock so a commit in progress is not seen half-done.

    Published shards are immutable, so checking them afterwards needs no lock. A cache that
    cannot be locked (a read-only copy) has no writers, and is listed as it is.
    """

    def listing() -> tuple[list[str], set[str]]:
        shards = cache.shard_ids()
        present = {p.stem for p in (cache.root / "captions").glob("*.parquet")}
        manifests = {p.stem for p in (cache.root / "manifests").glob("*.json")}
        # What a compaction leaves until the next writer or compaction cleans up is not published, and not a problem:
        # what is left of the shards it replaced, and the manifest of a shard it did not get to publish.
        replaced = {old for s in shards if is_compacted(s) for old in cache.replaced_by(s)}
        leftovers = (present - set(shards)) | replaced | {m for m in manifests - present if is_compacted(m)}
        return shards, manifests - leftovers

    try:
        lock = FileLock(str(cache.root / ".lock"), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except OSError:
        return listing()
    try:
        return listing()
    finally:
        lock.release()


def verify_cache(location: str | Path, progress: bool = True) -> CacheVerifyReport:
    """Check the cache at `location` (a directory, or a URL: every file fetched afresh and checked, none trusted from
    an earlier mirror); raises DataProblem at the first inconsistency."""
    from captioning.remote_cache import local_cache

    with tempfile.TemporaryDirectory() as fresh:
        return _verify_local_cache(local_cache(location, Path(fresh)), progress)


def _verify_local_cache(root: Path, progress: bool) -> CacheVerifyReport:
    from tqdm import tqdm

    started = time.perf_counter()
    cache = CaptionCache(root)
    report = CacheVerifyReport()
    known = _verify_recipes(cache.root)
    report.recipes = len(known)
    shards, manifests = _snapshot(cache)
    orphans = sorted(manifests - set(shards))
    if orphans:
        raise DataProblem(
            f"manifests/{orphans[0]}.json records a shard whose captions file is missing (deleted or lost?)"
        )
    digests, owners = [], []
    for i, shard in enumerate(tqdm(shards, unit="shard", disable=not progress, dynamic_ncols=True, desc="verify")):
        d = _verify_shard(cache.root, shard, known, report)
        digests.append(d)
        owners.append(np.full(len(d), i))
    if digests:
        owner = np.concatenate(owners)
        repeat = first_repeat(np.concatenate(digests))
        if repeat is not None:
            a, b = owner[repeat[0]], owner[repeat[1]]
            where = f"captions/{shards[a]}.parquet" + ("" if a == b else f" and captions/{shards[b]}.parquet")
            raise DataProblem(f"a caption key (image, recipe, prompt, sample) occurs twice: {where}")
    leftovers = [p for p in (cache.root / "tmp").glob("*") if p.is_file()]
    if leftovers:
        report.notes.append(f"{len(leftovers)} unpublished temporary files in tmp/ (the next writer removes them)")
    report.seconds = time.perf_counter() - started
    return report
