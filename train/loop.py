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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import yaml
from filelock import FileLock, Timeout
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from pipeline.core.devices import resolve_device
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_write_bytes
from train.checkpoint import load_checkpoint, save_checkpoint
from train.config import TrainConfig, differences, to_dict, validate
from train.data import Batch, StepBatches, normalise, split_images
from train.data_index import TrainIndex, build_index
from train.jepa import JEPA, StepLosses, build_models, compute_losses, ema_update, param_groups
from train.metrics import MetricsLog, effective_rank, plot_curves
from train.predictor import TextBatch
from train.schedules import Cosine, Linear, WarmupCosine
from train.vit import VisionTransformer

CONFIG = "config.yaml"
INDEX = "index.parquet"
TEXT_ENCODER = "text_encoder.json"
T = TypeVar("T")


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def start_runtime(cfg: TrainConfig) -> Runtime:
    """Join the torchrun process group when there is one, and pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
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
    """Create RUN, lock it (rank 0) and save the resolved config; refuse a RUN made with a different config.

    The lock (an flock, gone with the process even on SIGKILL) stops a second trainer
    from writing into a run that is still going.
    """
    saved_path = run / CONFIG
    if saved_path.exists():
        saved = yaml.safe_load(saved_path.read_text()) or {}
        changed = differences(saved, cfg)
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} → {to_dict(cfg)[k]!r}" for k in changed[:4])
            raise UserError(f"{run} holds a run with another config ({details}); use a new --out or the same settings")

    def claim() -> FileLock:
        if not saved_path.exists() and run.exists() and any(p.name != ".lock" for p in run.iterdir()):
            raise UserError(f"--out {run} is a non-empty directory that is not a tcjepa run; choose a new directory")
        run.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(run / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise UserError(
                f"{run} is in use by another `tcjepa train` (it holds {run / '.lock'}); wait for it or stop it"
            ) from None
        atomic_write_bytes(saved_path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
        if store_dir is not None:
            check_text_encoder(store_dir, cfg.store, run)
        return lock

    return agreed(rt, claim, on=rt.main)


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


def inputs_for_training(cfg: TrainConfig, for_index: TrainConfig, index: TrainIndex, rt: Runtime) -> TrainConfig:
    """The store to train from: a remote one's segments that hold the index's captions, fetched once per node
    (local rank 0) before any reading, and nothing else of it. (The cache is read only to build the index.)

    Rank 0 finds those segments in the keys mirror it built the index from and tells the others, so no other
    node reads even the store's keys. Every node needs the same segments: rows are drawn by global sample
    index, so over an epoch every rank touches every indexed image.
    """
    from embedding_cache.reader import StoreKeys
    from embedding_cache.remote_store import local_store
    from embedding_cache.store import EmbeddingStore
    from pipeline.core.remote import is_remote, mirror_path

    if not is_remote(cfg.store):
        return for_index
    mirror = Path(cfg.mirror) if cfg.mirror else None
    segments = [
        agreed(rt, lambda: StoreKeys(EmbeddingStore(for_index.store)).segments_holding(index.caption_keys), on=rt.main)
    ]
    if rt.world > 1:
        dist.broadcast_object_list(segments, src=0)
    agreed(rt, lambda: local_store(cfg.store, mirror, only=segments[0]), on=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    return replace(for_index, store=str(mirror_path(cfg.store, mirror)))


def load_or_build_index(cfg: TrainConfig, run: Path, rt: Runtime) -> TrainIndex:
    """The image ↔ caption ↔ store join, built once by rank 0 and saved beside the run."""
    path = run / INDEX

    def build() -> None:
        cache = Path(cfg.cache) if cfg.conditioning != "none" else None
        store = Path(cfg.store) if cfg.conditioning != "none" else None
        images = [Path(p) for p in cfg.images]
        index = build_index(images, cache, store, cfg.recipes, cfg.min_coverage, cfg.image_column, split=cfg.split)
        print(index.coverage_line(), file=sys.stderr)
        index.save(path)

    agreed(rt, build, on=rt.main and not path.exists())
    return TrainIndex.load(path)


def text_width(cfg: TrainConfig) -> int | None:
    if cfg.conditioning == "none":
        return None
    from embedding_cache.store import EmbeddingStore

    return EmbeddingStore(cfg.store).width


@dataclass
class DeviceBatch:
    """A batch on the device, as the model takes it."""

    images: torch.Tensor  # float [b, 3, H, W], normalised
    context: torch.Tensor  # int64 [b, Lc]
    context_valid: torch.Tensor | None  # bool [b, Lc]; None when no row is padded
    targets: torch.Tensor  # int64 [b, M, Lt]
    text: TextBatch | None

    def losses(
        self, model: torch.nn.Module, target: VisionTransformer, cfg: TrainConfig, text: TextBatch | None
    ) -> StepLosses:
        """This batch's losses with captions `text` (the batch's own, shuffled ones, or None)."""
        return compute_losses(model, target, self.images, self.context, self.targets, text, cfg, self.context_valid)


def to_device(batch: Batch, device: torch.device, dtype: torch.dtype) -> DeviceBatch:
    valid = batch.context_valid()
    text = None
    if batch.tokens is not None and batch.lengths is not None:
        text = TextBatch(batch.tokens, batch.lengths).to(device, dtype=dtype, non_blocking=True)
    return DeviceBatch(
        normalise(batch.images.to(device, non_blocking=True)),
        batch.context.to(device, non_blocking=True),
        None if valid is None else valid.to(device, non_blocking=True),
        batch.targets.to(device, non_blocking=True),
        text,
    )


def shuffled(text: TextBatch) -> TextBatch:
    """Captions moved to the next image (a derangement): the honest control for text reliance."""
    return TextBatch(text.tokens.roll(1, dims=0), text.lengths.roll(1, dims=0))


class Trainer:
    """One training run on this process: joins the process group, builds the index (rank 0), the models, the data
    and the optimizer, and resumes from the run's checkpoint when there is one. `run()` trains."""

    def __init__(self, cfg: TrainConfig, run: Path, progress: bool = True) -> None:
        validate(cfg)
        self.run_dir = run
        self.progress = progress
        self.rt = start_runtime(cfg)
        for_index = inputs_for_index(cfg, self.rt)
        self.run_lock = prepare_run(cfg, run, self.rt, Path(for_index.store) if cfg.conditioning != "none" else None)
        self.index = load_or_build_index(for_index, run, self.rt)
        self.cfg = cfg = inputs_for_training(cfg, for_index, self.index, self.rt)
        train_ids, self.val_ids = split_images(len(self.index.refs), cfg.val_images, cfg.seed)
        torch.manual_seed(cfg.seed)
        self.model, self.target = build_models(cfg, text_width(cfg))
        self.model.to(self.rt.device)
        self.target.to(self.rt.device)
        self.dataset = StepBatches(self.index, train_ids, cfg, self.model.encoder.grid, self.rt.rank, self.rt.world)
        self.lr = WarmupCosine(cfg.start_lr, cfg.lr, cfg.final_lr, cfg.warmup_steps, cfg.steps)
        self.wd = Cosine(cfg.weight_decay[0], cfg.weight_decay[1], cfg.steps)
        self.ema = Linear(cfg.ema[0], cfg.ema[1], cfg.steps)
        self.autocast_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        self.metrics = MetricsLog(run)
        state = load_checkpoint(run)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.target.load_state_dict(state["target"])
        # The optimizer is made after FSDP has replaced the parameters by their shards.
        self.train_module = self._wrap(self.model)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.text_lr_scale), lr=cfg.lr, betas=cfg.betas)
        self.start_step = 0
        if state is not None:
            set_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True)
            )
            self.start_step = int(state["step"])
            if self.rt.main:
                print(f"resuming {run} at step {self.start_step}", file=sys.stderr)
        if self.rt.main:  # what a stopped run logged after its last checkpoint (or before its first) is redone
            self.metrics.truncate_after(self.start_step)

    def _wrap(self, model: JEPA) -> torch.nn.Module:
        """DDP (the target stays unwrapped), or FSDP sharding of both models alike so the EMA is shard-local."""
        module: torch.nn.Module = model
        if self.rt.world > 1:
            if self.cfg.fsdp:
                from torch.distributed.fsdp import fully_shard

                for block in [*model.encoder.blocks, *model.predictor.blocks]:
                    fully_shard(block)
                fully_shard(model)
                for block in self.target.blocks:
                    fully_shard(block)
                fully_shard(self.target)
            else:
                ids = [self.rt.device.index] if self.rt.device.type == "cuda" else None
                module = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if self.cfg.compile:
            module = torch.compile(module)
        return module

    def _set_schedules(self, step: int) -> float:
        lr, wd = self.lr(step), self.wd(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
            group["weight_decay"] = wd if group["decay"] else 0.0
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
        )

    def _state(self, step: int) -> dict[str, Any]:
        """Full (unsharded, CPU) state keyed by parameter names: restorable on any world size, DDP or FSDP.

        A collective under FSDP: every rank calls it, rank 0 writes it.
        """
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=full),
            "target": get_model_state_dict(self.target, options=full),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=full),
            "step": step,
            "config": to_dict(self.cfg),
        }

    def _mean_across_ranks(self, values: torch.Tensor) -> torch.Tensor:
        if self.rt.world > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= self.rt.world
        return values

    def run(self) -> list[dict[str, Any]]:
        """Train from the start step to the last, logging, validating and checkpointing on schedule."""
        cfg, rt = self.cfg, self.rt
        device_type = rt.device.type
        val_batch = self.dataset.validation_batch(self.val_ids)
        sums = torch.zeros(4, device=rt.device)
        replaced = torch.zeros((), device=rt.device)
        logged_steps = 0
        tick, images_seen = time.perf_counter(), 0
        bar = None
        if rt.main and self.progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc="train", unit="step", file=sys.stderr)
        self.train_module.train()
        for step, batch in zip(range(self.start_step, cfg.steps), self._loader()):
            momentum = self._set_schedules(step)
            on_device = to_device(batch, rt.device, self.autocast_dtype)
            with torch.autocast(device_type, dtype=self.autocast_dtype, enabled=cfg.bf16):
                losses = on_device.losses(self.train_module, self.target, cfg, on_device.text)
            self.optimizer.zero_grad(set_to_none=True)
            losses.total.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            if self.cfg.fsdp and self.rt.world > 1:
                self.target.reshard()  # a root FSDP module keeps its forward's full parameters; the EMA works on shards
            ema_update(self.target, self.model.encoder, momentum)
            done = step + 1
            parts = torch.stack([losses.total, losses.predict, losses.sparse, losses.consistency]).detach().float()
            sums += parts
            logged_steps += 1
            images_seen += cfg.batch_size
            replaced += batch.replaced
            if bar is not None:
                bar.update(1)
            if done % cfg.log_every == 0 or done == cfg.steps:
                means = self._mean_across_ranks(sums / logged_steps).tolist()
                if rt.world > 1:
                    dist.all_reduce(replaced, op=dist.ReduceOp.SUM)
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
                    "ema": momentum,
                    "images_per_s": images_seen / elapsed,
                    "images_replaced": int(replaced),
                }
                if rt.main:
                    self.metrics.append(record)
                sums.zero_()
                replaced.zero_()
                logged_steps, images_seen, tick = 0, 0, time.perf_counter()
            if done % cfg.val_every == 0 or done == cfg.steps:
                # Every rank validates (FSDP's forward is collective); rank 0 writes.
                record = {"step": done, **self.validate(val_batch)}
                if rt.main:
                    self.metrics.append(record)
                    plot_curves(self.run_dir)
                tick = time.perf_counter()
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                if not bool(torch.isfinite(self._mean_across_ranks(sums.clone())).all()):
                    self._stop_non_finite(done)
                state = self._state(done)
                if rt.main:
                    save_checkpoint(self.run_dir, state)
                barrier(rt)
        if bar is not None:
            bar.close()
        if self.run_lock is not None:
            self.run_lock.release()
        if rt.world > 1:
            dist.destroy_process_group()
        return self.metrics.read() if rt.main else []

    def _stop_non_finite(self, step: int) -> None:
        state = load_checkpoint(self.run_dir)
        kept = f"the last good checkpoint (step {state['step']}) is kept" if state else "no checkpoint was written yet"
        raise UserError(f"loss became NaN/Inf by step {step}; {kept}. Lower --lr, enable grad_clip, or check the data")

    @torch.no_grad()
    def validate(self, batch: Batch) -> dict[str, Any]:
        """Prediction loss with true / shuffled / no captions, positive patch–word cosines per layer, RankMe."""
        cfg, rt = self.cfg, self.rt
        self.model.eval()
        on_device = to_device(batch, rt.device, self.autocast_dtype)
        text = on_device.text
        out: dict[str, Any] = {}
        with torch.autocast(rt.device.type, dtype=self.autocast_dtype, enabled=cfg.bf16):
            true = on_device.losses(self.model, self.target, cfg, text)
            out["val_loss_predict"] = float(true.predict)
            swapped = shuffled(text) if text is not None else None
            out["val_loss_predict_shuffled"] = float(on_device.losses(self.model, self.target, cfg, swapped).predict)
            out["val_loss_predict_notext"] = float(on_device.losses(self.model, self.target, cfg, None).predict)
            features = self.target(on_device.images)
        if true.positive_fraction is not None:
            out["val_positive_cosine"] = [round(float(v), 5) for v in true.positive_fraction]
        flat = torch.nn.functional.layer_norm(features.float(), features.shape[-1:]).reshape(-1, features.shape[-1])
        pick = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(len(flat))[:4096]).to(flat.device)
        out["val_rankme"] = effective_rank(flat[pick])
        self.model.train()
        return out


def run_training(cfg: TrainConfig, run: Path, progress: bool = True) -> list[dict[str, Any]]:
    """Run (or resume) training into the run directory `run`; returns the metrics lines (rank 0)."""
    return Trainer(cfg, run, progress).run()
