"""Many writers into one shared caption cache and one embedding store on object storage, each killed and restarted
at random moments (issue 33, point 6).

An S3-compatible server (moto) runs on loopback. `--writers` processes each make `--commits` commits: one to the
cache (`--captions` rows of their own, plus one row of the next writer's same commit, so that writers race to
publish the same rows) and one segment of those captions' token vectors published to the store. Each writer notes
its progress in a local file after each pair of commits and, restarted, goes on from there (the commit in flight
when it died is made again: the cache and the store drop rows published before). Meanwhile this process kills a
random running writer (SIGKILL) every `--kill-every` seconds on average and restarts it, until each was killed
`--kills` times.

Afterwards, checked against what an uninterrupted run publishes (every row and vector is a function of its writer
and commit, so that is known without running it): every caption row and every key once, each vector equal; `cache
verify` and `store verify` pass on fresh mirrors; gc at grace 0 finds what the kills left (uploads no log entry
names), frees it with --delete, and the cache and store then verify and hold the same again. Prints one JSON line,
with the requests the writers made (by kind, and per commit pair: what a commit costs, lost races included).

  python -m benchmarks.shared_writers --writers 8 --commits 500
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import logging
import multiprocessing
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment

BUCKET = "shared-writers"
WIDTH = 4
RECIPE = {"kind": "benchmark-shared-writers"}
ENCODER = {"kind": "benchmark-shared-writers"}


def captions_of(writer: int, commit: int, captions: int, writers: int) -> list[str]:
    """The texts a commit publishes: its own, then one of the next writer's same commit (published twice)."""
    own = [f"writer {writer} commit {commit} caption {k}" for k in range(captions)]
    return [*own, f"writer {(writer + 1) % writers} commit {commit} caption 0"]


def vector_of(text: str) -> np.ndarray:
    """A caption's token vectors, a function of its text: 1-3 tokens of WIDTH values."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1 + seed % 3, WIDTH)).astype(np.float16)


def caption_rows(texts: list[str], recipe: str) -> list[dict[str, Any]]:
    from pipeline.core.recipes import text_key

    rows = []
    for text in texts:
        image = text.rsplit(" caption ", 1)[0]
        rows.append(
            {
                "image_sha256": hashlib.sha256(image.encode()).hexdigest(),
                "source_id": image,
                "recipe": recipe,
                "prompt_id": "p0",
                "sample": int(text.rsplit(" ", 1)[1]),
                "text": text,
                "text_sha256": text_key(text).hex(),
                "finish_reason": "stop",
                "num_tokens": None,
            }
        )
    return rows


def write(cache_url: str, store_url: str, work: Path, writer: int, commits: int, captions: int, writers: int) -> None:
    """One writer: its commits from where its progress file says, the file rewritten after each."""
    from captioning.remote_cache import RemoteCaptionCache
    from embedding_cache.remote_store import RemoteEmbeddingStore
    from embedding_cache.store import TokenLayout
    from pipeline.core.fsutil import atomic_write_bytes
    from pipeline.core.recipes import text_key

    mirror = work / f"mirror-{writer}"
    progress = work / f"progress-{writer}"
    cache = RemoteCaptionCache.open_or_create(cache_url, mirror)
    recipe = cache.add_recipe(RECIPE)
    store = RemoteEmbeddingStore.open_or_create(store_url, ENCODER, WIDTH, mirror)
    start = int(progress.read_text()) if progress.exists() else 0
    for commit in range(start, commits):
        texts = captions_of(writer, commit, captions, writers)
        cache.commit(caption_rows(texts, recipe))
        segment = store.new_segment(TokenLayout(64, 16))
        for text in texts:
            segment.append(text_key(text), vector_of(text))
        segment.finish()
        store.publish(segment)
        atomic_write_bytes(progress, str(commit + 1).encode())


def _start(context: Any, args: argparse.Namespace, urls: tuple[str, str], work: Path, writer: int) -> Any:
    process = context.Process(
        target=write, args=(*urls, work, writer, args.commits, args.captions, args.writers), daemon=True
    )
    process.start()
    return process


def run_writers(args: argparse.Namespace, urls: tuple[str, str], work: Path) -> dict[str, Any]:
    """Every writer to its end, each killed `args.kills` times at random moments and restarted."""
    context = multiprocessing.get_context("spawn")
    rng = random.Random(args.seed)
    procs = {w: _start(context, args, urls, work, w) for w in range(args.writers)}
    kills = dict.fromkeys(procs, 0)
    restarts_after_exit = 0
    finished: dict[int, float] = {}  # each writer's first clean exit, seconds from the start (to the next check)
    tick = time.perf_counter()
    while True:
        for w, proc in procs.items():
            if not proc.is_alive() and proc.exitcode not in (0, -9):
                raise SystemExit(f"writer {w} failed (exit code {proc.exitcode})")
            if proc.exitcode == 0 and w not in finished:
                finished[w] = time.perf_counter() - tick
        running = [w for w, proc in procs.items() if proc.is_alive()]
        if not running:
            break
        time.sleep(rng.expovariate(1 / args.kill_every))
        victims = [w for w in running if kills[w] < args.kills and procs[w].is_alive()]
        if victims:
            w = rng.choice(victims)
            procs[w].kill()
            procs[w].join()
            kills[w] += 1
            procs[w] = _start(context, args, urls, work, w)
    unkilled = [w for w, k in kills.items() if k < args.kills]
    for w in unkilled:  # finished before its turn came: killed at its start instead, then run to its end
        for _ in range(args.kills - kills[w]):
            procs[w] = _start(context, args, urls, work, w)
            time.sleep(rng.uniform(0.5, 3.0))
            procs[w].kill()
            procs[w].join()
            kills[w] += 1
            restarts_after_exit += 1
        procs[w] = _start(context, args, urls, work, w)
        procs[w].join()
        if procs[w].exitcode != 0:
            raise SystemExit(f"writer {w} failed (exit code {procs[w].exitcode})")
    return {
        "writers_s": round(time.perf_counter() - tick, 1),
        # how evenly the writers shared the log: when each was done, first to last
        "writer_done_s": sorted(round(t, 1) for t in finished.values()),
        "kills": sum(kills.values()),
        "kills_after_finishing": restarts_after_exit,
    }


def contents(cache_url: str, store_url: str, mirror: Path) -> tuple[list[tuple[str, str]], dict[bytes, np.ndarray]]:
    """(image sha256, text) of every caption row, and every key's vectors, read through fresh mirrors."""
    from captioning.remote_cache import RemoteCaptionCache
    from embedding_cache.reader import EmbeddingReader
    from embedding_cache.remote_store import mirror_store
    from embedding_cache.store import EmbeddingStore

    table = RemoteCaptionCache.open_or_create(cache_url, mirror).read_captions(columns=["image_sha256", "text"])
    rows = list(zip(table.column("image_sha256").to_pylist(), table.column("text").to_pylist()))
    local = mirror_store(store_url, mirror)
    reader = EmbeddingReader(local)
    store = EmbeddingStore(local)
    vectors = {
        key.tobytes(): np.array(reader.get_key(key.tobytes()))
        for s in store.segment_ids()
        for key in store.read_keys(s)
    }
    return rows, vectors


