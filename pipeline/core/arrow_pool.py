"""The Arrow allocator that bulk column work runs on: jemalloc, where pyarrow is built with it.

pyarrow's default allocator on Linux, mimalloc (3.x in pyarrow 26), reserves 1 GiB arenas, commits them at once and
hands freed pages back to the kernel in bulk, so a join that reads and drops gigabytes of Parquet columns faults the
same memory in again and again. Reading the caption cache's columns at 10⁷ captions (benchmarks/startup.py's data)
took 4–10 s of kernel time on mimalloc against 1.0–1.2 s on jemalloc, with the same user time, and the whole join
~23% less time and ~17% less peak memory (docs/development.md, `benchmarks/startup.py`'s row). A choice the user made
(`ARROW_DEFAULT_MEMORY_POOL`) is kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pyarrow as pa

USER_CHOICE = "ARROW_DEFAULT_MEMORY_POOL"


@contextlib.contextmanager
def bulk_memory_pool() -> Iterator[pa.MemoryPool]:
    """Arrow's default pool is jemalloc inside the block (for every thread: the default is the process's), and what
    it was after it; buffers made inside stay valid after, each freed by the pool that made it."""
    previous = pa.default_memory_pool()
    try:
        pool = previous if USER_CHOICE in os.environ else pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc (its Windows wheels)
        pool = previous
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)
