"""What a run reads, made ready on every node: the run index (built once by rank 0), the partitions this node serves,
and local copies of remote caches, stores and image shards, each fetched once per node and only as far as needed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.logs import NODE
from pipeline.core.refs import ImageRefs
from train.config import TrainConfig
from train.data_index import HexDigests, TrainIndex, build_index, verify_images
from train.partitions import (
    PartitionSplit,
    check_layout,
    node_count,
    node_partitions,
    node_segments,
    node_shards,
    partition_run,
)
from train.run_dir import INDEX
from train.runtime import Runtime, agreed, local_rank, processes_per_node

logger = logging.getLogger(__name__)


def inputs_for_index(cfg: TrainConfig, rt: Runtime) -> TrainConfig:
    """The cache and store to build the index from: local ones as given; remote (fsspec URL) ones mirrored by
    rank 0, the cache whole and the store's keys only (its tokens come later, and only where the index needs them)."""
    from captioning.remote_cache import local_cache
    from embedding_cache.remote_store import mirror_store_keys
    from pipeline.core.remote import is_remote, mirror_path

    if not (is_remote(cfg.cache) or is_remote(cfg.store)):
        return cfg
    mirror = Path(cfg.mirror) if cfg.mirror else None

    def fetch() -> None:
        if is_remote(cfg.cache):
            local_cache(cfg.cache, mirror)
        if is_remote(cfg.store):
            mirror_store_keys(cfg.store, mirror)

    agreed(rt, fetch, on=rt.main)
    return replace(
        cfg,
        cache=str(mirror_path(cfg.cache, mirror)) if is_remote(cfg.cache) else cfg.cache,
        store=str(mirror_path(cfg.store, mirror, suffix="-keys")) if is_remote(cfg.store) else cfg.store,
    )


def inputs_for_training(cfg: TrainConfig, for_index: TrainConfig, segments: list[str], rt: Runtime) -> TrainConfig:
    """The store to train from: of a remote one, the `segments` this node reads (those holding its partitions'
    captions), fetched once per node (local rank 0) before any reading, and nothing else of it. (The cache is read
    only to build the index.)

    Those segments are named in the index, which rank 0 resolved from the keys mirror, so no process reads
    even the store's keys here.
    """
    from embedding_cache.remote_store import local_store
    from pipeline.core.remote import is_remote, mirror_path

    if not is_remote(cfg.store):
        return for_index
    mirror = Path(cfg.mirror) if cfg.mirror else None
    agreed(rt, lambda: local_store(cfg.text_store, mirror, only=segments), on=local_rank() == 0)
    return replace(for_index, store=str(mirror_path(cfg.store, mirror)))


def partition(cfg: TrainConfig, index: TrainIndex, rt: Runtime) -> tuple[PartitionSplit, int, list[str]]:
    """The run's partitions and split, the number of node groups that share them out (the nodes; 1 with one
    partition: then every node serves it), and the store segments this node reads. The first process of each node
    says what its node reads."""
    try:
        nodes = node_count(rt.world, processes_per_node(rt.world))
        sharing = nodes if cfg.partitions > 1 else 1
        check_layout(cfg.partitions, cfg.batch_size, sharing)
        text = cfg.conditioning != "none"
        split = partition_run(index, cfg.partitions, cfg.val_images, cfg.seed, by_segment=text)
    except ValueError as exc:
        raise UserError(f"partitions: {exc}") from None
    if nodes > 1 and sharing == 1:
        logger.info(
            f"partitions 1: each of the {nodes} nodes reads the whole store; --partitions P (a multiple of {nodes}) "
            f"has each read 1/{nodes} of it"
        )
    if not text:
        return split, sharing, []
    node, parts = serving(rt, sharing, cfg.partitions)
    reads = node_segments(index, split, parts)
    if cfg.partitions > 1:
        served = f"{parts.start}" if len(parts) == 1 else f"{parts.start}–{parts.stop - 1}"
        logger.log(
            NODE,
            f"node {node} of {sharing}: partitions {served} of {cfg.partitions}, {len(reads.names)} of the "
            f"{len(index.segments)} store segments the run reads, {reads.shared} of them only for captions its images "
            "share with other partitions' images",
        )
    return split, sharing, reads.names