def check(args: argparse.Namespace, urls: tuple[str, str], work: Path, name: str) -> dict[str, Any]:
    """Lost and repeated rows and keys against the uninterrupted run's, and both verifications."""
    from captioning.verify import verify_cache
    from embedding_cache.verify import verify_store
    from pipeline.core.recipes import text_key

    expected = {
        text
        for w in range(args.writers)
        for c in range(args.commits)
        for text in captions_of(w, c, args.captions, args.writers)
    }
    rows, vectors = contents(*urls, work / name)
    texts = [text for _, text in rows]
    keys = {text_key(text): text for text in expected}
    return {
        "caption_rows": len(rows),
        "expected_rows": len(expected),
        "rows_lost": len(expected - set(texts)),
        "rows_repeated": len(texts) - len(set(texts)),
        "rows_unexpected": len(set(texts) - expected),
        "keys": len(vectors),
        "keys_lost": len(keys.keys() - vectors.keys()),
        "keys_unexpected": len(vectors.keys() - keys.keys()),
        "vectors_differ": sum(not np.array_equal(v, vector_of(keys[k])) for k, v in vectors.items() if k in keys),
        "cache_verify": verify_cache(urls[0], progress=False).summary(),
        "store_verify": verify_store(urls[1], progress=False).summary(),
    }


def collect(urls: tuple[str, str], delete: bool) -> dict[str, Any]:
    from captioning.remote_cache import collect_cache_garbage
    from embedding_cache.remote_store import collect_store_garbage

    cache, store = collect_cache_garbage(urls[0], 0.0, delete), collect_store_garbage(urls[1], 0.0, delete)
    return {
        "cache_found": cache.found,
        "cache_found_bytes": cache.found_bytes,
        "cache_deleted": cache.deleted,
        "store_found": store.found,
        "store_found_bytes": store.found_bytes,
        "store_deleted": store.deleted,
    }


class RequestCounter(logging.Handler):
    """The requests moto's server answers, by kind: werkzeug logs one line for each (which then no longer reach
    stderr). A listing is a GET with `list-type`; a conditional put is a PUT, won or lost."""

    LINE = re.compile(r'"(?:\x1b\[[0-9;]*m)?([A-Z]+) (\S+)')

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        line = self.LINE.search(record.getMessage())
        if line is not None:
            method, path = line.groups()
            self.counts["list" if method == "GET" and "list-type=" in path else method.lower()] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--commits", type=int, default=500, help="commits of each writer (one to the cache, one segment)")
    ap.add_argument("--captions", type=int, default=4, help="captions of a writer's own in each commit")
    ap.add_argument("--kills", type=int, default=2, help="times each writer is killed")
    ap.add_argument("--kill-every", type=float, default=5.0, help="mean seconds between kills")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer

    counter = RequestCounter()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(counter)
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    try:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"]).mkdir(BUCKET)
        urls = (f"s3://{BUCKET}/cache", f"s3://{BUCKET}/store")
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            counter.counts.clear()
            written = run_writers(args, urls, work)
            requests = dict(counter.counts)
            after_writers = check(args, urls, work, "reader")
            found = collect(urls, delete=False)
            freed = collect(urls, delete=True)
            after_gc = check(args, urls, work, "reader-after-gc")
            left = collect(urls, delete=False)
    finally:
        server.stop()
    commits = args.writers * args.commits
    print_result(
        {
            "writers": args.writers,
            "commits_per_writer": args.commits,
            "captions_per_commit": args.captions + 1,
            **written,
            "commit_pairs_per_s": round(commits / written["writers_s"], 2),
            # what the writers asked of the server, kills and lost races included: a commit pair is two log entries
            "requests": requests,
            "requests_per_commit_pair": round(sum(requests.values()) / commits, 1),
            "after_writers": after_writers,
            "gc_dry_run": found,
            "gc_delete": freed,
            "after_gc": after_gc,
            "gc_left": left,
            "same_after_gc": {k: v for k, v in after_gc.items() if not k.endswith("verify")}
            == {k: v for k, v in after_writers.items() if not k.endswith("verify")},
        }
    )


if __name__ == "__main__":
    main()
