"""Which device a command computes on: the one place `--device` is read, what that device computes natively, and
how many CPUs this process may use."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pipeline.core.errors import UserError

if TYPE_CHECKING:
    import torch


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which Slurm and containers set), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


DEVICE_HELP = "auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N"


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` is this process's GPU (cuda:`local_rank`) when CUDA is there, else the CPU; `cuda` is cuda:`local_rank`.

    Asking for CUDA on a machine without it is a one-line error, not a traceback deep in torch.
    """
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: expected {DEVICE_HELP}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} GPUs")
    return device


def native_bf16(device: torch.device) -> bool:
    """Whether `device` has bf16 arithmetic of its own: every CUDA device torch supports here, and a CPU with
    AVX512-BF16 or AMX. Elsewhere torch emulates it: on an AVX2-only CPU a bf16 matmul under autocast took 8.4x
    the float32 one (4096 x 192 by 192 x 768, one thread, 2026-12-03)."""
    import torch

    if device.type != "cpu":
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
