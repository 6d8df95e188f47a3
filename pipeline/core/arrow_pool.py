"""The Arrow allocator that bulk column work runs on: jemalloc, where pyarrow is built with it.

pyarrow's default allocator on Linux, mimalloc (3.x in pyarrow 26), reserves 1 GiB arenas, commits them at once and
hands freed pages back to the kernel in bulk, so a join that reads and drops gigabytes of Parquet columns faults the
same memory in again and again. Reading the caption cache's columns at 10⁷ captions (benchmarks/startup.py's data)
took 4–10 s of kernel time on mimalloc against 1.0–1.2 s on jemalloc, with the same user time, and the whole join
~23% less time and ~17% less peak memory (docs/development.md, `benchmarks/startup.py`'s row). A pool the user chose
(`ARROW_DEFAULT_MEMORY_POOL`, or `pyarrow.set_memory_pool` to anything but mimalloc) is kept.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pyarrow as pa

USER_CHOICE = "ARROW_DEFAULT_MEMORY_POOL"
_lock = threading.Lock()
_users = 0  # blocks inside `bulk_memory_pool` now, in any thread
_before: pa.MemoryPool | None = None  # the default the first of them found


def _bulk_pool(current: pa.MemoryPool) -> pa.MemoryPool:
    if USER_CHOICE in os.environ or current.backend_name != "mimalloc":
        return current
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc (its Windows wheels)
        return current


@contextlib.contextmanager
def bulk_memory_pool() -> Iterator[pa.MemoryPool]:
    """pyarrow's default pool is jemalloc inside the block, for every thread (the default is the process's: other
    threads' Arrow work lands there too, harmlessly), and what it was once the last overlapping block ends. Buffers
    stay valid across the swap, each freed by the pool that made it. What Arrow's C++ takes from its own default
    without asking pyarrow stays on mimalloc: Parquet's readers, ~15–30% of what a read allocates."""
    global _users, _before
    with _lock:
        if _users == 0:
            _before = pa.default_memory_pool()
            pa.set_memory_pool(_bulk_pool(_before))
        _users += 1
        pool = pa.default_memory_pool()
    try:
        yield pool
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _before is not None:
                pa.set_memory_pool(_before)
                _before = None
