"""`tcjepa cache compact`: merge small shards into few large ones, under the publish protocol, local or s3://.

Each `tcjepa caption` chunk is one shard (a Parquet file, its failures and a manifest):
~5,000 files for ImageNet, ~400,000 for 100 M images. Compaction groups consecutive
shards smaller than `--target-mb` until a group reaches that size, and publishes each
group's rows as one compacted shard that replaces them (`CaptionCache.replace_shards`).
A compacted shard made from a full group is never regrouped at that target (merged rows
compress better, so its file can be smaller than the target); the last, partial group's
shard is, with the shards captioned after it.
Readers see every row exactly once before, during and after; a killed compaction
leaves a readable cache and a rerun finishes the job; a second run finds nothing to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from captioning.cache import CAPTION_SCHEMA, FAILURE_SCHEMA, CaptionCache, is_compacted
from pipeline.core.errors import UserError


@dataclass
class CompactReport:
    shards_before: int = 0
    shards_after: int = 0
    merged: int = 0  # shards replaced
    compacted: int = 0  # shards written
    skipped_groups: int = 0  # groups another compaction changed first
    rows: int = 0

    def summary(self) -> str:
        return (
            f"{self.shards_before} shards -> {self.shards_after}: {self.merged} merged into {self.compacted}, "
            f"{self.rows} caption rows moved"
            + (f", {self.skipped_groups} groups left to another compaction" if self.skipped_groups else "")
        )


def shard_bytes(cache: CaptionCache, shard: str, target_bytes: int) -> int | None:
    """Bytes of a shard's captions and failures files; None for a compacted shard made full at this target or more."""
    if is_compacted(shard):
        doc = json.loads((cache.root / "manifests" / f"{shard}.json").read_text())
        if doc.get("full") and doc.get("target_bytes", 0) >= target_bytes:
            return None
    files = (cache.root / "captions" / f"{shard}.parquet", cache.root / "failures" / f"{shard}.parquet")
    return sum(p.stat().st_size for p in files if p.exists())


def plan_groups(sizes: list[tuple[str, int | None]], target_bytes: int) -> list[list[str]]:
    """Runs of consecutive shards under `target_bytes` (None: full whatever its size), each cut once it reaches the
    target; single shards stay."""
    groups: list[list[str]] = []
    current: list[str] = []
    total = 0
    for shard, size in sizes:
        if size is None or size >= target_bytes:
            groups.append(current)
            current, total = [], 0
            continue
        current.append(shard)
        total += size
        if total >= target_bytes:
            groups.append(current)
            current, total = [], 0
    groups.append(current)
    return [g for g in groups if len(g) > 1]


def _read_group(cache: CaptionCache, group: list[str]) -> tuple[pa.Table, pa.Table]:
    captions = pa.concat_tables([pq.read_table(cache.root / "captions" / f"{s}.parquet") for s in group])
    failure_files = [cache.root / "failures" / f"{s}.parquet" for s in group]
    failures = [pq.read_table(p) for p in failure_files if p.exists()]
    return (
        captions.cast(CAPTION_SCHEMA),
        pa.concat_tables(failures).cast(FAILURE_SCHEMA) if failures else FAILURE_SCHEMA.empty_table(),
    )


def compact_cache(
    location: str | Path, target_mb: float = 256.0, mirror: Path | None = None, progress: bool = True
) -> CompactReport:
    """Merge the small shards of the cache at `location` (a directory or an s3:// URL)."""
    from tqdm import tqdm

    from captioning.remote_cache import open_cache_for_writing
    from pipeline.core.remote import is_remote, remote_root

    if target_mb <= 0:
        raise UserError(f"--target-mb must be positive, got {target_mb}")
    if is_remote(str(location)):
        remote_root(str(location), "CACHE.json", "a caption cache")  # refuses a URL that holds none
    else:
        CaptionCache(location)  # refuses a directory that is not a cache
    cache = open_cache_for_writing(location, mirror)
    shards = cache.shard_ids()
    report = CompactReport(shards_before=len(shards))
    target = int(target_mb * 2**20)
    sizes = [(s, shard_bytes(cache, s, target)) for s in shards]
    groups = plan_groups(sizes, target)
    for group in tqdm(groups, unit="group", disable=not progress, dynamic_ncols=True, desc="compact"):
        try:
            captions, failures = _read_group(cache, group)
        except FileNotFoundError:  # another compaction replaced one of them meanwhile
            report.skipped_groups += 1
            continue
        full = sum(size or 0 for s, size in sizes if s in group) >= target
        if cache.replace_shards(group, captions, failures, {"target_bytes": target, "full": full}) is None:
            report.skipped_groups += 1
            continue
        report.merged += len(group)
        report.compacted += 1
        report.rows += captions.num_rows
    report.shards_after = len(cache.shard_ids())
    return report
