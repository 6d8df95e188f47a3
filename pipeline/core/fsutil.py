"""Durable, atomic file publication on a local file system.

Every artefact that another process may read is written under a temporary name,
flushed to disk, and then renamed into place: readers see the old state or the
new one, never a half-written file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextmanager
def atomic_writer(path: Path) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends without an error: written under a temporary sibling,
    synced, then renamed into place (for what is written in parts, never held whole in memory)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary sibling and an atomic rename."""
    with atomic_writer(path) as f:
        f.write(data)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def user_cache_dir() -> Path:
    """This user's tcjepa cache (remote mirrors, remembered file hashes): $TCJEPA_CACHE_DIR, else ~/.cache/tcjepa."""
    return Path(os.environ.get("TCJEPA_CACHE_DIR") or Path.home() / ".cache" / "tcjepa")
