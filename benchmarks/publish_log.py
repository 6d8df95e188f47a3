"""What one commit costs on a publish log with a long history: list requests, objects read and bytes read.

A simulated back-end: obstore's in-memory store behind the same `ObjectRoot` the writers use, counting requests (a
listing counts one request per 1,000 keys, as S3, GCS and Azure page them). For each history size the log gets that
many entries (condensed every 1,000, as writers leave it); then one writer whose mirror holds them commits `--commits`
times, while `--others` entries of other writers land before each of its commits (so each commit first loses the race
for its number, looks again, and retries: the busy case). Per commit: list requests, gets and bytes read; the wall
time of the sync and append, and that time less the simulated store's own listing time (obstore's in-memory store
filters every key it holds on each listing, where S3 seeks to the name, so its listings alone grow with the history);
the list requests of the previous protocol (the whole `log/` prefix listed per look); and what a new mirror reads to
catch up (condensed blocks, then the entries after them). `in_turn_*`: the same with the log read by name, as on
Azure, whose listing cannot start after a name: the block that holds the next number, then each entry up to the
first missing one.

    python -m benchmarks.publish_log [--sizes 100 10000 1000000] [--commits 20] [--others 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_result
from pipeline.core.objects import LIST_PAGE, ObjectRoot
from pipeline.core.recipes import canonical_json
from pipeline.core.remote import CONDENSE_EVERY, CONDENSED, LOG, PublishLog


def entry(seq: int, writer: str) -> bytes:
    """A cache log entry of typical size: a shard's manifest (~300 bytes)."""
    doc = {"shard": f"{writer}-{seq:012d}", "rows": 8192, "files": {"captions": {"sha256": "0" * 64, "bytes": 1 << 20}}}
    return canonical_json(doc)


def history(objects: ObjectRoot, mirror: Path, size: int) -> None:
    """`size` entries on the remote side and in the writer's mirror, with the condensed blocks writers leave."""
    (mirror / LOG).mkdir(parents=True)
    block: list[str] = []
    for seq in range(size):
        raw = entry(seq, "old")
        objects.store.put(f"{LOG}/{seq:012d}.json", raw)
        block.append(raw.decode())
        if len(block) == CONDENSE_EVERY:  # as writers and mirrors leave them: one block remotely and one locally
            first = seq - CONDENSE_EVERY + 1
            condensed = canonical_json({"first": first, "entries": block})
            objects.store.put(f"{CONDENSED}/{seq:012d}.json", condensed)
            (mirror / LOG / f"{first:012d}-{seq:012d}.json").write_bytes(condensed)
            block = []
    for offset, raw in enumerate(block):
        (mirror / LOG / f"{size - len(block) + offset:012d}.json").write_bytes(raw.encode())


# What is reported of the log read in turn (as on Azure, whose listing cannot start after a name), beside listing.
IN_TURN_KEYS = ("list_requests_per_commit", "gets_per_commit", "bytes_read_per_commit", "new_mirror_gets")


class TimedListings:
    """An obstore store whose listings are timed (`list_s`), the pages drawn inside the timing; else the store."""

    def __init__(self, store: Any) -> None:
        self.store, self.list_s = store, 0.0

    def list(self, *args: Any, **kwargs: Any) -> list:
        start = time.perf_counter()
        pages = list(self.store.list(*args, **kwargs))
        self.list_s += time.perf_counter() - start
        return pages

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def measure(size: int, commits: int, others: int, lists_after: bool = True) -> dict[str, float]:
    """One history size; `lists_after` False reads the log as on Azure, whose listing cannot start after a name."""
    with tempfile.TemporaryDirectory() as tmp:
        from obstore.store import MemoryStore

        store = TimedListings(MemoryStore())
        objects = ObjectRoot("memory://bench/cache", store, lists_after=lists_after)
        history(objects, Path(tmp) / "writer", size)
        log = PublishLog(objects, Path(tmp) / "writer")
        objects.requests.clear()
        objects.bytes_read = 0
        store.list_s = 0.0
        seconds, old_lists, next_seq = 0.0, 0, size
        for commit in range(commits):
            for _ in range(others):  # other writers' entries land first
                objects.store.put(f"{LOG}/{next_seq:012d}.json", entry(next_seq, "other"))
                next_seq += 1
            start = time.perf_counter()
            doc = {"shard": f"mine-{commit}", "rows": 8192}
            while (seq := log.append(doc)) is None:
                old_lists += max(1, -(-(next_seq + 1) // LIST_PAGE))  # the whole prefix, as listed before
                log.keep_all(log.unseen())
            log.keep(seq, canonical_json(doc))
            seconds += time.perf_counter() - start
            next_seq = seq + 1
        store_list_s = store.list_s
        per_commit = {kind: count / commits for kind, count in objects.requests.items()}
        bytes_per_commit = objects.bytes_read / commits
        fresh = PublishLog(objects, Path(tmp) / "fresh")
        objects.requests.clear()
        objects.bytes_read = 0
        start = time.perf_counter()
        caught_up = len(fresh.unseen())
        catch_up_s = time.perf_counter() - start
        return {
            "entries": size,
            "list_requests_per_commit": per_commit.get("list", 0.0),
            "gets_per_commit": per_commit.get("get", 0.0),
            "puts_per_commit": per_commit.get("put", 0.0),
            "bytes_read_per_commit": bytes_per_commit,
            "ms_per_commit": 1000 * seconds / commits,
            "ms_per_commit_less_store_listing": 1000 * (seconds - store_list_s) / commits,
            "old_protocol_list_requests_per_commit": old_lists / commits,
            "new_mirror_entries": caught_up,
            "new_mirror_gets": objects.requests["get"],
            "new_mirror_list_requests": objects.requests["list"],
            "new_mirror_s": catch_up_s,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000, 1_000_000])
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--others", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        row = measure(size, args.commits, args.others)
        in_turn = measure(size, args.commits, args.others, lists_after=False)
        row.update({f"in_turn_{key}": in_turn[key] for key in IN_TURN_KEYS})
        rows.append(row)
    for row in rows:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    small, large = rows[0], rows[-1]
    print_result(
        {
            "benchmark": "publish_log",
            "sizes": args.sizes,
            "commits": args.commits,
            "others_per_commit": args.others,
            "per_size": rows,
            "list_requests_ratio_largest_over_smallest": large["list_requests_per_commit"]
            / small["list_requests_per_commit"],
            "gets_ratio_largest_over_smallest": large["gets_per_commit"] / small["gets_per_commit"],
            "ms_per_commit_ratio_largest_over_smallest": large["ms_per_commit"] / small["ms_per_commit"],
            "ms_per_commit_less_store_listing_ratio_largest_over_smallest": large["ms_per_commit_less_store_listing"]
            / small["ms_per_commit_less_store_listing"],
            "in_turn_gets_ratio_largest_over_smallest": large["in_turn_gets_per_commit"]
            / small["in_turn_gets_per_commit"],
        }
    )


if __name__ == "__main__":
    main()
