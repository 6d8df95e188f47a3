"""`--device`: the one place it is read; CUDA asked for on a machine without it is a one-line error; bf16 only where
the device computes it."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from pipeline.core.devices import native_bf16, resolve_device
from pipeline.core.errors import UserError
from train import runtime
from train.config import TrainConfig
from train.runtime import precision_on


def test_auto_and_cpu_resolve_on_this_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def test_a_name_torch_does_not_know_is_refused_with_the_choices():
    with pytest.raises(UserError, match=r"--device 'gpu0': expected auto .*, cpu, cuda or cuda:N"):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_one_line_that_says_what_to_use():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(
            UserError, match=f"--device {name}: CUDA is not available on this machine; use --device cpu"
        ):
            resolve_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_follows_the_local_rank_and_refuses_a_gpu_the_machine_lacks():
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(UserError, match="this machine has"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as the Linux kernel lists them: a source apart from torch's own detection (the
    project runs on Linux; elsewhere this test fails on the missing file rather than passing unchecked)."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_training_on_the_cpu_keeps_bf16_only_where_the_cpu_has_bf16_instructions(caplog):
    """On a CPU without AVX512-BF16 or AMX (this machine's kind varies) bf16 is emulated, several times slower than
    float32: the run trains in float32 and says so; with them, or when float32 was asked for, nothing changes."""
    native = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert native_bf16(torch.device("cpu")) == native
    asked = TrainConfig()
    assert asked.bf16
    runtime._say_bf16_off.cache_clear()  # another test in this worker may have said it already
    with caplog.at_level(logging.INFO, logger="train.runtime"):
        ran = precision_on(asked, torch.device("cpu"))
        again = precision_on(asked, torch.device("cpu"))
    assert ran.bf16 == again.bf16 == native and asked.bf16, "the asked-for config is left as it was"
    assert caplog.text.count("training in float32") == (0 if native else 1), "said once per process"
    assert precision_on(replace(asked, bf16=False), torch.device("cpu")).bf16 is False


def test_the_training_process_group_gives_up_on_a_collective_after_15_minutes(monkeypatch):
    """Issue 32 point 5: a hung collective costs 15 minutes on every node, not the 2 hours agreements may take. The
    group joined as the trainer joins it (`join_process_group`, one process here) carries that timeout."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    runtime.join_process_group(torch.device("cpu"))
    try:
        group = dist.distributed_c10d._get_default_group()
        assert group._get_backend(torch.device("cpu")).options._timeout == runtime.STEP_TIMEOUT
        assert runtime.STEP_TIMEOUT.total_seconds() == 15 * 60 < runtime.AGREEMENT_TIMEOUT.total_seconds()
    finally:
        dist.destroy_process_group()