def serving(rt: Runtime, sharing: int, count: int) -> tuple[int, range]:
    """This process's node among the `sharing` that share the partitions out, and the partitions that node serves."""
    node = rt.rank // (rt.world // sharing)
    return node, node_partitions(node, sharing, count)


def images_for_training(cfg: TrainConfig, index: TrainIndex, split: PartitionSplit, sharing: int, rt: Runtime) -> None:
    """Of tar shards on object storage, those holding this node's partitions' images (training and validation) are
    fetched once per node (local rank 0) into the local mirror, each checked member by member against the index's
    sha256 before it is used; then every process reads its images from those copies (`index.refs` points there).
    No process reads an image over the network while training."""
    from pipeline.core.remote_tars import ShardMembers, fetch_shards, shard_mirror

    node, parts = serving(rt, sharing, cfg.partitions)
    shards = node_shards(index, split, parts)
    if not shards.urls:
        return
    refs = ImageRefs.of(index.refs)
    mirror = Path(cfg.mirror) if cfg.mirror else None

    def fetch() -> None:
        columns = refs.table
        members = {
            url: ShardMembers(
                columns.column("offset").take(rows).to_numpy(),
                columns.column("size").take(rows).to_numpy(),
                HexDigests.of(index.sha256).values[rows],
                columns.column("source_id").take(rows),
            )
            for url, rows in zip(shards.urls, shards.rows)
        }
        done = fetch_shards(members, mirror, recheck=cfg.verify_images)
        who = f"node {node} of {sharing}: " if sharing > 1 else ""
        shared = f", {shards.shared} of them holding other partitions' images too" if shards.shared else ""
        where = ", ".join(map(str, done.directories))
        logger.log(
            NODE,
            f"{who}{done.shards} of the {shards.total} image shards the run reads ({done.bytes / 1e6:.1f} MB, "
            f"{done.fetched} fetched now, each image checked against the index){shared} in {where}",
        )

    agreed(rt, fetch, on=local_rank() == 0)
    index.refs = refs.with_paths({url: str(shard_mirror(url, mirror)) for url in shards.urls})


def load_or_build_index(cfg: TrainConfig, run: Path, rt: Runtime, progress: bool = True) -> TrainIndex:
    """The image ↔ caption ↔ store join, with every caption's span in the store, built once by rank 0 and saved
    beside the run; a saved one whose store no longer holds its segments is refused (rank 0 checks). With
    `verify_images`, rank 0 then hashes every image against the index once."""
    path = run / INDEX
    store = Path(cfg.text_store) if cfg.conditioning != "none" else None

    def build() -> None:
        cache = Path(cfg.text_cache) if cfg.conditioning != "none" else None
        index = build_index(cfg.images, cache, store, cfg.recipes, cfg.min_coverage, cfg.image_column, split=cfg.split)
        logger.info(index.coverage_line())
        index.save(path)

    def check() -> None:
        if store is None:
            return
        from embedding_cache.store import EmbeddingStore

        stale = TrainIndex.stale_segments(path, EmbeddingStore(store).segment_ids())
        if stale:
            raise UserError(
                f"{store} no longer holds {len(stale)} of the segments {path} reads (e.g. {stale[0]}): the store was "
                f"changed since the index was built; delete {path} to rebuild it (the run then trains on the new join)"
            )

    agreed(rt, build if not path.exists() else check, on=rt.main)
    index = TrainIndex.load(path)
    if cfg.verify_images:
        agreed(rt, lambda: verify_images(index, progress=progress), on=rt.main)
    return index


def text_width(cfg: TrainConfig) -> int | None:
    if cfg.conditioning == "none":
        return None
    from embedding_cache.store import EmbeddingStore

    return EmbeddingStore(cfg.text_store).width
