"""The GPU check: the trainer's own step on synthetic tensors, for the day a GPU is lent (`benchmarks/gpu_check.sh`).

Needs torch (with torchvision) and the project's model and step modules only (no store, no dataset, no text model: zarr,
numcodecs, datasets and vllm are never imported; the `input` phase writes its own JPEGs), so it runs on a bare CUDA
machine. It comes in phases (PHASES; `--list` prints them with their expected time, each under 4 minutes cold on one
H200, measured where a run has shown it); `--phase A B` runs some, by default all. ViT-B/16 at 224, batch 128 per GPU,
captions N=8 × 128 words of width 1024. One JSON line per figure as it is measured, on stdout and, when $OUT (or --out)
is set, in `$OUT/gpu_check.jsonl`, and a `phase` line with each phase's seconds:

- `throughput` lines (phases `throughput`, `after_mlp`, `vit_large`, `options`, `heads`, `attention`): images/s; MFU on
  the FLOPs computed (`FlopCounterMode` on the first batch's shapes, padding included, carried over to the timed
  batches' shapes by the analytic count's ratio), on the useful ones (the analytic count at each image's real lengths)
  and on the padded ones (every layer on the padded rows, as before packing); peak allocated and reserved memory; graphs
  compiled, graph breaks and recompiles during the timed steps (fresh masks every step: 0 is the goal); the host syncs
  of one step (CUDA's sync debug mode: 0 is the goal);
- `input`: one batch of JPEGs decoded as `--decode gpu` does it, nvJPEG's decode and the crops' resize, image by image
  and batched, timed apart (`device_decode`); then the trainer itself (`run_training`, `none`) for 20 steps over JPEGs
  written to local disk at start, decoded by its DataLoader workers and then by nvJPEG: images/s of the real overlapped
  input path;
- `profile`: device time per step of each part the trainer labels for a profiler (target encoder, context encoder,
  predictor, regularisers, backward, optimizer, EMA) and of the kernels no label holds, and the backward's time split
  by the part whose forward made each of its nodes;
- `smoke`: 100 compiled training steps over a few fixed batches: the loss must fall;
- `torchrun`: one process under `torchrun` with NCCL (joined as the trainer joins it), two clipped steps with DDP and
  two with FSDP2 (their losses compared), and the trainer's sharded checkpoint (written in the background on a gloo
  group beside NCCL) published and resumed.

`--dry-run` does all of it on the CPU with tiny shapes, a few steps, gloo, and torch.compile's `aot_eager` backend
(a test runs it). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import PHOTO_SIZES, ROOT, write_jpegs
from train.config import ModelConfig, TrainConfig
from train.data import Batch, mask_config
from train.jepa import build_models
from train.masks import padded_length, sample_masks
from train.optim import make_optimizer
from train.parallel import regulariser_passes, wrap_models
from train.runtime import join_process_group, precision_on
from train.schedules import WarmupCosine
from train.step import TrainStep, choose_cuda_kernels, micro_batches, on_device, whole

# Dense bf16 peaks (NVIDIA's data sheets, without sparsity), the first name a device's contains: the H100 PCIe and NVL
# cards (H100's and H200's) run lower clocks than the SXM ones ("NVIDIA H100 80GB HBM3").
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H200": 989.4e12,
    "H100": 989.4e12,
    "A100": 312e12,
}
# The torchrun phase's child gives up after this, and is stopped within 30 s more: within the 240 s each phase is
# given (`timeout -k 20 240`).
TORCHRUN_LIMIT_S = 180
WORKER_PID_FILE = "GPU_CHECK_WORKER_PID_FILE"  # where the torchrun worker writes its process group (an env variable)
FLOP_COUNT_ROWS = 16  # rows of a micro-batch whose eager step FlopCounterMode counts (`Rig._count_flops`)


@dataclass(frozen=True)
class Spec:
    """One throughput measurement: a model, a text mode, compiled or not, the caption codec, and TrainConfig fields
    that set an option (activation checkpointing, accumulation, predictor heads)."""

    name: str
    model: str
    conditioning: str
    pool: str
    compiled: bool
    codec: str = "float16"  # the store's: float16, or int8 with per-token and per-channel scales
    options: tuple[tuple[str, object], ...] = ()


NONE = Spec("vit_b16_none_compiled", "vit_base", "none", "before_mlp", True)
CROSS = Spec("vit_b16_cross8_before_mlp_compiled", "vit_base", "cross", "before_mlp", True)


@dataclass(frozen=True)
class Phase:
    """A separate command (`--phase NAME`): one device call runs one or a few, each under 4 minutes cold."""

    about: str
    expected_s: int  # on one H200, cold (compilation included), process start excluded
    measured: bool  # expected_s read off a run on an H200 (2026-12-04), else an estimate
    specs: tuple[Spec, ...] = ()


PHASES = {
    "throughput": Phase(
        "ViT-B/16 none and cross before_mlp compiled; cross with float16 and with int8 captions",
        160,
        True,
        (NONE, CROSS, replace(CROSS, name=CROSS.name + "_int8", codec="int8")),
    ),
    "after_mlp": Phase(
        "cross compiled with pool after_mlp (the paper's literal reading: one MLP per caption)",
        120,
        False,
        (Spec("vit_b16_cross8_after_mlp_compiled", "vit_base", "cross", "after_mlp", True),),
    ),
    "vit_large": Phase(
        "cross compiled, ViT-L/16",
        120,
        False,
        (Spec("vit_l16_cross8_before_mlp_compiled", "vit_large", "cross", "before_mlp", True),),
    ),
    "options": Phase(
        "cross compiled with activation checkpointing, then with accumulation 2 (the default is `throughput`'s)",
        150,
        False,
        (
            replace(CROSS, name=CROSS.name + "_checkpointed", options=(("checkpoint_activations", True),)),
            replace(CROSS, name=CROSS.name + "_accum2", options=(("accum_steps", 2),)),
        ),
    ),
    "heads": Phase(
        "cross compiled with predictor_heads 6 (head dim 64) against `throughput`'s default 12 (32)",
        90,
        False,
        (replace(CROSS, name=CROSS.name + "_predictor_heads6", options=(("predictor_heads", 6),)),),
    ),
    "attention": Phase(
        "cross compiled, attention masked (padded rows, a key mask) then jagged (flash's variable-length kernel)",
        150,
        False,
        (CROSS, replace(CROSS, name=CROSS.name + "_jagged", options=(("attention", "jagged"),))),
    ),
    "input": Phase(
        "one batch's nvJPEG decode, then its resize per image and batched, timed apart; then ViT-B/16 none: 20 steps"
        " of the trainer over JPEGs on local disk, CPU-decoded by its workers, then nvJPEG",
        55,
        False,  # 45 s measured before the first part was added
    ),
    "profile": Phase(
        "none, then cross, compiled: device time per step by part (encoders, predictor, regularisers, ...) and the top"
        " kernels",
        90,
        False,
    ),
    "regularisers": Phase(
        "the text regularisers alone, 32 images of ViT-B/16 cross shapes: the Function before issue 32 point 1 and"
        " today's, eager and compiled: ms and inductor's bytes per image",
        120,
        False,
    ),
    "smoke": Phase("100 compiled training steps on 4 fixed batches: the loss must fall", 65, True),
    "torchrun": Phase(
        "one process under torchrun, NCCL: compiled DDP and FSDP2 steps, a sharded checkpoint round trip",
        180,
        False,
    ),
}
# The operators SDPA dispatches to, one per kernel family (flash, efficient, cudnn, math), forward and backward
# (compiled code calls them too); not the kernels' own ops nested inside them, which would count each call twice.
ATTENTION_OPS = ("aten::_scaled_dot_product_",)
# The step's parts, as train.jepa, train.objective and train.step label them for a profiler.
PARTS = (
    "target_encoder",
    "context_encoder",
    "predictor",
    "regularisers",
    "regularisers_backward",
    "backward",
    "optimizer",
    "ema",
)
TEXT_PARTS = ("regularisers", "regularisers_backward")  # labelled only where a step has captions
ON_AUTOGRAD_THREAD = ("regularisers_backward",)  # labels inside a backward: on CUDA on autograd's own thread
FORWARD_PARTS = ("target_encoder", "context_encoder", "predictor", "regularisers")  # what a backward node came from
BACKWARD_NODE = "autograd::engine::evaluate_function: "  # the profiler's name for one node of a backward pass


@dataclass(frozen=True)
class Shapes:
    image_size: int
    patch_size: int
    batch: int  # images per step on this GPU
    captions: int  # N
    words: int  # max_words: a step's longest caption is 1/2 to all of it, each caption 1/2 to all of that
    text_dim: int
    warmup: int  # untimed steps (compilation happens here)
    timed: int
    smoke_steps: int
    overrides: dict  # TrainConfig fields that shrink the model (dry run)
    compile_backend: str = "inductor"
    input_images: int = 512  # JPEGs written for the input phase (its steps cycle over them)
    input_sizes: tuple[tuple[int, int], ...] = PHOTO_SIZES
    input_steps: int = 20
    input_log_every: int = 5  # images/s is logged per window of this many steps; the first window is warm-up


# Batch 128 per GPU, as a run would use it: at 64 an H200 waits on the host (docs/development.md, "On a GPU").
FULL = Shapes(224, 16, 128, 8, 128, 1024, warmup=3, timed=10, smoke_steps=100, overrides={})
DRY = Shapes(
    32,
    8,
    4,
    2,
    24,
    16,
    warmup=1,
    timed=2,
    smoke_steps=12,
    overrides=dict(width=64, depth=2, heads=2, predictor_width=48, predictor_depth=2, predictor_heads=2),
    # Dynamo's capture (whole graphs, lengths marked dynamic) and AOTAutograd as on the GPU; not inductor, whose CPU
    # code generation (C++, ~75 s cold per graph set here) is nothing the GPU's Triton path runs
    compile_backend="aot_eager",
    input_images=16,
    input_sizes=((64, 48), (48, 64)),
    input_steps=4,
    input_log_every=1,
)


def config(spec: Spec, shapes: Shapes) -> TrainConfig:
    return TrainConfig(
        model=spec.model,
        image_size=shapes.image_size,
        patch_size=shapes.patch_size,
        batch_size=shapes.batch,
        conditioning=spec.conditioning,
        pool=spec.pool,
        captions_per_image=shapes.captions,
        max_words=shapes.words,
        compile=spec.compiled,
        min_context=4,
        warmup_steps=10,
        steps=shapes.smoke_steps,
        **{**shapes.overrides, **dict(spec.options)},
    )


def synthetic_batch(
    cfg: TrainConfig,
    grid: tuple[int, int],
    step: int,
    text_dim: int | None,
    missing: float = 0.0,
    codec: str = "float16",
) -> Batch:
    """A host batch as the loader makes it for `step`: random pixels, the step's masks for the global batch, and
    (with `text_dim`) N captions per image of random token vectors packed back to back, float16 or int8 with
    per-token and per-channel scales as an int8 store holds them; a `missing` share of the images has no caption, and
    others lack some."""
    rng = np.random.default_rng([cfg.seed, step])
    b, n = cfg.batch_size, cfg.captions_per_image
    masks = sample_masks(mask_config(cfg), grid, cfg.seed, step, b)
    images = torch.from_numpy(rng.integers(0, 256, (b, 3, cfg.image_size, cfg.image_size), dtype=np.uint8))
    tokens = lengths = scales = channel_scales = None
    if text_dim is not None:
        # The step's longest caption is drawn too (half to all of max_words), then each caption half to all of it: the
        # padded caption length differs from step to step, as in a run.
        longest = int(rng.integers(max(cfg.max_words // 2, 1), cfg.max_words + 1))
        words = rng.integers(max(longest // 2, 1), longest + 1, (b, n))
        words[:, 1:][rng.random((b, n - 1)) < 0.25] = 0  # some images have fewer captions
        words[rng.random(b) < missing] = 0
        packed = rng.standard_normal((int(words.sum()), text_dim), dtype=np.float32)
        lengths = torch.from_numpy(words.astype(np.int64))
        if codec == "int8":
            from embedding_cache.codec import quantize_int8

            channel = rng.uniform(0.5, 2.0, text_dim).astype(np.float32)
            quantized, per_token = quantize_int8(packed * channel, channel)
            tokens, scales, channel_scales = map(torch.from_numpy, (quantized, per_token, channel))
        else:
            tokens = torch.from_numpy(packed.astype(np.float16))
    return Batch(
        images,
        torch.from_numpy(masks.context),
        torch.from_numpy(masks.context_lengths),
        torch.from_numpy(masks.targets),
        tokens,
        lengths,
        0,
        scales=scales,
        channel_scales=channel_scales,
    )


class Rig:
    """Models, optimizer and step for one config on `device` (wrapped for DDP/FSDP when a process group is up)."""

    def __init__(
        self, cfg: TrainConfig, shapes: Shapes, device: torch.device, count_flops: bool = False, codec: str = "float16"
    ) -> None:
        torch.manual_seed(cfg.seed)
        self.codec = codec
        self.cfg = cfg = precision_on(cfg, device)
        self.text_dim = shapes.text_dim if cfg.conditioning != "none" else None
        self.device = device
        self.model, self.target = build_models(ModelConfig.of(cfg), self.text_dim)
        self.model.to(device)
        self.target.to(device)
        self.grid = self.model.encoder.grid
        # Counted before compiling: FlopCounterMode does not see inside compiled kernels. And before `wrap_models` sets
        # the attention: with `attention: jagged` the count is masked attention's, whose attention over padding jagged
        # rows skip (a few % of a step), as FlopCounterMode cannot follow SDPA's nested math path on a CPU.
        self.counted_over_analytic = self._counted_over_analytic() if count_flops else 0.0
        self.module = wrap_models(self.model, self.target, cfg, device, shapes.compile_backend)
        self.optimizer = make_optimizer(self.model, cfg, device)
        self.step = TrainStep(
            self.model,
            self.module,
            self.target,
            self.optimizer,
            cfg,
            device,
            regulariser_passes(cfg, shapes.compile_backend),
        )
        self.lr = WarmupCosine(cfg.start_lr, cfg.lr, cfg.final_lr, cfg.warmup_steps, cfg.steps)

    def batches(self, steps: range, missing: float = 0.0) -> list[Batch]:
        """The steps' batches on the host, pinned on CUDA as the trainer's loader hands them over."""
        made = [synthetic_batch(self.cfg, self.grid, s, self.text_dim, missing, self.codec) for s in steps]
        return [b.pin_memory() for b in made] if self.device.type == "cuda" else made

    def _counted_over_analytic(self) -> float:
        """FlopCounterMode's count of one eager step over the analytic count (`analytic_flops`, computed) of the same
        rows: the first `FLOP_COUNT_ROWS` rows a micro-batch of this config's first batch (the model and target are put
        back as they were). Not the whole batch: eagerly, without compiled fusion or activation checkpointing, it
        would need more memory than the compiled runs it measures. The ratio carries over to any batch."""
        from torch.utils.flop_counter import FlopCounterMode

        optimizer = make_optimizer(self.model, self.cfg, self.device)
        step = TrainStep(self.model, self.model, self.target, optimizer, self.cfg, self.device)
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        target_state = {k: v.clone() for k, v in self.target.state_dict().items()}
        first = self.batches(range(1))[0]
        rows = first.rows(0, min(len(first), FLOP_COUNT_ROWS * self.cfg.accum_steps))
        (_, micro), *_ = on_device([rows], self.device, self.cfg.accum_steps)
        with FlopCounterMode(display=False) as counter:
            step(micro, 0.996)
        self.model.load_state_dict(state)
        self.target.load_state_dict(target_state)
        self.model.zero_grad(set_to_none=True)  # not a copy of the parameters held until the first timed step
        # The analytic count is a whole step's, of `batch_size` images like these rows: scaled to the rows counted.
        return counter.get_total_flops() / (analytic_flops(self, [rows])[1] * len(rows) / self.cfg.batch_size)

    def run(
        self, batches: list[Batch], lr: bool = True, first: int = 0, before_each: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """One step per batch, the first at the schedule's step `first`, through the trainer's overlapped input path
        (`on_device`: the next batch fetched and copied beside the step); `before_each` called as each step is about
        to be queued. The loss parts of each, left on the device."""
        out = []
        for i, (_, micro) in enumerate(on_device(batches, self.device, self.cfg.accum_steps), start=first):
            if before_each is not None:
                before_each()
            if lr:
                for group in self.optimizer.param_groups:
                    group["lr"] = self.lr(i) * group["lr_scale"]
            out.append(self.step(micro, 0.996))
        return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_syncs(rig: Rig, batch: Batch) -> int | None:
    """Host syncs one step makes (`count_host_syncs`; None on CPU)."""
    if rig.device.type != "cuda":
        return None
    (_, micro), *_ = on_device([batch], rig.device, rig.cfg.accum_steps)
    return count_host_syncs(partial(rig.step, micro, 0.996), rig.device)


def count_host_syncs(work: Callable[[], Any], device: torch.device) -> int | None:
    """Host syncs `work()` makes, counted by CUDA's sync debug mode (None on CPU, which has none to count)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    return sum("synchronizing" in str(w.message) for w in caught)


