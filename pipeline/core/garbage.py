"""Garbage collection on a shared cache or store: uploads that no log entry names, older than a grace period.

A writer uploads first and publishes (creates its log entry) second, so an upload no entry names is either a dead
writer's or a live writer's that has not published yet. The grace period spares the young ones; what makes the old
ones safe to delete is the log itself. Before deleting, gc publishes a claim, the next log entry, naming every object
it will delete; it computed that list from the whole log as it was just before the claim's number, and the claim is
created only if that number is still free. A writer that uploaded an object of the list can publish only after
taking a later number, so it has first read the claim, and uploads its rows again under a new name (as after any lost
race). Nothing a writer publishes through the log is lost, whatever the grace; a paused writer only redoes its upload.
A tree uploaded whole (`aws s3 sync` of a local cache or store: its manifests or root list written last, no log
entry) cannot read a claim: gc looks at the manifests and the root list again after its claim and spares what they
name by then, but such an upload must finish within the grace.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError
from pipeline.core.objects import Listed, ObjectRoot
from pipeline.core.remote import PublishLog

CLAIM = "collected"  # the key of a gc claim's log entry (readers skip such entries)


@dataclass
class GarbageReport:
    url: str
    found: int
    found_bytes: int
    young: int
    deleted: int
    freed_bytes: int
    dry_run: bool

    def summary(self) -> str:
        found = f"{self.url}: {self.found} unpublished objects ({self.found_bytes / 2**20:.1f} MiB) past the grace"
        young = f"; {self.young} younger kept" if self.young else ""
        if self.dry_run:
            return f"{found}{young}; dry run, nothing deleted (--delete to free them)"
        return f"{found}{young}; deleted {self.deleted}, freed {self.freed_bytes / 2**20:.1f} MiB"


def parse_grace(text: str) -> float:
    """Seconds in a grace period written as `24h`, `90m`, `30s` or a number of hours."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    value, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 3600.0)
    try:
        seconds = float(value) * unit
    except ValueError:
        raise UserError(f"--grace {text}: not a duration (e.g. 24h, 90m, 30s)") from None
    if seconds < 0:
        raise UserError(f"--grace {text}: a duration cannot be negative")
    return seconds


def is_claim(entry: dict[str, Any]) -> bool:
    """Whether a log entry is a gc claim rather than a publication."""
    return CLAIM in entry


def claimed(entries: Iterable[dict[str, Any]]) -> set[str]:
    """Every object name that a gc claim among `entries` listed."""
    return {name for entry in entries if is_claim(entry) for name in entry[CLAIM]}


def collect_garbage(
    objects: ObjectRoot,
    prefixes: list[str],
    owner: Callable[[str], str],
    live_owners: Callable[[list[dict[str, Any]]], set[str]],
    grace_s: float,
    delete: bool,
) -> GarbageReport:
    """Find the objects under `prefixes` whose `owner` (a shard or segment id) is not among `live_owners(entries)` and
    that are older than `grace_s`; with `delete`, claim them in the log, then delete them."""
    with tempfile.TemporaryDirectory() as tmp:
        log = PublishLog(objects, Path(tmp))
        while True:
            log.keep_all(log.unseen())
            live = live_owners([e for e in log.entries() if not is_claim(e)])
            now = time.time()
            unnamed: list[Listed] = [o for p in prefixes for o in objects.listing(p) if owner(o.name) not in live]
            old = [o for o in unnamed if now - o.modified >= grace_s]
            report = GarbageReport(objects.url, len(old), sum(o.size for o in old), len(unnamed) - len(old), 0, 0, True)
            if not delete or not old:
                return report
            claim = {CLAIM: [o.name for o in old], "grace_s": grace_s, "by": f"{socket.gethostname()}:{os.getpid()}"}
            if log.append(claim) is not None:
                break  # else a writer published meanwhile: look again
        # A tree uploaded whole (its manifest or root list written last, no log entry) may have named one since.
        live = live_owners([e for e in log.entries() if not is_claim(e)])
    doomed = [o for o in old if owner(o.name) not in live]
    for listed in doomed:
        objects.delete(listed.name)
    report.deleted, report.freed_bytes, report.dry_run = len(doomed), sum(o.size for o in doomed), False
    return report
