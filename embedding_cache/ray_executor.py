"""`tcjepa embed --executor ray`: the captions to encode as a Ray Dataset, T5 in a pool of Ray actors.

The driver selects the captions exactly as the local executor does (distinct texts of
the chosen recipes, in image order, minus those stored). Ray Data cuts them into
batches of `--window` captions and hands each to an actor, one per GPU (one per CPU
slot without GPUs), which loads T5 once, encodes the batch with the same batching and
dtype as the local path and publishes it as one segment through our store writer, so
the store is what the local executor makes (the same keys and vectors; segments cut
differently). Ray restarts an actor whose process dies and retries its batch; the
store drops captions already published, so a retry never stores a caption twice.
On a cluster the store must be reachable from every node: a shared file system or an
``s3://`` URL.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa

from embedding_cache.encode import T5Encoder, load_tokenizer
from embedding_cache.remote_store import open_store_for_writing
from embedding_cache.store import KEY_BYTES, TokenLayout
from embedding_cache.work import EmbedConfig, EmbedReport, encode_window
from pipeline.core.ray_cluster import actor_resources, start_ray


class SegmentPerBatch:
    """A Ray Data actor: T5 loaded once; each batch of captions becomes one published segment."""

    def __init__(self, cfg: EmbedConfig, recipe: dict[str, Any], width: int, layout: TokenLayout) -> None:
        self.cfg, self.layout = cfg, layout
        self.tokenizer = load_tokenizer(cfg.model)
        self.encoder = T5Encoder.load(cfg.model, cfg.device, cfg.compute_dtype)
        self.store = open_store_for_writing(cfg.store, recipe, width, cfg.mirror)

    def __call__(self, batch: pa.Table) -> pa.Table:
        keys = np.frombuffer(b"".join(batch.column("key").to_pylist()), dtype=np.uint8).reshape(-1, KEY_BYTES)
        fresh = np.flatnonzero(~self.store.published().contains(keys))  # a retried batch may be published already
        texts = batch.column("text").to_pylist()
        outputs, truncated = encode_window(
            self.encoder, self.tokenizer, [texts[i] for i in fresh], keys[fresh], self.cfg
        )
        published = {"segment": "", "captions": 0, "tokens": 0}
        if len(fresh):
            writer = self.store.new_segment(self.layout)
            try:
                for i, out in zip(fresh, outputs):
                    writer.append(keys[i].tobytes(), out)
                writer.finish(truncated=truncated, max_length=self.cfg.max_length)
                result = self.store.publish(writer)
            except BaseException:
                writer.discard()
                raise
            published = {"segment": result.segment or "", "captions": result.captions, "tokens": result.tokens}
        return pa.table(
            {
                "segment": [published["segment"]],
                "captions": [published["captions"]],
                "tokens": [published["tokens"]],
                "truncated": [truncated],
                "offered": [batch.num_rows],
                "done": [time.time()],
            }
        )


def embed_on_ray(
    cfg: EmbedConfig,
    texts: list[str],
    keys: np.ndarray,
    todo: np.ndarray,
    recipe: dict[str, Any],
    width: int,
    layout: TokenLayout,
    report: EmbedReport,
) -> None:
    """Encode `texts[todo]` on a Ray cluster, publishing one segment per batch of `cfg.window` captions; fills
    `report`."""
    import ray.data
    from tqdm import tqdm

    start_ray(cfg.ray_address)
    size, resources = actor_resources(cfg.device, cfg.ray_actors)
    table = pa.table(
        {"key": pa.array([keys[i].tobytes() for i in todo], pa.binary(KEY_BYTES)), "text": [texts[i] for i in todo]}
    )
    # a block per batch: all actors busy
    blocks = [table.slice(start, cfg.window) for start in range(0, table.num_rows, cfg.window)]
    dataset = ray.data.from_arrow(blocks).map_batches(
        SegmentPerBatch,
        fn_constructor_args=(cfg, recipe, width, layout),
        batch_size=cfg.window,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=size),
        **resources,
    )
    started, wall = time.perf_counter(), time.time()
    with tqdm(total=len(todo), unit="caption", disable=not cfg.progress, dynamic_ncols=True) as bar:
        for result in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in result.to_pylist():
                report.encoded += row["captions"]
                report.tokens += row["tokens"]
                report.truncated += row["truncated"]
                if row["segment"]:
                    report.segments.append(row["segment"])
                report.timeline.append((row["done"] - wall, row["captions"]))
                bar.update(row["offered"])
    report.seconds = time.perf_counter() - started
