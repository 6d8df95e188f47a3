"""How a store keeps token vectors: float16, or int8 with a float32 scale per token.

int8 is symmetric per-token absmax, after a fixed per-channel pre-scaling when that helps::

    vector ≈ tokens * scales[:, None] * channel_scales[None, :]     (channel_scales: 1 when absent)

T5's hidden states have a few channels 50–100× larger than the rest. With per-token
absmax alone such a channel sets the token's step and the other channels keep few
levels: with three planted channels at 50/75/100× the worst token cosine is 0.9973 at
d = 1024 and 0.990 at d = 4096. Dividing every channel by its RMS is not the cure either:
on a token where a loud channel happens to be quiet, that channel's rounding error, scaled
back up, dominates (0.9933 at d = 64). So a store made with int8 measures per-token absmax
alone on its fitting sample and keeps it when every token stays at cosine ≥ 0.9995 (a margin
over the 0.999 goal for tokens the sample lacks): the tiny and random T5s do (0.99994).
Otherwise it tries RMS**alpha pre-scaling for a few alphas and keeps the one whose worst
token is best (alpha 0.5–0.75 gives ≥ 0.9998 in the planted cases above). The choice and
the scales are fitted once, when the store is made, and are part of its recipe.

`dequantize` is the same formula in torch, for a trainer that moves int8 to the device and
expands it there (torch is imported only when it is called).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CODECS = ("float16", "int8")
INT8_MAX = 127
# Channels quieter than this fraction of the median channel RMS are scaled as if they had it (a dead channel must not
# divide by zero, nor blow its noise up to full range).
CHANNEL_FLOOR = 1e-3
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
KEEP_ABSMAX_COSINE = 0.9995  # per-token absmax alone is kept when every sample token stays at least this close
FIT_BLOCK = 8192  # rows quantized at a time while fitting (bounds memory)


def token_dtype(codec: str) -> np.dtype:
    return np.dtype(np.int8 if codec == "int8" else np.float16)


def bytes_per_token(codec: str, width: int) -> int:
    """Stored bytes of one token vector: its values, plus its float32 scale for int8."""
    return width + 4 if codec == "int8" else 2 * width


@dataclass(frozen=True)
class ChannelFit:
    """The per-channel pre-scaling chosen for a store: `scales` (None: per-token absmax alone)."""

    scales: np.ndarray | None
    alpha: float
    min_cosine: float  # the worst token cosine on the fitting sample, with these scales


def fit_channel_scales(sample: np.ndarray) -> ChannelFit:
    """Per-token absmax alone when it keeps every token of `sample` (`[n, d]` vectors) at cosine ≥
    KEEP_ABSMAX_COSINE, else the pre-scaling that keeps the worst token closest to itself.

    The candidates are RMS_c ** alpha for alpha in ALPHAS (RMS of each channel over the sample, relative to the
    median channel): 0 is per-token absmax alone, 1 equalises every channel. Full equalisation is not always best:
    it multiplies a loud channel's rounding error by its scale on tokens where that channel happens to be quiet.
    Ties go to the smaller alpha.
    """
    rms = np.sqrt(np.mean(np.square(sample, dtype=np.float64), axis=0))
    median = max(float(np.median(rms)), float(np.finfo(np.float32).tiny))
    relative = np.maximum(rms / median, CHANNEL_FLOOR)
    best: ChannelFit | None = None
    for alpha in ALPHAS:
        scales = None if alpha == 0 else (relative**alpha).astype(np.float32)
        worst = 1.0
        for start in range(0, len(sample), FIT_BLOCK):
            block = np.asarray(sample[start : start + FIT_BLOCK], dtype=np.float32)
            tokens, token_scales = quantize_int8(block, scales)
            back = dequantize_numpy(tokens, token_scales, scales, np.float32)
            worst = min(worst, float(token_cosines(block, back).min(initial=1.0)))
        if best is None or worst > best.min_cosine:
            best = ChannelFit(scales, alpha, worst)
        if alpha == 0 and worst >= KEEP_ABSMAX_COSINE:
            break
    assert best is not None
    return best


def quantize_int8(vectors: np.ndarray, channel_scales: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(int8 `[n, d]`, float32 scales `[n]`) of float vectors `[n, d]`; an all-zero token gets scale 0."""
    scaled = np.asarray(vectors, dtype=np.float32)
    if channel_scales is not None:
        scaled = scaled / channel_scales[None, :]
    scales = (np.abs(scaled).max(axis=1, initial=0.0) / INT8_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0)
    tokens = np.clip(np.rint(scaled / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return tokens, scales


def dequantize_numpy(
    tokens: np.ndarray, scales: np.ndarray | None, channel_scales: np.ndarray | None, dtype: Any = np.float16
) -> np.ndarray:
    """Stored tokens back as float vectors (`dtype`); float16 tokens (no scales) are only cast."""
    if scales is None:
        return tokens.astype(dtype, copy=False)
    out = tokens.astype(np.float32) * scales[..., None]
    if channel_scales is not None:
        out *= channel_scales
    return out.astype(dtype, copy=False)


def dequantize(tokens: Any, scales: Any = None, channel_scales: Any = None, dtype: Any = None) -> Any:
    """torch: `tokens * scales[..., None] * channel_scales` in float32, returned as `dtype` (default float32).

    `tokens` is int8 or float16 `[..., d]` (packed `[sum_len, d]` or padded), `scales` float32 `[...]` or None
    (float16 stores), `channel_scales` float32 `[d]` or None; all on the same device, where the work is done.
    """
    import torch

    dtype = dtype or torch.float32
    if scales is None:
        return tokens.to(dtype)
    out = tokens.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    if channel_scales is not None:
        out = out * channel_scales.to(torch.float32)
    return out.to(dtype)


def token_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine between matching rows of `a` and `b` (`[n, d]`); two zero rows count as equal (1)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = (a * b).sum(axis=1) / np.maximum(na * nb, np.finfo(np.float64).tiny)
    return np.where((na == 0) & (nb == 0), 1.0, cos)
