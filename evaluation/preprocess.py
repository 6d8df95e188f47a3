"""The field's evaluation preprocessing: resize the shorter side to size / 0.875 (bicubic), then centre-crop.

This is what DINO, I-JEPA and timm's evaluation transforms do (224 px from 256, `crop_pct` 0.875). The
crop's geometry is computed here once, so the pixels and the per-patch labels of the dense probe agree on
which part of the image each patch sees. Torch-free: labels import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from evaluation.protocol import CROP_FRACTION

INTERPOLATION = "bicubic"


@dataclass(frozen=True)
class CentreCrop:
    """The image resized to (`width`, `height`), then the `size` × `size` square at (`left`, `top`) kept."""

    width: int
    height: int
    left: int
    top: int
    size: int


def resize_size(size: int) -> int:
    """The shorter side before the crop, as timm computes it: floor(size / 0.875) (224 → 256)."""
    return math.floor(size / CROP_FRACTION)


def centre_crop(original: tuple[int, int], size: int) -> CentreCrop:
    """Where an image of `original` (width, height) lands: shorter side resized, long side scaled with it (as
    torchvision's `Resize(int)` rounds), then the centred crop (as `CenterCrop` rounds)."""
    width, height = original
    short = resize_size(size)
    if width <= height:
        new_w, new_h = short, int(short * height / width)
    else:
        new_w, new_h = int(short * width / height), short
    return CentreCrop(new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0)), size)


def resize_and_crop(im: Image.Image, size: int) -> np.ndarray:
    """uint8 `[size, size, 3]`: `im` resized (bicubic) and centre-cropped for evaluation."""
    crop = centre_crop(im.size, size)
    resized = im.resize((crop.width, crop.height), Image.Resampling.BICUBIC)
    box = (crop.left, crop.top, crop.left + size, crop.top + size)
    return np.asarray(resized.crop(box), dtype=np.uint8)


def resize_whole(im: Image.Image, size: int) -> np.ndarray:
    """uint8 `[size, size, 3]`: the whole image resized (bicubic, no crop), for drawings over the whole image."""
    return np.asarray(im.resize((size, size), Image.Resampling.BICUBIC), dtype=np.uint8)


def describe(size: int) -> dict[str, object]:
    """The preprocessing as the report records it."""
    return {
        "resize_shorter_side": resize_size(size),
        "centre_crop": size,
        "crop_fraction": CROP_FRACTION,
        "interpolation": INTERPOLATION,
    }
