"""Padded batches with their padding left out: per-token layers run on the real tokens alone, attention on rows.

Contexts are padded to the batch's longest and captions to its longest caption, so a padded `[B, L, d]` batch
carries ~20–40% padding. Everything in a transformer but attention works token by token, so the residual stream
can hold only the real tokens, back to back (`[T, d]`, "packed"); attention, which needs rows, scatters its input
into the padded layout and gathers its output back (`TokenLayout.pad`, `TokenLayout.pack`). What padding then costs
is attention's share of the FLOPs (a few percent at these lengths) and two copies per attention, not 20–40% of every
matrix multiply.

The number of real tokens, `tokens`, fixes the packed tensors' length. The trainer counts it on the host (from the
lengths the loader hands over), so no step waits for the device to count it; elsewhere `TokenLayout.of` counts it
where the mask is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenLayout:
    """Which tokens of a padded `[B, L]` batch are real: `key_mask` bool `[B, L]` (True on real tokens), and `slots`
    int64 `[T]`, their flat positions `b·L + j` in row-major order. With `slots` the batch is packed (`[T, d]`);
    without (None) its rows stay padded and attention only masks the padding (`[B, L, d]`)."""

    key_mask: torch.Tensor
    slots: torch.Tensor | None = None

    @classmethod
    def of(cls, valid: torch.Tensor, tokens: int | None = None) -> TokenLayout:
        """The packed layout of bool `valid` `[B, L]`, which holds `tokens` True entries (None: counted here, which
        waits for the device on CUDA)."""
        count = int(valid.sum()) if tokens is None else tokens
        if not 0 <= count <= valid.numel():
            raise ValueError(f"{count} real tokens cannot fit in a padded batch of {tuple(valid.shape)}")
        if tokens is not None:  # a wrong count would drop tokens or index out of range: checked where the mask is,
            # without waiting for it (on CUDA a failed check stops the kernels that follow)
            torch._assert_async(valid.sum() == count, "the host's token count is not the mask's")
        slots = torch.nonzero_static(valid.reshape(-1), size=count).squeeze(1)
        return cls(valid, slots)

    @property
    def packed(self) -> bool:
        return self.slots is not None

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed `x` `[T, ...]` in the padded layout `[B, L, ...]`, zeros on padding."""
        assert self.slots is not None, "a layout without slots is padded already"
        b, length = self.key_mask.shape
        flat = x.new_zeros((b * length, *x.shape[1:]))
        flat.index_copy_(0, self.slots, x)  # in place on a fresh tensor: no copy of the zeros, none in backward
        return flat.view(b, length, *x.shape[1:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Padded `x` `[B, L, ...]` as its real tokens back to back, `[T, ...]`."""
        assert self.slots is not None, "a layout without slots keeps its rows padded"
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.slots)

    def jagged(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Packed tensors `[T, ...]` as nested jagged tensors `[B, j, ...]` sharing one ragged dimension: row b is its
        real tokens alone, no padding (what SDPA's flash kernel takes as variable-length sequences on CUDA).

        Every row here has a real token (a context holds at least `min_context` patches, a predictor's sequence its
        target block), so the minimum length is given as 1 and the maximum as the padded length, and nothing waits
        for the device to count them."""
        assert self.slots is not None, "a layout without slots has no packed tokens"
        offsets = F.pad(self.key_mask.sum(1).cumsum(0), (1, 0))  # where each row's tokens start among the packed
        longest = self.key_mask.shape[1]
        return tuple(torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=1, max_seqlen=longest) for x in xs)

    def ranks(self) -> torch.Tensor:
        """int64 `[B·L]`: each padded position's index among the packed tokens (meaningful on real tokens only)."""
        return self.key_mask.reshape(-1).cumsum(0) - 1
