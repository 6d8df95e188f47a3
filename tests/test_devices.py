"""`--device`: the one place it is read; CUDA asked for on a machine without it is a one-line error."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError


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
