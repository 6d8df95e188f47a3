"""The processes of a run: their ranks and device, the process group, and agreement across ranks.

A run is one process or a torchrun group. Every step that can fail on one rank (a bad --out, a damaged remote file)
runs through `agreed`, so that all ranks stop with its message instead of waiting in a barrier until a timeout, and
stop signals are agreed after a step (`StopRequests`), so that every rank stops after the same one.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pipeline.core import logs
from pipeline.core.devices import native_bf16, resolve_device
from pipeline.core.errors import DataProblem, UserError
from train.config import TrainConfig
from train.step import choose_cuda_kernels

logger = logging.getLogger(__name__)
T = TypeVar("T")
# What Slurm (`--signal`) and Kubernetes send before they kill a job: finish the step, checkpoint, exit 75.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The training collectives (gradients, validation sums, checkpoints) give up after this: a hung one costs minutes on
# every node, not the hours the agreements below may need.
STEP_TIMEOUT = datetime.timedelta(minutes=15)
# Agreements between the processes may wait this long: rank 0 builds the run index (or fetches a remote cache) while
# the others wait. They run on a CPU (gloo) group of their own, so a GPU stream is never waited for either.
AGREEMENT_TIMEOUT = datetime.timedelta(hours=2)


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device
    control: Any = None  # the gloo group agreements and stop requests run on (None: one process)

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
    """Join the torchrun process group when there is one, and pick this process's device. From here on, a process
    other than rank 0 shows only warnings (and, the first of its node, its node's reports): `logs.set_rank`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    logs.set_rank(rank, local_rank())
    device = resolve_device(cfg.device, local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        choose_cuda_kernels()
    control = None
    if world > 1:
        if not dist.is_initialized():
            join_process_group(device)
        control = dist.new_group(backend="gloo", timeout=AGREEMENT_TIMEOUT)
    return Runtime(rank, world, device, control)


def join_process_group(device: torch.device) -> None:
    """The training process group (torchrun's environment): NCCL on a GPU, gloo on the CPU, collectives that give up
    after `STEP_TIMEOUT`. With the device named, NCCL sets its communicators up now rather than at the first
    collective, and barriers know which device to use."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=STEP_TIMEOUT, device_id=device if cuda else None)


def precision_on(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """`cfg` as `device` runs it: bf16 autocast only where the device computes bf16 natively. A CPU without bf16
    instructions runs float32, several times faster than emulated bf16 there, and says so in one line; the run's
    saved config keeps what was asked for."""
    if not cfg.bf16 or native_bf16(device):
        return cfg
    _say_bf16_off(torch.backends.cpu.get_cpu_capability())
    return replace(cfg, bf16=False)


@functools.cache
def _say_bf16_off(capability: str) -> None:
    """The line `precision_on` gives, once per process (the GPU check's dry run builds several trainers)."""
    logger.info(
        f"bf16: off on this CPU ({capability}, no AVX512-BF16 or AMX: torch would emulate bf16 at several times "
        "float32's cost); training in float32"
    )


def barrier(rt: Runtime) -> None:
    if rt.world > 1:
        dist.barrier(group=rt.control)


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
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=rt.control)
        ok = bool(flag.item())
    if error is not None:
        raise error
    if not ok:
        raise UserError("another process of this run failed (its message is above); stopping")
    return result


class StopRequests:
    """Records a stop signal (SIGTERM, SIGUSR1) while training, and lets every process agree on it after a step.

    The handler only notes the signal; the loop asks `agreed()` at the steps it logs or checkpoints (not every step:
    under torchrun that is a collective). The processes all-reduce their flags on the run's CPU gloo group (no GPU
    stream is waited for) and stop after the same step even when the signal reached them at different steps.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.signal: int | None = None

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
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.rt.control)
        return int(flag.item()) or None