def compile_counts() -> tuple[int, int, int]:
    """(frames Dynamo compiled, graphs it made, graph breaks) since its counters were last cleared."""
    from torch._dynamo.utils import counters

    return (counters["frames"]["total"], counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def analytic_flops(rig: Rig, batches: list[Batch]) -> tuple[float, float, float]:
    """A step's FLOPs (`batch_size` images), at the mean over `batches`' images, counted analytically
    (`benchmarks/train_step.py`'s count): useful (at each image's real context length and mean caption length),
    computed (as the step computes them: the real tokens packed, attention on padded rows) and padded (every layer on
    the padded rows), each micro-batch on its own rows as the step cuts them (micro-batches are of one size)."""
    from benchmarks.train_step import Mode, useful_and_computed_flops

    cfg = rig.cfg
    captions = cfg.captions_per_image if rig.text_dim else 0
    mode = Mode(cfg.conditioning, captions, cfg.pool, cfg.context_equalise)
    model = rig.model
    useful = computed = padded = 0.0
    micro = [part for step in batches for part in micro_batches(step, cfg.accum_steps)]
    for batch in micro:
        m, lt = batch.targets.shape[1:]
        words = np.zeros(len(batch))
        padded_words = 0
        if batch.lengths is not None:
            words = batch.lengths.double().mean(dim=1).numpy()
            padded_words = padded_length(int(batch.lengths.max()))
        rows = (batch.context.shape[1], padded_words)
        lengths = batch.context_lengths.tolist()
        counts = useful_and_computed_flops(
            cfg, mode, model.encoder, model.predictor, lt, m, rig.text_dim or 0, lengths, words, rows
        )
        useful, computed, padded = useful + counts[0], computed + counts[1], padded + counts[2]
    return useful / len(micro), computed / len(micro), padded / len(micro)


def step_times(rig: Rig, batches: list[Batch]) -> list[float]:
    """Each step's seconds, the steps run back to back as the trainer runs them (no sync between them, the next
    batch copied beside the step). On CUDA, between events recorded on the compute stream as each step is queued
    and after the last: a device waiting on the host (launches, the input path) counts, a host running ahead does
    not. (Until 2026-12-06 each step ran alone with a sync after it, its batch's copy not overlapped.) On the CPU,
    by the clock as each step starts."""
    cuda = rig.device.type == "cuda"
    marks: list[Any] = []

    def mark() -> None:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    rig.run(batches, lr=False, before_each=mark)
    mark()
    synchronize(rig.device)
    if cuda:
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    return [b - a for a, b in zip(marks, marks[1:])]


def throughput(spec: Spec, shapes: Shapes, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    if ("attention", "jagged") in spec.options and device.type != "cuda":
        spec = replace(spec, compiled=False)  # nested rows compile on CUDA only (`wrap_models`)
    cfg = config(spec, shapes)
    rig = Rig(cfg, shapes, device, count_flops=True, codec=spec.codec)
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = rig.batches(range(shapes.warmup + shapes.timed))
    counters.clear()
    start = time.perf_counter()
    rig.run(batches[: shapes.warmup], lr=False)
    synchronize(device)
    warmup_s = time.perf_counter() - start
    frames, graphs, breaks = compile_counts()
    times = step_times(rig, batches[shapes.warmup :])
    seconds = statistics.median(times)
    peak = peak_flops(gpu_name(device)) if device.type == "cuda" else None
    # FlopCounterMode counted some rows of the first batch; the timed batches have other context and caption lengths,
    # so its count is carried over to each by the analytic count's ratio, and MFU is each step's FLOPs over its own
    # time (median).
    counted = rig.counted_over_analytic
    per_step = [analytic_flops(rig, [batch]) for batch in batches[shapes.warmup :]]
    useful, computed, padded = (statistics.mean(counts) for counts in zip(*per_step))
    flops = counted * computed
    rates = [counted * counts[1] / t for counts, t in zip(per_step, times)]
    mfu = statistics.median(rates) / peak if peak else None
    cuda = device.type == "cuda"
    result = {
        "check": "throughput",
        "config": spec.name,
        "compiled": spec.compiled,
        "batch": shapes.batch,
        "codec": spec.codec if rig.text_dim else None,
        "options": dict(spec.options),
        "s_per_step": round(seconds, 5),
        "images_per_s": round(shapes.batch / seconds, 1),
        "gflop_per_step": round(flops / 1e9, 3),  # the timed steps' mean, as computed (padding included)
        "mfu": round(mfu, 4) if mfu is not None else None,  # on the FLOPs computed, padding included
        "useful_over_computed_flops": round(useful / computed, 3),
        "useful_over_padded_flops": round(useful / padded, 3),  # as if every layer ran on the padded rows
        "mfu_useful": round(mfu * useful / computed, 4) if mfu is not None else None,
        # what the MFU would read counting every layer on the padded rows, as before packing
        "mfu_padded": round(mfu * padded / computed, 4) if mfu is not None else None,
        "warmup_s": round(warmup_s, 1),
        "graphs_compiled": graphs,
        "graph_breaks": breaks,
        "recompiles_in_timed_steps": compile_counts()[0] - frames,  # fresh masks each step: 0 is the goal
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if cuda else None,
        "host_syncs_per_step": host_syncs(rig, batches[-1]),
    }
    del rig
    release_memory(device)
    return result


def input_path(shapes: Shapes, device: torch.device) -> Iterator[dict]:
    """The trainer itself (`run_training`, conditioning `none`, no store) for `input_steps` steps over JPEGs written to
    local disk: its DataLoader workers, pinned copies on a side stream and compiled step, the images decoded by the
    workers (`decode: cpu`) and then by nvJPEG on the device (`decode: gpu`). images/s of the loop, per log window
    after the first (compilation, workers starting), beside the synthetic batches of the `throughput` phase. Then a
    few uncompiled steps decoded on the device over the same JPEGs, every other one cut short after its scan's
    header (a sound header, no body, no end-of-image marker): the workers must send them to the CPU decoder, which
    refuses them, and count them as replaced, the steps going on. Each run's record as soon as it ends (`guarded`)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        jpegs = write_jpegs(folder, shapes.input_images, 0, shapes.input_sizes)
        yield guarded({"check": "device_decode"}, partial(device_decode, shapes, device, jpegs), device)
        for decode in ("cpu", "gpu", "gpu_corrupt"):
            if decode == "gpu_corrupt":
                for path in jpegs[::2]:
                    data = path.read_bytes()
                    path.write_bytes(data[: data.index(b"\xff\xda") + 14])  # the header and the scan's, then nothing
            check = "input_corrupt" if decode == "gpu_corrupt" else "input"
            yield guarded(
                {"check": check, "decode": decode.removesuffix("_corrupt")},
                partial(_input_run, shapes, device, Path(tmp), len(jpegs), decode),
                device,
            )


def device_decode(shapes: Shapes, device: torch.device, jpegs: list[Path], repeats: int = 5) -> dict:
    """What `--decode gpu` spends on one batch of these JPEGs (issue 32 point 7), host milliseconds, medians of
    `repeats`: the batched nvJPEG decode (synchronous: torchvision waits for it); then the crops' resize both ways
    (`device_resize`), image by image and batched, interleaved, each first the time to queue its kernels (what holds
    the input thread) and then to the end of a sync (its device work too); and the operators each dispatches per image
    that are not views (each one kernel or more; on this device: a CPU resizes uint8 as it is, CUDA converts). The
    batched resize pays where it queues in less time than the per-image one; either matters only as a share of a
    step (`throughput`'s s_per_step; `input`'s images/s with `decode: gpu` against `cpu` says whether the input path
    keeps up at all)."""
    from PIL import Image
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchvision.io import ImageReadMode, decode_jpeg

    from train.data import crop_box
    from train.images import EncodedImages, decode_one, resize_crops

    class Operators(TorchDispatchMode):
        """Counts the operators dispatched under it that are not views (a view launches no kernel)."""

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    rng = np.random.default_rng(0)
    data, boxes = [], []
    for path in (jpegs * (shapes.batch // len(jpegs) + 1))[: shapes.batch]:
        data.append(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
        with Image.open(path) as im:
            width, height = im.size
        boxes.append(crop_box(rng, width, height, (0.3, 1.0), (3 / 4, 4 / 3)))
    flips = [k % 2 == 1 for k in range(len(data))]
    encoded = EncodedImages(list(range(len(data))), data, boxes, flips).packed()
    size = (shapes.image_size, shapes.image_size)
    images = torch.empty((len(data), 3, *size), dtype=torch.uint8, device=device)

    def decode() -> list[torch.Tensor | None]:
        """nvJPEG's batched decode; where torchvision cannot decode (a CPU without its image extension, as here in
        CI), the trainer's fallback, image by image (None where nothing can read one)."""
        try:
            return list(decode_jpeg(encoded.data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            if device.type == "cuda":
                raise
            return [decode_one(d, device) for d in encoded.data]

    pixels = decode()  # warm-up: nvJPEG's handles; kept, and the only batch kept
    readable = [(row, p, box, flip) for row, p, box, flip in zip(encoded.rows, pixels, boxes, flips) if p is not None]

    decode_s: list[float] = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        decode()  # not kept: the next decode reuses its memory, as the trainer's does the last batch's
        decode_s.append(time.perf_counter() - start)
    ways = {way: partial(resize_crops, images, readable, way) for way in ("per_image", "batched")}
    queue_s: dict[str, list[float]] = {way: [] for way in ways}
    total_s: dict[str, list[float]] = {way: [] for way in ways}
    operators = {}
    syncs: dict[str, int | None] = {}
    for way, resize in ways.items():
        resize()  # warm-up: the resize's kernels
        with Operators() as counted:
            resize()
        operators[way] = round(counted.count / max(len(readable), 1), 1)
        syncs[way] = count_host_syncs(resize, device)
    for _ in range(repeats):
        for way, resize in ways.items():  # interleaved: drift falls on both alike
            synchronize(device)
            start = time.perf_counter()
            resize()
            queue_s[way].append(time.perf_counter() - start)
            synchronize(device)
            total_s[way].append(time.perf_counter() - start)

    def ms(seconds: list[float]) -> float:
        return round(statistics.median(seconds) * 1e3, 2)

    return {
        "check": "device_decode",
        "batch": len(data),
        "decoded": len(readable),
        "decode_ms": ms(decode_s),
        **{f"resize_{way}_queue_ms": ms(queue_s[way]) for way in ways},
        **{f"resize_{way}_ms": ms(total_s[way]) for way in ways},
        **{f"resize_{way}_operators_per_image": operators[way] for way in ways},
        **{f"resize_{way}_host_syncs": syncs[way] for way in ways},  # 0 is the goal (None on a CPU)
        "ok": len(readable) == len(data),
    }


def _input_run(shapes: Shapes, device: torch.device, tmp: Path, images: int, decode: str) -> dict:
    """One run of the trainer over the JPEGs in `tmp/images` (`input_path`): `decode` cpu, gpu, or gpu_corrupt (every
    other JPEG cut short)."""
    from train.config import apply, automatic_num_workers
    from train.loop import run_training

    settings = {
        **shapes.overrides,
        "images": [str(tmp / "images")],
        "conditioning": "none",
        "model": "vit_base",
        "image_size": shapes.image_size,
        "patch_size": shapes.patch_size,
        "batch_size": shapes.batch,
        "steps": shapes.input_steps,
        "warmup_steps": 2,
        "log_every": shapes.input_log_every,
        "val_every": shapes.input_steps,
        "val_images": 8,
        "checkpoint_every": shapes.input_steps,
        "compile": device.type == "cuda" and decode != "gpu_corrupt",
        "decode": decode.removesuffix("_corrupt"),
        "device": str(device),
    }
    start = time.perf_counter()
    metrics = run_training(apply(TrainConfig(), settings, "gpu_check"), tmp / f"run-{decode}", False)
    if decode == "gpu_corrupt":
        losses = [m["loss"] for m in metrics if "loss" in m]
        replaced = sum(m["images_replaced"] for m in metrics if "images_replaced" in m)
        return {
            "check": "input_corrupt",
            "decode": "gpu",
            "corrupt_images": len(range(0, images, 2)),
            "images_replaced": replaced,
            "seconds": round(time.perf_counter() - start, 1),
            "ok": bool(losses) and all(np.isfinite(losses)) and replaced > 0,
        }
    windows = [m["images_per_s"] for m in metrics if "images_per_s" in m][1:]
    return {
        "check": "input",
        "decode": decode,
        "batch": shapes.batch,
        "steps": shapes.input_steps,
        "images": shapes.input_images,
        "loader_workers": automatic_num_workers(len(os.sched_getaffinity(0)), 1),
        "images_per_s": round(statistics.median(windows), 1),
        "images_per_s_windows": [round(w, 1) for w in windows],
        "seconds": round(time.perf_counter() - start, 1),
        "ok": len(windows) > 0 and all(w > 0 for w in windows),
    }


def profile(spec: Spec, shapes: Shapes, device: torch.device, steps: int = 3, top: int = 15) -> dict:
    """A profile of `steps` compiled steps of `spec`, split by the parts the trainer labels (PARTS): on CUDA the device
    time of the kernels each launched, per step (`backward` also holds the kernels of autograd's own thread, less the
    regularisers' backward, labelled apart), and of the kernels no label holds; on the CPU each part's time (which
    includes its backward). The backward split by part (`backward_by_part`). Then the `top` kernels (CPU: operators)
    by their own time per step, which say where a part's time goes inside compiled code, and the calls per step of
    each attention kernel (flash, memory-efficient, cuDNN or math: which ones SDPA chose, issue 32 point 3; flash
    takes no mask, so its calls are the unmasked ones)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = device.type == "cuda"
    rig = Rig(config(spec, shapes), shapes, device)
    batches = rig.batches(range(shapes.warmup + steps))
    rig.run(batches[: shapes.warmup], lr=False)
    synchronize(device)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profiler(activities=activities) as prof:
        rig.run(batches[shapes.warmup :], lr=False)
        synchronize(device)
    wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    labels = {e.key: e for e in events if e.key in PARTS and e.device_type == DeviceType.CPU}
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", 0)]
        parts = {k: e.device_time_total / 1e3 / steps for k, e in labels.items()}
        parts["backward"] = parts.get("backward", 0.0) + off_thread_ms(prof.events()) / steps
        parts["backward"] -= parts.get("regularisers_backward", 0.0)  # ran on autograd's thread, inside the above
        total = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        parts["unlabelled"] = total - sum(parts.values())
        ranked = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)
        heaviest = {e.key: e.self_device_time_total / 1e3 / steps for e in ranked[:top]}
    else:
        parts = {k: e.cpu_time_total / 1e3 / steps for k, e in labels.items()}
        parts["backward"] -= parts.get("regularisers_backward", 0.0)  # ran inside the `backward` label
        total = None
        operators = [e for e in events if e.device_type == DeviceType.CPU and e.key not in PARTS]
        ranked = sorted(operators, key=lambda e: e.self_cpu_time_total, reverse=True)
        heaviest = {e.key: e.self_cpu_time_total / 1e3 / steps for e in ranked[:top]}
    by_part = backward_by_part(prof.events(), device=cuda)
    missing = [p for p in PARTS if p not in labels and (p not in TEXT_PARTS or rig.text_dim)]
    attention = {
        e.key: e.count / steps for e in events if e.device_type == DeviceType.CPU and e.key.startswith(ATTENTION_OPS)
    }
    return {
        "check": "profile",
        "config": spec.name,
        "steps": steps,
        "time": "device" if cuda else "cpu",
        "ms_per_step": {k: round(v, 3) for k, v in parts.items()},
        "backward_ms_per_step": {k: round(v / steps, 3) for k, v in by_part.items()},
        "device_ms_per_step": round(total, 3) if total is not None else None,
        "wall_ms_per_step": round(wall * 1e3, 3),
        "top_ms_per_step": {k: round(v, 3) for k, v in heaviest.items()},
        "attention_calls_per_step": attention,
        # the backward found its parts; on CUDA the labels hold no more than every kernel (a label's own device-side
        # annotation counted as its kernels would double it)
        "ok": not missing
        and {"context_encoder", "predictor"} <= set(by_part)
        and (total is None or parts["unlabelled"] >= -0.05 * total),
        "missing_parts": missing,
    }


def backward_nodes(events: list) -> dict[str, list[Any]]:
    """The backward's nodes (profiler events) by the part whose forward made each: a backward node carries the
    sequence number (and thread) of the forward operator that recorded it, and that operator ran inside a part's
    label (the innermost one). Compiled, a node is a whole compiled region, so the split
    holds wherever the regions do not straddle two parts. Nodes of no labelled forward (the loss, SIGReg) and those
    without a number (gradient accumulation into the parameters) come under `other`. Any thread: on CUDA autograd's
    own runs the backward, outside every label."""
    from torch.autograd import DeviceType

    def part_of(event: Any) -> str | None:
        while event is not None and event.name not in FORWARD_PARTS:
            event = event.cpu_parent
        return None if event is None else event.name

    def nested_in_a_node(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(BACKWARD_NODE):
            parent = parent.cpu_parent
        return parent is not None

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # Every operator run with gradients records the number its thread would give the next node, so several share one:
    # the last of them, in order of start, builds the node. Unlabelled operators count too (as None), so that a node
    # built outside every label is not given to the label whose operators ran before it.
    made_by = {
        (e.thread, e.sequence_nr): part_of(e)
        for e in cpu
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE) and not nested_in_a_node(e)
    }
    nodes: dict[str, list[Any]] = {}
    for e in cpu:
        if e.name.startswith(BACKWARD_NODE) and not nested_in_a_node(e):
            part = made_by.get((e.fwd_thread, e.sequence_nr)) if e.sequence_nr >= 0 else None
            nodes.setdefault(part or "other", []).append(e)
    return nodes


def backward_by_part(events: list, device: bool = True) -> dict[str, float]:
    """The backward's time (device time, or CPU time with `device` False) by part (`backward_nodes`)."""
    return {
        part: sum((e.device_time_total if device else e.cpu_time_total) for e in found) / 1e3
        for part, found in backward_nodes(events).items()
    }


def off_thread_ms(events: list, device: bool = True) -> float:
    """Time (device time, or CPU time with `device` False) of the work launched from threads other than the one that
    ran the labels: on CUDA autograd's engine runs the backward on its own thread, outside the `backward` label
    (0.001 ms of 257 on an H200)."""
    from torch.autograd import DeviceType

    main = {
        e.thread
        for e in events
        if e.name in PARTS and e.name not in ON_AUTOGRAD_THREAD and e.device_type == DeviceType.CPU
    }
    top = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None and e.thread not in main]
    return sum(e.device_time_total if device else e.cpu_time_total for e in top) / 1e3


def smoke(shapes: Shapes, device: torch.device) -> dict:
    """Compiled training on 4 fixed batches, cycled: the loss (mean of the last tenth over the first) must fall."""
    cfg = config(Spec("smoke", "vit_base", "cross", "before_mlp", True), shapes)
    rig = Rig(cfg, shapes, device)
    fixed = rig.batches(range(4), missing=0.25)
    losses = torch.stack(rig.run([fixed[i % 4] for i in range(shapes.smoke_steps)]))[:, 0].tolist()
    tenth = max(len(losses) // 10, 1)
    first, last = statistics.mean(losses[:tenth]), statistics.mean(losses[-tenth:])
    return {
        "check": "smoke",
        "steps": len(losses),
        "loss_first": round(first, 4),
        "loss_last": round(last, 4),
        "ok": bool(last < first) and all(np.isfinite(losses)),
    }


def torchrun_steps(shapes: Shapes, device: torch.device, emit: Callable[[dict], None] = lambda record: None) -> dict:
    """Inside torchrun, the process group joined as the trainer joins it: two steps under DDP and two under FSDP2 with
    this backend, the gradients clipped (FSDP's as DTensor shards), the losses of the two compared, and the FSDP model
    checkpointed as the trainer does (`Checkpointer`: shards written in the background on a gloo group of their own,
    published once written) and resumed into a fresh one (the equal losses of the next step say it loaded). What is
    measured so far goes to `emit` after each part (`partial`), so a run cut off keeps it."""
    import torch.distributed as dist
    from torch.nn.utils import get_total_norm

    from train.checkpoint import HISTORY, Checkpointer, load_kept_encoders, sharded_checkpoint

    join_process_group(device)  # as the trainer joins it: its backend, device and collective timeout
    main = dist.get_rank() == 0
    out: dict = {"check": "torchrun", "backend": dist.get_backend(), "world": dist.get_world_size()}
    try:
        base = config(
            Spec("torchrun", "vit_base", "cross", "before_mlp", True), replace(shapes, batch=shapes.batch // 4 or 1)
        )
        base = replace(base, grad_clip=1.0)  # the norm over DDP's gradients and over FSDP's sharded ones
        out["grad_clip"] = base.grad_clip
        for name, cfg in (("ddp", base), ("fsdp", replace(base, fsdp=True))):
            rig = Rig(cfg, shapes, device)
            parts, clipped = [], []
            for i, batch in enumerate(rig.batches(range(2))):
                parts.append(rig.run([batch], first=i)[0])
                clipped.append(whole(get_total_norm([p.grad for p in rig.model.parameters() if p.grad is not None])))
            out[f"{name}_losses"] = [round(float(p[0]), 4) for p in parts]
            out[f"{name}_grad_norms"] = [round(float(p[-1]), 4) for p in parts]  # before clipping
            out[f"{name}_clipped_grad_norms"] = [round(float(n), 4) for n in clipped]  # after: the step's update
            emit({**out, "partial": True})
            if cfg.fsdp:
                with tempfile.TemporaryDirectory() as tmp:
                    saver = Checkpointer(Path(tmp), rig.model, rig.target, rig.optimizer, main)
                    saver.save(2, {}, sharded=True, keep=2, every_keep=0, last=True)  # shards, gathered encoders
                    saver.wait()
                    out["fsdp_checkpoint_published"] = sharded_checkpoint(Path(tmp)) is not None
                    if main:  # the encoders gathered into safetensors (rank 0's) against those read from the shards
                        gathered = load_kept_encoders(Path(tmp), 2)
                        shutil.rmtree(Path(tmp) / HISTORY)
                        sharded = load_kept_encoders(Path(tmp), 2)
                        out["fsdp_gathered_encoders_match"] = (
                            gathered is not None
                            and sharded is not None
                            and all(
                                sorted(gathered[e]) == sorted(sharded[e])
                                and all(torch.equal(t, sharded[e][k]) for k, t in gathered[e].items())
                                for e in gathered
                            )
                        )
                    again = Rig(cfg, shapes, device)
                    resumed = Checkpointer(Path(tmp), again.model, again.target, again.optimizer, main).resume()
                    out["fsdp_checkpoint_resumed_step"] = resumed
                probe = rig.batches(range(2, 3))
                a, b = rig.run(probe)[0][0].item(), again.run(probe)[0][0].item()
                out["fsdp_checkpoint_roundtrip"] = abs(a - b) <= 1e-3 * abs(a) and resumed == 2
                emit({**out, "partial": True})
        # The same seed, batches and clipping: FSDP's float32 residual stream should give DDP's losses.
        differences = [abs(a - b) / max(abs(a), 1e-6) for a, b in zip(out["ddp_losses"], out["fsdp_losses"])]
        out["fsdp_vs_ddp_loss_rel_diff"] = round(max(differences), 5)
        figures = out["ddp_losses"] + out["fsdp_losses"] + out["ddp_grad_norms"] + out["fsdp_grad_norms"]
        clipped_to = [min(n, base.grad_clip) for n in out["ddp_grad_norms"] + out["fsdp_grad_norms"]]
        out["clipped_as_asked"] = all(
            abs(n - c) <= 1e-3 * c
            for n, c in zip(out["ddp_clipped_grad_norms"] + out["fsdp_clipped_grad_norms"], clipped_to)
        )
        out["ok"] = (
            all(np.isfinite(figures))
            and out["fsdp_checkpoint_roundtrip"]
            and out["clipped_as_asked"]
            and out.get("fsdp_gathered_encoders_match", True)  # rank 0's check
        )
    finally:
        dist.destroy_process_group()
    return out


def peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the GPU called `name` (`PEAK_FLOPS`), None for one not listed."""
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class Report:
    """JSON lines to stdout and, with a directory, to `gpu_check.jsonl` in it."""

    def __init__(self, out: str | None) -> None:
        self.path = Path(out) / "gpu_check.jsonl" if out else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, a few steps, gloo")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.jsonl (default: $OUT)")
    parser.add_argument(
        "--phase", nargs="+", choices=list(PHASES), default=list(PHASES), help="the phases to run (default: all)"
    )
    parser.add_argument("--list", action="store_true", help="print the phases and their expected time, then exit")
    parser.add_argument("--in-torchrun", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def list_phases() -> None:
    for name, phase in PHASES.items():
        print(f"{name:<11} ~{phase.expected_s:>3} s {'measured' if phase.measured else 'estimate'}  {phase.about}")
    total = sum(p.expected_s for p in PHASES.values())
    print(f"{'all':<11} ~{total:>4} s          (one H200, cold, process start excluded; 'measured': on 2026-12-04)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_phases()
        return 0
    if args.in_torchrun and os.environ.get(WORKER_PID_FILE):  # first: `stop_torchrun` may need to kill this group
        written = Path(f"{os.environ[WORKER_PID_FILE]}.tmp")
        written.write_text(str(os.getpgrp()))
        os.replace(written, os.environ[WORKER_PID_FILE])
    shapes = DRY if args.dry_run else FULL
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        choose_cuda_kernels()
    elif args.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.in_torchrun:
        print(json.dumps(torchrun_steps(shapes, device, lambda record: print(json.dumps(record), flush=True))))
        return 0
    report = Report(args.out)
    report({"check": "environment", "torch": torch.__version__, "device": gpu_name(device), "dry_run": args.dry_run})
    ok = True
    for name in args.phase:
        start = time.perf_counter()
        for result in phase_results(name, shapes, device, args.dry_run):
            ok &= bool(result.get("ok", True))
            report(result)  # as each finishes: a phase cut off by a time limit keeps what it measured
        report({"check": "phase", "phase": name, "seconds": round(time.perf_counter() - start, 1)})
    report({"check": "done", "ok": ok})
    return 0 if ok else 1


def phase_results(name: str, shapes: Shapes, device: torch.device, dry_run: bool) -> Iterator[dict]:
    """The records of one phase, each yielded as soon as it is measured; a measurement that fails (out of memory, a
    kernel that will not build) gives a record saying so, and the phase goes on with the next."""
    if name == "smoke":
        yield guarded({"check": "smoke"}, lambda: smoke(shapes, device), device)
    elif name == "torchrun":
        yield guarded({"check": "torchrun"}, lambda: run_torchrun(dry_run), device)
    elif name == "profile":
        for spec in (NONE, CROSS):  # side by side: where cross's extra time goes
            yield guarded({"check": "profile", "config": spec.name}, partial(profile, spec, shapes, device), device)
    elif name == "input":
        yield from input_path(shapes, device)
    elif name == "regularisers":
        yield guarded({"check": "regularisers"}, lambda: regularisers(shapes, device), device)
    else:
        for spec in PHASES[name].specs:
            yield guarded(
                {"check": "throughput", "config": spec.name}, partial(throughput, spec, shapes, device), device
            )


def guarded(about: dict, measure: Callable[[], dict], device: torch.device) -> dict:
    """`measure()`, or `about` with `ok` false and the error when it fails, its memory given back: one failed
    measurement must not cost the device call the others. (`benchmarks.regularisers` stops with SystemExit when
    inductor counted nothing.)"""
    try:
        return measure()
    except (Exception, SystemExit) as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        error = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
        failed = {**about, "ok": False, "error": error}
    # Out of the handler: its exception's traceback held the measurement's frames, and with them its models.
    with contextlib.suppress(Exception):  # after an error that poisons the CUDA context, this fails too
        release_memory(device)
    return failed


def release_memory(device: torch.device) -> None:
    """Free what the last measurement's models held (compiled blocks keep references to them until collected), so
    that the next one's peak memory is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def regularisers(shapes: Shapes, device: torch.device) -> dict:
    """`benchmarks/regularisers.py` on the device: 32 images at the full shapes (tiny ones in a dry run)."""
    from benchmarks.regularisers import Shape, measure

    full = shapes.batch >= 32
    shape = Shape(32, 648, shapes.words) if full else Shape(shapes.batch, 24, shapes.words, depth=2)
    result = measure(shape, repeats=5 if full else 1, device=device, backend=shapes.compile_backend)
    return {"check": "regularisers", **result, "ok": result["loss"]["today"] > 0}


def run_torchrun(dry_run: bool, limit_s: int | None = None) -> dict:
    """This script under torchrun (`start_torchrun`); the last record its worker printed is the result. Given
    `limit_s` (default `TORCHRUN_LIMIT_S`, in a dry run 600 s), then stopped (`stop_torchrun`): a run cut off gives
    what its last record had measured, not ok."""
    limit = limit_s or (600 if dry_run else TORCHRUN_LIMIT_S)
    with tempfile.TemporaryDirectory() as tmp:
        pid_file = Path(tmp) / "worker.pid"
        proc = start_torchrun(dry_run, pid_file)
        try:
            stdout, _ = proc.communicate(timeout=limit)
            cut_off = False
        except subprocess.TimeoutExpired:
            stdout, cut_off = stop_torchrun(proc, pid_file), True
    records = torchrun_records(stdout)
    last = records[-1] if records else {"check": "torchrun"}
    if cut_off:
        return {**last, "ok": False, "cut_off_after_s": limit}
    if proc.returncode != 0 or not records:
        return {**last, "ok": False, "exit": proc.returncode, "stdout": stdout[-2000:]}
    return last


def start_torchrun(dry_run: bool, pid_file: Path) -> subprocess.Popen:
    """This script under `torchrun --standalone --nproc-per-node 1`, its groups on the loopback interface (one node;
    the device machine reaches no network). Its worker writes its pid to `pid_file` as it starts; its records come on
    stdout, its stderr passes through as it comes (a run cut off still shows how far it got)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "benchmarks.gpu_check", "--in-torchrun", *(["--dry-run"] if dry_run else [])]
    env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", **os.environ, "OMP_NUM_THREADS": "1"}
    env[WORKER_PID_FILE] = str(pid_file)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)


def stop_torchrun(proc: subprocess.Popen, pid_file: Path, grace_s: float = 20) -> str:
    """Stop torchrun as it is told to stop: SIGTERM, which its agent passes on to its worker (in a session of its
    own, holding the GPU). `grace_s` later the worker's process group (it and its compile workers; `pid_file` names
    it) and the agent are killed: the agent's own grace before it kills the worker is 30 s, and the worker, which
    holds our stdout pipe, would outlive a killed agent. What the worker had printed."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):  # else the worker outlived the grace: killed below
        return proc.communicate(timeout=grace_s)[0]
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    proc.kill()
    try:
        return proc.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired as exc:  # a process we do not know of holds the pipe: what it printed so far
        output = exc.output
        return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def torchrun_records(stdout: str) -> list[dict]:
    """The worker's records (JSON lines whose check is torchrun), in order; any other line is not one."""
    records = []
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("check") == "torchrun":
                records.append(record)
    return records


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
