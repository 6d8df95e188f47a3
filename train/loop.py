"""`tcjepa train`: the training loop, on one process or many (torchrun: DDP, or FSDP for the largest models).

Data flows: TrainIndex (join, built once by rank 0) → StepBatches (DataLoader
workers: decode, crop, masks, caption tokens from memory maps) → device →
JEPA forward under bf16 autocast → losses → AdamW step with schedules read at
the step → EMA of the target encoder → metrics / validation / checkpoint.
No text model is imported anywhere on this path.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
import yaml
from filelock import FileLock, Timeout
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from pipeline.core.devices import resolve_device
from pipeline.core.errors import DataProblem, Stopped, UserError
from pipeline.core.fsutil import atomic_write_bytes
from train.checkpoint import (
    checkpoint_step,
    has_checkpoint,
    load_full_checkpoint,
    load_sharded_into,
    save_checkpoint,
    save_encoders,
    save_sharded_checkpoint,
    sharded_checkpoint,
)
from train.config import (
    TrainConfig,
    absolute_paths,
    differences,
    ema_schedule,
    resolve_automatic,
    saved_config,
    to_dict,
    validate,
)
from train.data import StepBatches, device_decoding
from train.data_index import HexDigests, ImageRefs, TrainIndex, build_index, verify_images
from train.initial import initialise
from train.jepa import JEPA, apply_schedules, build_models, checkpoint_blocks, compile_blocks
from train.metrics import MetricsLog, plot_curves
from train.partitions import (
    PartitionSplit,
    check_layout,
    node_count,
    node_partitions,
    node_segments,
    node_shards,
    partition_run,
)
from train.reporting import Progress, check_loggers
from train.schedules import Cosine, Linear, WarmupCosine
from train.step import TrainStep, make_optimizer, on_device, use_tensor_cores
from train.validation import validate_in_chunks
from train.vit import VisionTransformer

CONFIG = "config.yaml"
INDEX = "index.parquet"
TEXT_ENCODER = "text_encoder.json"
T = TypeVar("T")
# What Slurm (`--signal`) and Kubernetes send before they kill a job: finish the step, checkpoint, exit 75.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def local_rank() -> int:
    """This process's number on its node (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def processes_per_node(world: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE (all processes on one node without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def start_runtime(cfg: TrainConfig) -> Runtime:
    """Join the torchrun process group when there is one, and pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(cfg.device, local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        use_tensor_cores()
    if world > 1 and not dist.is_initialized():
        # A long timeout: rank 0 may spend a while building the index while the others wait.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    return Runtime(rank, world, device)


def barrier(rt: Runtime) -> None:
    if rt.world > 1:
        dist.barrier()


def agreed(rt: Runtime, step: Callable[[], T], on: bool) -> T | None:
    """Run `step` where `on`, then every process learns whether all succeeded (a barrier too).

    A failure on one rank (a bad --out, a damaged remote file) then stops every rank with
    its message, instead of leaving the others waiting in a barrier until the timeout.
    """
    result, error = None, None
    if on:
        try:
            result = step()
        except (UserError, DataProblem, OSError) as exc:
            error = exc
    ok = error is None
    if rt.world > 1:
        flag = torch.tensor([int(ok)], device=rt.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        ok = bool(flag.item())
    if error is not None:
        raise error
    if not ok:
        raise UserError("another process of this run failed (its message is above); stopping")
    return result


def prepare_run(cfg: TrainConfig, run: Path, rt: Runtime, store_dir: Path | None) -> FileLock | None:
    """Create RUN and lock it (rank 0); refuse a RUN made with a different config.

    The lock (an flock, gone with the process even on SIGKILL) stops a second trainer
    from writing into a run that is still going. `config.yaml` is written later, by `save_config`, once the
    settings proved valid on the data: a RUN without it holds at most what a refused start left (its index and
    text-encoder record), which is removed here so that a corrected retry into the same RUN starts clean.
    """
    saved_path = run / CONFIG
    if saved_path.exists():
        saved = saved_config(yaml.safe_load(saved_path.read_text()) or {})
        changed = differences(saved, cfg)
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} → {to_dict(cfg)[k]!r}" for k in changed[:4])
            raise UserError(f"{run} holds a run with another config ({details}); use a new --out or the same settings")

    def claim() -> FileLock:
        if not saved_path.exists() and run.exists() and any(not _left_by_a_start(p) for p in run.iterdir()):
            raise UserError(f"--out {run} is a non-empty directory that is not a tcjepa run; choose a new directory")
        run.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(run / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise UserError(
                f"{run} is in use by another `tcjepa train` (it holds {run / '.lock'}); wait for it or stop it"
            ) from None
        if not saved_path.exists():
            for leftover in run.iterdir():
                if leftover.name != ".lock":
                    leftover.unlink()
        if store_dir is not None:
            check_text_encoder(store_dir, cfg.store, run)
        return lock

    return agreed(rt, claim, on=rt.main)


def _left_by_a_start(path: Path) -> bool:
    """What a start refused before it saved its config leaves in RUN: the lock, the index, the encoder record and
    their temporaries."""
    name = path.name
    return path.is_file() and (
        name in (".lock", INDEX, TEXT_ENCODER) or name.startswith((f".{INDEX}.", f".{TEXT_ENCODER}."))
    )


def save_config(cfg: TrainConfig, run: Path, rt: Runtime) -> None:
    """Write RUN/config.yaml (the settings as asked, automatic ones as 0): the mark of a run whose settings work."""
    agreed(
        rt, lambda: atomic_write_bytes(run / CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode()), rt.main
    )


def check_text_encoder(store_dir: Path, given: str | None, run: Path) -> None:
    """Record the store's encoder in RUN, and refuse to continue on vectors of another one (a store rebuilt in
    place)."""
    from embedding_cache.store import EmbeddingStore

    store = EmbeddingStore(store_dir)
    record = run / TEXT_ENCODER
    if record.exists():
        trained_on = json.loads(record.read_text())["encoder_hash"]
        if trained_on != store.encoder_hash:
            raise UserError(
                f"{run} was trained on embeddings of encoder {trained_on[:12]}, but --store {given} now holds "
                f"encoder {store.encoder_hash[:12]}'s; use a new --out, or the store the run started with"
            )
        return
    atomic_write_bytes(
        record,
        json.dumps({"encoder_hash": store.encoder_hash, "encoder": store.encoder, "d_model": store.width}).encode(),
    )


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
    if nodes > 1 and sharing == 1 and rt.main:
        print(
            f"partitions 1: each of the {nodes} nodes reads the whole store; --partitions P (a multiple of {nodes}) "
            f"has each read 1/{nodes} of it",
            file=sys.stderr,
        )
    if not text:
        return split, sharing, []
    node, parts = serving(rt, sharing, cfg.partitions)
    reads = node_segments(index, split, parts)
    if local_rank() == 0 and cfg.partitions > 1:
        served = f"{parts.start}" if len(parts) == 1 else f"{parts.start}–{parts.stop - 1}"
        print(
            f"node {node} of {sharing}: partitions {served} of {cfg.partitions}, {len(reads.names)} of the "
            f"{len(index.segments)} store segments the run reads, {reads.shared} of them only for captions its images "
            "share with other partitions' images",
            file=sys.stderr,
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
        print(
            f"{who}{done.shards} of the {shards.total} image shards the run reads ({done.bytes / 1e6:.1f} MB, "
            f"{done.fetched} fetched now, each image checked against the index){shared} in {where}",
            file=sys.stderr,
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
        print(index.coverage_line(), file=sys.stderr)
        index.save(path)

    def check() -> None:
        if store is None:
            return
        from embedding_cache.store import EmbeddingStore

        stale = TrainIndex.load(path).stale_for(EmbeddingStore(store).segment_ids())
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


class StopRequests:
    """Records a stop signal (SIGTERM, SIGUSR1) while training, and lets every process agree on it after a step.

    The handler only notes the signal; the loop asks `agreed()` after each step. Under torchrun the processes
    all-reduce their flags (on a CPU gloo group, so no GPU stream is waited for) and stop after the same step
    even when the signal reached them at different steps.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.signal: int | None = None
        self.group = None
        if rt.world > 1:
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def _note(self, signum: int, frame: object) -> None:
        self.signal = signum

    @contextmanager
    def listening(self) -> Iterator[None]:
        """Stop signals are noted, not fatal, inside the block; the previous handlers come back after it."""
        previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def agreed(self) -> int | None:
        """The stop signal any process received (the highest number), or None to go on."""
        if self.rt.world == 1:
            return self.signal
        flag = torch.tensor([self.signal or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) or None


def end_workers(loader: Iterator[Any]) -> None:
    """End a DataLoader iterator's worker processes now (torch's iterators have no public way to)."""
    shutdown = getattr(loader, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _ignore_stop_signals(worker: int) -> None:
    """DataLoader workers leave stop signals sent to the whole process group to the trainer, which ends them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Trainer:
    """One training run on this process: joins the process group, builds the index (rank 0), the models, the data
    and the optimizer, and resumes from the run's checkpoint when there is one. `run()` trains."""

    def __init__(self, cfg: TrainConfig, run: Path, progress: bool = True) -> None:
        validate(cfg)
        check_loggers(cfg.log)
        self.run_dir = run
        self.progress = progress
        self.rt = start_runtime(cfg)
        if (cfg.batch_size // self.rt.world) % cfg.accum_steps:
            raise UserError(
                f"each of the {self.rt.world} processes gets {cfg.batch_size // self.rt.world} images per step, not "
                f"divisible by accum_steps {cfg.accum_steps}"
            )
        cfg = absolute_paths(cfg)
        for_index = inputs_for_index(cfg, self.rt)
        self.run_lock = prepare_run(
            cfg, run, self.rt, Path(for_index.text_store) if cfg.conditioning != "none" else None
        )
        self.index = load_or_build_index(for_index, run, self.rt, progress)
        for_index = resolve_automatic(for_index, len(self.index.refs), say=self.rt.main)
        save_config(cfg, run, self.rt)
        self.split, self.nodes, segments = partition(for_index, self.index, self.rt)
        images_for_training(for_index, self.index, self.split, self.nodes, self.rt)
        self.cfg = cfg = inputs_for_training(cfg, for_index, segments, self.rt)
        torch.manual_seed(cfg.seed)
        self.model, self.target = build_models(cfg, text_width(cfg))
        if cfg.init is not None and not has_checkpoint(run):
            initialise(Path(cfg.init), self.model, self.target, say=self.rt.main)
        self.model.to(self.rt.device)
        self.target.to(self.rt.device)
        self.dataset = StepBatches(
            self.index,
            self.split.train_ids,
            cfg,
            self.model.encoder.grid,
            self.rt.rank,
            self.rt.world,
            device_decode=device_decoding(cfg, self.rt.device),
            partition_of=self.split.partition_of,
        )
        self.lr = WarmupCosine(cfg.start_lr, cfg.lr, cfg.final_lr, cfg.warmup_steps, cfg.steps)
        self.wd = Cosine(cfg.weight_decay[0], cfg.weight_decay[1], cfg.steps)
        self.ema = Linear(*ema_schedule(cfg), cfg.steps)
        self.metrics = MetricsLog(run)
        # The optimizer is made after FSDP has replaced the parameters by their shards.
        self.train_module = wrap_models(self.model, self.target, cfg, self.rt.device)
        self.optimizer = make_optimizer(self.model, cfg, self.rt.device)
        self.step = TrainStep(self.model, self.train_module, self.target, self.optimizer, cfg, self.rt.device)
        self.stops = StopRequests(self.rt)
        self.start_step = self._resume()
        if self.start_step and self.rt.main:
            print(f"resuming {run} at step {self.start_step}", file=sys.stderr)
        if self.rt.main:  # what a stopped run logged after its last checkpoint (or before its first) is redone
            self.metrics.truncate_after(self.start_step)

    def _resume(self) -> int:
        """Load the run's newest checkpoint, of either format, into this process's (sharded or whole) models and
        optimizer; its step, or 0 when there is none."""
        sharded = sharded_checkpoint(self.run_dir)
        full = load_full_checkpoint(self.run_dir)
        if sharded is not None and (full is None or sharded[1] > int(full["step"])):
            return self._load_sharded()
        if full is None:
            return 0
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, full["model"], options=options)
        set_model_state_dict(self.target, full["target"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, full["optimizer"], options=options)
        return int(full["step"])

    def _sharded_state(self) -> dict[str, Any]:
        """This process's shards (plain tensors on one process) of model, target and optimizer, keyed by name."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "target": get_model_state_dict(self.target), "optimizer": optimizer}

    def _load_sharded(self) -> int:
        state = self._sharded_state()
        step = load_sharded_into(self.run_dir, state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        set_model_state_dict(self.target, state["target"])
        return step

    def _save(self, step: int) -> None:
        """FSDP: every process writes its shards (no gather); otherwise rank 0 writes full state dicts. Either way
        rank 0 also writes the two encoders as safetensors (under FSDP gathered to it, on CPU: the encoders only)."""
        cfg = self.cfg
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=full))
        target = cast(dict[str, torch.Tensor], get_model_state_dict(self.target, options=full))
        if self.rt.main:
            context = {k.removeprefix("encoder."): v for k, v in model.items() if k.startswith("encoder.")}
            save_encoders(self.run_dir, {"target_encoder": target, "context_encoder": context}, step, to_dict(cfg))
        if cfg.fsdp:
            save_sharded_checkpoint(
                self.run_dir, self._sharded_state(), step, to_dict(cfg), cfg.checkpoint_keep, cfg.checkpoint_every_keep
            )
        elif self.rt.main:
            state = {
                "model": model,
                "target": target,
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=full),
                "step": step,
                "config": to_dict(cfg),
            }
            save_checkpoint(self.run_dir, state, cfg.checkpoint_keep, cfg.checkpoint_every_keep)
        barrier(self.rt)

    def _set_schedules(self, step: int) -> float:
        lr, wd = self.lr(step), self.wd(step)
        for group in self.optimizer.param_groups:
            apply_schedules(group, lr, wd)
        return self.ema(step)

    def _loader(self) -> torch.utils.data.DataLoader:
        workers = self.cfg.num_workers
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            sampler=range(self.start_step, self.cfg.steps),
            num_workers=workers,
            pin_memory=self.rt.device.type == "cuda",
            prefetch_factor=4 if workers else None,
            persistent_workers=False,
            worker_init_fn=_ignore_stop_signals,
        )

    def _mean_across_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if self.rt.world > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= self.rt.world
        return values

    def run(self) -> list[dict[str, Any]]:
        """Train from the start step to the last, logging, validating and checkpointing on schedule; on a stop
        signal, finish the step, checkpoint and raise `Stopped`."""
        progress = (
            Progress(self.run_dir, to_dict(self.cfg), self.start_step, self.cfg.steps, self.progress, self.cfg.log)
            if self.rt.main
            else None
        )
        with self.stops.listening():
            self._train(progress)
        self._finish(progress)
        return self.metrics.read() if self.rt.main else []

    def _train(self, progress: Progress | None) -> None:
        """The steps. The host reads the device only where it logs (`log_every`), validates or checkpoints: a step
        itself queues its work and moves on.
        """
        cfg, rt = self.cfg, self.rt
        sums = torch.zeros(4, device=rt.device)
        replaced = 0
        logged_steps = 0
        tick, images_seen = time.perf_counter(), 0
        self.train_module.train()
        loader = iter(self._loader())
        batches = on_device(loader, rt.device, cfg.accum_steps)
        try:
            for step, (batch, micro) in zip(range(self.start_step, cfg.steps), batches):
                sums += self.step(micro, self._set_schedules(step))
                done = step + 1
                logged_steps += 1
                images_seen += cfg.batch_size
                replaced += batch.replaced
                if progress is not None:
                    progress.step()
                if done % cfg.log_every == 0 or done == cfg.steps:
                    means = self._mean_across_ranks(sums / logged_steps).tolist()
                    if rt.world > 1:
                        count = torch.tensor(float(replaced), device=rt.device)
                        dist.all_reduce(count, op=dist.ReduceOp.SUM)
                        replaced = int(count.item())
                    if not all(math.isfinite(v) for v in means):
                        self._stop_non_finite(done)
                    elapsed = time.perf_counter() - tick
                    record = {
                        "step": done,
                        "loss": means[0],
                        "loss_predict": means[1],
                        "loss_sparse": means[2],
                        "loss_consistency": means[3],
                        "lr": self.lr(step),
                        "wd": self.wd(step),
                        "ema": self.ema(step),
                        "images_per_s": images_seen / elapsed,
                        "images_replaced": replaced,
                    }
                    if progress is not None:
                        self.metrics.append(record)
                        progress.logged(record)
                    sums.zero_()
                    replaced = 0
                    logged_steps, images_seen, tick = 0, 0, time.perf_counter()
                if done % cfg.val_every == 0 or done == cfg.steps:
                    # Every rank validates (FSDP's forward is collective); rank 0 writes.
                    record = {"step": done, **self.validate()}
                    if progress is not None:
                        self.metrics.append(record)
                        progress.logged(record)
                        plot_curves(self.run_dir)
                    tick = time.perf_counter()
                saved = done % cfg.checkpoint_every == 0 or done == cfg.steps
                if saved:
                    self._checkpoint(done, sums)
                stop = self.stops.agreed() if done < cfg.steps else None
                if stop is not None:
                    if not saved:
                        self._checkpoint(done, sums)
                    self._finish(progress)
                    raise Stopped(
                        f"{signal.Signals(stop).name} received: stopped after step {done} of {cfg.steps} with a "
                        f"checkpoint in {self.run_dir}; run the same command again to continue"
                    )
        finally:
            # Ends the DataLoader's workers now, on an error too (one raised in a worker included: torch ends them
            # only once the iterator is collected, which the traceback holding it delays). They ignore stop signals,
            # so multiprocessing's exit handler, which ends children with SIGTERM and then waits, must not be left
            # to do it.
            batches.close()
            end_workers(loader)

    def _checkpoint(self, step: int, sums: torch.Tensor) -> None:
        """Save a checkpoint, unless the losses since the last log are not finite (then stop, keeping the last)."""
        if not bool(torch.isfinite(self._mean_across_ranks(sums.clone())).all()):
            self._stop_non_finite(step)
        self._save(step)

    def _finish(self, progress: Progress | None) -> None:
        """Close the progress display and loggers, unlock RUN, leave the process group."""
        if progress is not None:
            progress.close()
        if self.run_lock is not None:
            self.run_lock.release()
        if self.rt.world > 1:
            dist.destroy_process_group()

    def _stop_non_finite(self, step: int) -> None:
        last = checkpoint_step(self.run_dir)
        kept = (
            f"the last good checkpoint (step {last}) is kept" if last is not None else "no checkpoint was written yet"
        )
        raise UserError(f"loss became NaN/Inf by step {step}; {kept}. Lower --lr, enable grad_clip, or check the data")

    def validate(self) -> dict[str, Any]:
        """Prediction loss with true / shuffled / no captions, positive patch–word cosines per layer, RankMe: the
        validation images split across processes, a per-rank training batch at a time (`train.validation`)."""
        self.model.eval()
        rt = self.rt
        chunk = self.cfg.batch_size // rt.world
        split = self.split
        out = validate_in_chunks(
            self.step,
            self.target,
            self.dataset,
            split.val_ids,
            chunk,
            rt.rank,
            rt.world,
            split.val_bounds.tolist(),
            self.nodes,
        )
        self.model.train()
        return out


def wrap_models(model: JEPA, target: VisionTransformer, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The module that trains: blocks compiled and/or checkpointed in place, then, in a process group, DDP around
    the JEPA, or FSDP2 sharding of the JEPA and the target alike (the same mesh, block by block, so the EMA is
    shard-local)."""
    if cfg.compile:
        compile_blocks(model.encoder.blocks, model.predictor.blocks, target.blocks)
    if cfg.checkpoint_activations:
        checkpoint_blocks(model.encoder.blocks, model.predictor.blocks)
    if not dist.is_initialized():
        return model
    if cfg.fsdp:
        shard(model, target, cfg, device)
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in, no copy out
        # Every parameter gets a gradient every step (a caption-less image is masked, not skipped); DDP's reducer
        # cannot skip the all-reduce of accumulated micro-batches (`no_sync`) with a static graph, though.
        static_graph=cfg.accum_steps == 1,
        bucket_cap_mb=cfg.ddp_bucket_mb,
        **_no_buffer_sync(),
    )


def _no_buffer_sync() -> dict[str, Any]:
    """No buffer broadcast before each forward (the only buffers are fixed position embeddings and normalisation
    constants): `forward_sync_buffers=False` where torch has it (2.13), `broadcast_buffers=False` before."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def shard(model: JEPA, target: VisionTransformer, cfg: TrainConfig, device: torch.device) -> None:
    """FSDP2 over every process (a 1-D mesh), or with `shard_within_node` HSDP: sharded across a node's processes and
    replicated across nodes (a 2-D mesh, nodes × processes per node). bf16 parameters in forward and backward when
    `bf16`, gradients reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if cfg.shard_within_node:
        per_node = processes_per_node(world)
        if world % per_node:
            raise UserError(f"shard_within_node: {world} processes are not whole nodes of {per_node}")
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.bf16 else None, reduce_dtype=torch.float32)
    for root, blocks in ((model, [*model.encoder.blocks, *model.predictor.blocks]), (target, list(target.blocks))):
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(root, mesh=mesh, mp_policy=policy)


def run_training(cfg: TrainConfig, run: Path, progress: bool = True) -> list[dict[str, Any]]:
    """Run (or resume) training into the run directory `run`; returns the metrics lines (rank 0)."""
    return Trainer(cfg, run, progress).run()
