"""Compiling for lengths that change every step: which dims are symbolic, and no guessing that two are equal.

A graph traced with a dim marked dynamic serves every size of that dim; the dims left unmarked (widths, head
dims, depth) stay static, so their kernels are specialised. Duck sizing (torch's default) gives two dims that
happen to be equal when a graph is traced one symbol, and a later step on which they differ compiles again: a
caption length equal to the model's width on the first step, or B·M equal to L.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def mark_dynamic(tensor: torch.Tensor | None, *dims: int) -> None:
    """Mark `dims` of `tensor` (if any) dynamic for the next compiled call that takes it."""
    from torch._dynamo import maybe_mark_dynamic

    if tensor is not None:
        for dim in dims:
            maybe_mark_dynamic(tensor, dim)


def without_duck_sizing(compiled: Callable[..., Any], *args: Any) -> Any:
    """`compiled(*args)` traced, if it is, with duck sizing off."""
    from torch.fx.experimental import _config as shape_config

    with shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # set by install_config_module
        return compiled(*args)
