"""Compiling for lengths that change every step: which dims are symbolic, and which stay static.

A graph traced with a dim marked dynamic serves every size of that dim, and a marked dim gets a symbol of its own:
two marked dims equal on the traced step are not taken to be equal later. The dims left unmarked (widths, head dims,
depth) stay static, so their kernels are specialised. `torch.compile(..., dynamic=True)` instead makes every dim
symbolic by duck sizing, which gives dims of equal size on the traced step one symbol: a caption length equal to a
width then compiles the graph again on the next step. Duck sizing is also what torch applies to a dim it makes
dynamic by itself after that dim's size changed; `without_duck_sizing` turns it off for those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def mark_dynamic(tensor: torch.Tensor | None, *dims: int) -> None:
    """Mark `dims` of `tensor` (if any) dynamic for the next compiled call that takes it (a dim of size 0 or 1 is
    still specialised: torch's rule)."""
    from torch._dynamo import maybe_mark_dynamic

    if tensor is not None:
        for dim in dims:
            maybe_mark_dynamic(tensor, dim)


def without_duck_sizing(compiled: Callable[..., Any], *args: Any) -> Any:
    """`compiled(*args)`, traced (if it is) with duck sizing off for the dims torch makes dynamic by itself."""
    from torch.fx.experimental import _config as shape_config

    with shape_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]  # set by install_config_module
        return compiled(*args)
