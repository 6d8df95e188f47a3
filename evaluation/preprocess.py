"""Where an evaluation image's pixels come from: the field's resize and centre crop, or the whole image resized.

`crop`: resize the shorter side to size / 0.875 (bicubic), then centre-crop, as DINO, I-JEPA and timm's
evaluation transforms do (224 px from 256, `crop_pct` 0.875): the convention for photographs. `whole`: the whole
image resized to size × size, so that each patch sees the cell of the image it is labelled with. For scenes
already at the model's size (or whose label cells the patch grid divides) the crop would shift and scale every
patch against its cell and a dense probe would measure its tolerance to that, not what the features hold.

`choose_geometry` decides between them for `--eval-resize auto`. The geometry is computed here once, so the pixels
and the per-patch labels of the dense probe agree on which part of the image each patch sees. Torch-free: labels
import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from evaluation.protocol import CROP_FRACTION

INTERPOLATION = "bicubic"
GEOMETRIES = ("crop", "whole")
EVAL_RESIZE = ("auto", *GEOMETRIES)


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


def placement(original: tuple[int, int], size: int, geometry: str) -> CentreCrop:
    """Where an image of `original` (width, height) lands under `geometry`: `centre_crop`, or (whole) the whole
    image resized to `size` × `size`."""
    return centre_crop(original, size) if geometry == "crop" else CentreCrop(size, size, 0, 0, size)


def prepare(im: Image.Image, size: int, geometry: str) -> np.ndarray:
    """uint8 `[size, size, 3]`: `im` resized and centre-cropped (crop) or resized whole (whole)."""
    return resize_and_crop(im, size) if geometry == "crop" else resize_whole(im, size)


def choose_geometry(
    sizes: list[tuple[int, int]], image_size: int, patch_size: int, cell_sizes: list[int] | None = None
) -> tuple[str, str]:
    """(geometry, why) for `--eval-resize auto`: `whole` when every image is square and either already at the
    model's size or cut by its labels into cells that whole patches tile once resized; `crop` otherwise (the
    convention for photographs). `cell_sizes`: each image's label cell side in its own pixels (0: none)."""
    readable = [(w, h, c) for (w, h), c in zip(sizes, cell_sizes or [0] * len(sizes)) if w > 0]
    if not readable:
        return "crop", "no readable image: the photographs' convention"
    if any(w != h for w, h, _ in readable):
        return "crop", "not every image is square: resize and centre crop, the photographs' convention"
    if all(w == image_size for w, _, _ in readable):
        return "whole", f"every image is square and {image_size} px, the model's size: no resize, no crop"

    def tiled(side: int, cell: int) -> bool:
        resized = cell * image_size / side
        return cell > 0 and side % cell == 0 and abs(resized / patch_size - round(resized / patch_size)) < 1e-9

    if all(tiled(w, c) for w, _, c in readable):
        return "whole", "every image is square and whole patches tile its label cells once resized to the model's size"
    return "crop", "square images whose label cells the patch grid does not divide: resize and centre crop"


def resize_and_crop(im: Image.Image, size: int) -> np.ndarray:
    """uint8 `[size, size, 3]`: `im` resized (bicubic) and centre-cropped for evaluation."""
    crop = centre_crop(im.size, size)
    resized = im.resize((crop.width, crop.height), Image.Resampling.BICUBIC)
    box = (crop.left, crop.top, crop.left + size, crop.top + size)
    return np.asarray(resized.crop(box), dtype=np.uint8)


def resize_whole(im: Image.Image, size: int) -> np.ndarray:
    """uint8 `[size, size, 3]`: the whole image resized (bicubic, no crop), for drawings over the whole image."""
    return np.asarray(im.resize((size, size), Image.Resampling.BICUBIC), dtype=np.uint8)


def describe(size: int, geometry: str = "crop") -> dict[str, object]:
    """The preprocessing as the report records it."""
    if geometry == "whole":
        return {"geometry": "whole", "resize": [size, size], "interpolation": INTERPOLATION}
    return {
        "geometry": "crop",
        "resize_shorter_side": resize_size(size),
        "centre_crop": size,
        "crop_fraction": CROP_FRACTION,
        "interpolation": INTERPOLATION,
    }
