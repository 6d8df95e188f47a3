"""`tcjepa train`: the training loop, on one process or many (torchrun: DDP, or FSDP for the largest models).

Data flows: TrainIndex (join, built once by rank 0: `train.inputs`) → StepBatches (DataLoader
workers: decode, crop, masks, caption tokens from memory maps) → device →
JEPA forward under bf16 autocast → losses → AdamW step with schedules read at
the step → EMA of the target encoder → metrics / validation / checkpoint (`train.checkpoint.Checkpointer`).
The processes agree through `train.runtime`, the run's files are `train.run_dir`'s, and the models are wrapped for
DDP or FSDP by `train.parallel`. No text model is imported anywhere on this path.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.core.devices import usable_cpus
from pipeline.core.errors import Stopped, UserError
from train.checkpoint import Checkpointer, checkpoint_step, has_checkpoint
from train.config import (
    MAX_LOADER_WORKERS,
    ModelConfig,
    TrainConfig,
    absolute_paths,
    automatic_num_workers,
    ema_schedule,
    resolve_automatic,
    to_dict,
    validate,
)
from train.data import StepBatches, device_decoding
from train.initial import initialise
from train.inputs import (
    images_for_training,
    inputs_for_index,
    inputs_for_training,
    load_or_build_index,
    partition,
    text_width,
)
from train.jepa import build_models
from train.metrics import CurvePlotter, MetricsLog
from train.optim import apply_schedules, make_optimizer
from train.parallel import regulariser_passes, wrap_models
from train.reporting import Progress, check_loggers
from train.run_dir import prepare_run, save_config
from train.runtime import STOP_SIGNALS, StopRequests, precision_on, processes_per_node, start_runtime
from train.schedules import Cosine, Linear, WarmupCosine
from train.step import TrainStep, on_device
from train.validation import validate_in_chunks

logger = logging.getLogger(__name__)


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
        for_index = resolve_automatic(for_index, len(self.index.refs))
        save_config(cfg, run, self.rt)
        self.split, self.nodes, segments = partition(for_index, self.index, self.rt)
        images_for_training(for_index, self.index, self.split, self.nodes, self.rt)
        self.cfg = cfg = precision_on(inputs_for_training(cfg, for_index, segments, self.rt), self.rt.device)
        torch.manual_seed(cfg.seed)
        self.model, self.target = build_models(ModelConfig.of(cfg), text_width(cfg))
        if cfg.init is not None and not has_checkpoint(run):
            initialise(Path(cfg.init), self.model, self.target)
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
        self.plots = CurvePlotter()
        # The optimizer is made after FSDP has replaced the parameters by their shards.
        self.train_module = wrap_models(self.model, self.target, cfg, self.rt.device)
        self.optimizer = make_optimizer(self.model, cfg, self.rt.device)
        self.step = TrainStep(
            self.model, self.train_module, self.target, self.optimizer, cfg, self.rt.device, regulariser_passes(cfg)
        )
        self.stops = StopRequests(self.rt)
        self.checkpoints = Checkpointer(run, self.model, self.target, self.optimizer, self.rt.main)
        self.start_step = self.checkpoints.resume()
        if self.start_step:
            logger.info(f"resuming {run} at step {self.start_step}")
        if self.rt.main:  # what a stopped run logged after its last checkpoint (or before its first) is redone
            self.metrics.truncate_after(self.start_step)

    def _set_schedules(self, step: int) -> float:
        lr, wd = self.lr(step), self.wd(step)
        for group in self.optimizer.param_groups:
            apply_schedules(group, lr, wd)
        return self.ema(step)

    def _loader(self) -> torch.utils.data.DataLoader:
        workers = self.cfg.num_workers
        if workers is None:
            cpus, ranks = usable_cpus(), processes_per_node(self.rt.world)
            workers = automatic_num_workers(cpus, ranks)
            logger.info(
                f"num_workers: {workers} DataLoader worker(s) per rank ({cpus} CPUs for {ranks} rank(s) on this node, "
                f"one kept for each rank's step; automatic: at most {MAX_LOADER_WORKERS}; set num_workers to choose)"
            )
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
        try:
            with self.stops.listening():
                self._train(progress)
        except BaseException:
            self.checkpoints.publish_if_written()  # what is written already counts, whatever ended the run
            raise
        self._finish(progress)
        return self.metrics.read() if self.rt.main else []

    def _train(self, progress: Progress | None) -> None:
        """The steps. The host reads the device only where it logs (`log_every`), validates or checkpoints: a step
        itself queues its work and moves on.
        """
        cfg, rt = self.cfg, self.rt
        sums = torch.zeros(7, device=rt.device)  # the step's 5 loss parts and gradient norm, summed; images replaced
        logged_steps = 0
        tick, images_seen = time.perf_counter(), 0
        self.train_module.train()
        loader = iter(self._loader())
        batches = on_device(loader, rt.device, cfg.accum_steps)
        try:
            for step, (batch, micro) in zip(range(self.start_step, cfg.steps), batches):
                sums[:6] += self.step(micro, self._set_schedules(step), step)
                sums[6] += batch.replaced + sum(mb.replaced for mb in micro)
                done = step + 1
                logged_steps += 1
                images_seen += cfg.batch_size
                if progress is not None:
                    progress.step()
                logged = done % cfg.log_every == 0 or done == cfg.steps
                if logged:
                    # one all-reduce and one read of the device per log: the loss means and the images replaced
                    totals = sums.clone()
                    if rt.world > 1:
                        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
                    *parts, replaced_total = totals.tolist()
                    means = [v / (logged_steps * rt.world) for v in parts]
                    replaced = int(replaced_total)
                    if not all(math.isfinite(v) for v in means):
                        self._stop_non_finite(done)
                    elapsed = time.perf_counter() - tick
                    record = {
                        "step": done,
                        "loss": means[0],
                        "loss_predict": means[1],
                        "loss_sparse": means[2],
                        "loss_consistency": means[3],
                        **({"loss_sigreg": means[4]} if cfg.sigreg > 0 else {}),
                        "grad_norm": means[5],  # before clipping (`grad_clip`), the mean over the logged steps
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
                    logged_steps, images_seen, tick = 0, 0, time.perf_counter()
                    self.checkpoints.publish_if_written()
                if done % cfg.val_every == 0 or done == cfg.steps:
                    # Every rank validates (FSDP's forward is collective); rank 0 writes.
                    record = {"step": done, **self.validate()}
                    if progress is not None:
                        self.metrics.append(record)
                        progress.logged(record)
                        self.plots.draw(self.run_dir)  # in the background: no rank waits for matplotlib
                    tick = time.perf_counter()
                saved = done % cfg.checkpoint_every == 0 or done == cfg.steps
                if saved:
                    self._checkpoint(done, sums)
                # Stop requests are agreed where the loop logs or checkpoints: a collective, not one per step.
                stop = self.stops.agreed() if (logged or saved) and done < cfg.steps else None
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
        if not bool(torch.isfinite(self._mean_across_ranks(sums[:5].clone())).all()):
            self._stop_non_finite(step)
        cfg = self.cfg
        last = step == cfg.steps
        self.checkpoints.save(step, to_dict(cfg), cfg.fsdp, cfg.checkpoint_keep, cfg.checkpoint_every_keep, last)

    def _finish(self, progress: Progress | None) -> None:
        """Publish the checkpoint being written, close the progress display and loggers, wait for the curves being
        drawn, unlock RUN, leave the process group."""
        try:
            self.checkpoints.wait()  # the last sharded checkpoint, written in the background, is published
        finally:
            self.plots.close()
            if progress is not None:
                progress.close()
            if self.run_lock is not None:
                self.run_lock.release()
            if self.rt.world > 1:
                dist.destroy_process_group()

    def _stop_non_finite(self, step: int) -> None:
        self.checkpoints.wait()  # a sharded one being written was finite when saved: it is the last good one
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


def run_training(cfg: TrainConfig, run: Path, progress: bool = True) -> list[dict[str, Any]]:
    """Run (or resume) training into the run directory `run`; returns the metrics lines (rank 0)."""
    return Trainer(cfg, run, progress).run()
