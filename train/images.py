"""A training sample's pixels: its crop decoded and resized on the CPU, or its JPEG bytes decoded on the device.

CPU: a JPEG whose crop is at least twice the output side is decoded at 1/2, 1/4 or 1/8 scale (draft mode: libjpeg
scales the DCT and skips most of the work), never below the output side; the crop is then resized with antialiased
bilinear (the default of torchvision's `RandomResizedCrop`), through the torch call torchvision makes for uint8 on the
CPU. torchvision itself is imported only for device decoding (its import costs ~0.4 s of CPU, and imports torch's
compiler in a process that would not otherwise).

Device (`--decode gpu`): the worker only reads the header, draws the crop and sends the bytes; `decode_on_device`
decodes the batch's JPEGs in one batched `torchvision.io.decode_jpeg` call (nvJPEG) and crops and resizes there, each
crop in its own call (`device_resize: per_image`) or all at once by batched matrix products (`batched`).
Images nvJPEG is not given (not JPEG, CMYK, with an EXIF rotation, which torchvision applies only on the CPU, or not
ending at a JPEG's end-of-image marker: cut short, or with data appended) are decoded on the CPU as above.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch.nn.functional import interpolate

from pipeline.core.images import exif_orientation, load_rgb, open_image

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]  # left, top, right, bottom, in pixels of the upright image


def draft_reduction(box: Box, size: int) -> int:
    """How many times smaller the image may be decoded with the crop still at least `size` pixels on each side."""
    left, top, right, bottom = box
    return max(min(right - left, bottom - top) // size, 1)


def crop_resize(im: Image.Image, upright: tuple[int, int], box: Box, size: int, flip: bool) -> torch.Tensor | None:
    """uint8 `[3, size, size]`: `box` of the opened image `im` (header read, pixels not yet), resized with antialiased
    bilinear and mirrored when `flip`; None when the pixels turn out corrupt. `upright` is its size once its EXIF
    orientation is applied, the frame `box` is in."""
    decoded, _ = load_rgb(im, draft_reduction(box, size))
    if decoded is None:
        return None
    fx, fy = decoded.width / upright[0], decoded.height / upright[1]
    left, top, right, bottom = box
    scaled = (round(left * fx), round(top * fy), max(round(right * fx), round(left * fx) + 1))
    crop = (scaled[0], scaled[1], scaled[2], max(round(bottom * fy), scaled[1] + 1))
    pixels = torch.from_numpy(np.array(decoded.crop(crop), dtype=np.uint8)).permute(2, 0, 1)
    out = interpolate(pixels[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    return out.flip(-1) if flip else out


def device_decodable(im: Image.Image, data: bytes) -> bool:
    """Whether nvJPEG gets this opened image (`data`, its file): an RGB or greyscale JPEG with no EXIF rotation that
    ends as a whole one does, with its end-of-image marker (then at most zero padding). A file cut short, the common
    damage (an interrupted copy), goes to the CPU decoder, which refuses it, so the loader replaces the image: a
    device decoder need not report such a file, and the row would train on what it made of it. A whole file with data
    appended (some cameras' trailers) is decoded on the CPU too."""
    if not (im.format == "JPEG" and im.mode in ("RGB", "L") and exif_orientation(im) == 1):
        return False
    end = b"\xff\xd9"
    return data.endswith(end) or data.rstrip(b"\0").endswith(end)  # rstrip copies the file: only when padded


@dataclass
class EncodedImages:
    """Rows of a batch whose pixels are decoded on the device: their JPEG bytes, crop boxes and flips, and how their
    crops are to be resized there (`device_resize`: per_image or batched)."""

    rows: list[int]
    data: list[torch.Tensor]  # uint8 [bytes] each
    boxes: list[Box]
    flips: list[bool]
    resize: str = "per_image"

    def packed(self) -> EncodedImages:
        """The same images with their bytes back to back in one tensor (the items are views of it): a batch handed to
        the main process then passes one shared-memory block for them, not one per image."""
        blob = torch.cat(self.data)
        return EncodedImages(
            self.rows, list(blob.split([len(d) for d in self.data])), self.boxes, self.flips, self.resize
        )

    def select(self, start: int, stop: int) -> EncodedImages | None:
        """The rows in `start:stop`, renumbered from `start`; None when there are none."""
        keep = [k for k, row in enumerate(self.rows) if start <= row < stop]
        if not keep:
            return None
        return EncodedImages(
            [self.rows[k] - start for k in keep],
            [self.data[k] for k in keep],
            [self.boxes[k] for k in keep],
            [self.flips[k] for k in keep],
            self.resize,
        )


_warned = False


def decode_on_device(images: torch.Tensor, encoded: EncodedImages) -> list[int]:
    """Fill `images` (uint8 `[b, 3, H, W]` on the device) at `encoded.rows`: one batched decode, then each crop
    resized there. Should the batched decode fail (a JPEG variant nvJPEG lacks, or a sound header over a corrupt
    body), each image is decoded alone, on the device or else on the CPU as the loader decodes, with one line on
    stderr per process. Returns the rows no decoder could read: their pixels are another row's, and the caller drops
    their captions (the loader replaces such an image by the next usable one; here its row stays, as a duplicate
    without text)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    global _warned
    if images.is_cuda:
        # torchvision allocates the outputs on this (the copies') stream and decodes on a stream of its own that does
        # not wait for this one: a block this stream freed while its queued work still reads it must not be written
        # under it. This stream holds only the batch's copies, so waiting for it costs their transfer time.
        torch.cuda.current_stream(images.device).synchronize()
    try:
        decoded: list[torch.Tensor | None] = list(
            decode_jpeg(encoded.data, mode=ImageReadMode.RGB, device=images.device)
        )
    except RuntimeError as exc:
        if not _warned:
            logger.warning(
                f"--decode gpu: the device decoder failed on a batch ({str(exc).splitlines()[0][:80]}); decoding its"
                " images one by one, on the CPU where the device refuses one"
            )
            _warned = True
        decoded = [decode_one(data, images.device) for data in encoded.data]
    unread = [row for row, pixels in zip(encoded.rows, decoded) if pixels is None]
    readable = [
        (row, pixels, box, flip)
        for row, pixels, box, flip in zip(encoded.rows, decoded, encoded.boxes, encoded.flips)
        if pixels is not None
    ]
    resize_crops(images, readable, encoded.resize)
    if unread:
        donor = next((r for r in range(len(images)) if r not in unread), None)
        if donor is not None:
            images[unread] = images[donor].clone()
    return unread


def decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """One JPEG's pixels (uint8 `[3, h, w]` on `device`): nvJPEG, or else the CPU loader's decoder; None when
    neither can read it."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # nvJPEG refuses this one: the loader's own decoder reads it, or nothing can
        im, _ = open_image(data.numpy().tobytes())
        decoded = None if im is None else load_rgb(im)[0]
        return (
            None if decoded is None else torch.from_numpy(np.array(decoded, dtype=np.uint8)).permute(2, 0, 1).to(device)
        )


def resize_crops(images: torch.Tensor, crops: list[tuple[int, torch.Tensor, Box, bool]], resize: str) -> None:
    """Write each decoded image's crop (batch row, pixels, box, flip) into `images` at its row, resized to the
    batch's size image by image (`resize` per_image) or all at once (batched: `crop_resize_into`)."""
    if resize == "batched":
        crop_resize_into(
            images, [c[0] for c in crops], [c[1] for c in crops], [c[2] for c in crops], [c[3] for c in crops]
        )
    else:
        for row, pixels, box, flip in crops:
            images[row] = crop_resize_on_device(pixels, box, (images.shape[-2], images.shape[-1]), flip)


# Bytes a group of crops may take on the device in one batched resize (`crop_resize_into`), counted per crop as
# 12·(h·w + h·W + max(h·W, H·W)) for a crop of h × w to H × W (float32: the padded crops, the width pass, then its
# reordered copy or the result); a batch of larger crops is resized in several groups. At 224 pixels, 128 crops of up
# to 500 × 375 count ~550 MB: three groups.
BATCHED_RESIZE_BYTES = 2**28


def crop_resize_into(
    out: torch.Tensor, rows: list[int], pixels: list[torch.Tensor], boxes: list[Box], flips: list[bool]
) -> None:
    """Write into `out` (uint8 `[b, 3, H, W]`) at `rows` each decoded image's crop `box`, resized and flipped as
    `crop_resize_on_device` does it, for many crops at once: the crops, sorted by size and grouped under
    BATCHED_RESIZE_BYTES, padded into one float32 tensor, then each axis resized by one batched matrix product with
    the antialiased bilinear weights (`antialiased_bilinear_weights`; a flip is the column weights reversed). One copy
    an image and a few kernels a group, against a few kernels an image; the crops' sizes, flips and rows travel in one
    pinned copy, so nothing waits for the device. The sums run in another order (and in TF32 where float32 matmuls
    take it), so a pixel may differ by a level of uint8."""
    if not pixels:
        return
    height, width = out.shape[-2:]
    sides = [(bottom - top, right - left) for left, top, right, bottom in boxes]
    order = sorted(range(len(pixels)), key=lambda k: sides[k])  # like shapes together pad less
    facts = to_device_async(torch.tensor([[*sides[k], flips[k], rows[k]] for k in order]), out.device)
    by_size = torch.empty((len(pixels), 3, height, width), dtype=torch.uint8, device=out.device)

    def cost(h: int, w: int) -> int:
        return 12 * (h * w + h * width + max(h, height) * width)

    start = 0
    while start < len(order):
        end, tallest, widest = start + 1, *sides[order[start]]
        while end < len(order):
            taller, wider = max(tallest, sides[order[end]][0]), max(widest, sides[order[end]][1])
            if (end + 1 - start) * cost(taller, wider) > BATCHED_RESIZE_BYTES:
                break
            end, tallest, widest = end + 1, taller, wider
        group = order[start:end]
        by_size[start:end] = _resize_group(
            [pixels[k] for k in group], [boxes[k] for k in group], facts[start:end], (height, width), (tallest, widest)
        )
        start = end
    out.index_copy_(0, facts[:, 3], by_size)


def _resize_group(
    pixels: list[torch.Tensor],
    boxes: list[Box],
    facts: torch.Tensor,
    size: tuple[int, int],
    longest: tuple[int, int],
) -> torch.Tensor:
    """uint8 `[g, 3, H, W]`: a group's crops resized; `facts` int64 `[g, 4]` on the device: each crop's height, width
    and flip (and its row, unused here); `longest`: the group's greatest height and width."""
    g, (height, width), (tallest, widest) = len(pixels), size, longest
    padded = torch.zeros((g, 3, tallest, widest), dtype=torch.float32, device=facts.device)
    for row, (image, (left, top, right, bottom)) in enumerate(zip(pixels, boxes)):
        padded[row, :, : bottom - top, : right - left] = image[:, top:bottom, left:right]
    cols = antialiased_bilinear_weights(facts[:, 1], width, widest)  # [g, W, widest]
    cols = torch.where(facts[:, 2, None, None].bool(), cols.flip(1), cols)
    narrow = padded.view(g, 3 * tallest, widest).bmm(cols.transpose(1, 2))  # [g, 3·tallest, W]
    del padded, cols
    narrow = narrow.view(g, 3, tallest, width).transpose(1, 2).reshape(g, tallest, 3 * width)
    rows = antialiased_bilinear_weights(facts[:, 0], height, tallest)  # [g, H, tallest]
    resized = rows.bmm(narrow).view(g, height, 3, width).transpose(1, 2)  # [g, 3, H, W]
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def antialiased_bilinear_weights(lengths: torch.Tensor, size: int, longest: int) -> torch.Tensor:
    """float32 `[n, size, longest]`: row i of entry k weighs input pixels `0..lengths[k]` (zero past them) into output
    pixel i, as torch's antialiased bilinear resize from `lengths[k]` to `size` pixels weighs them (align_corners
    False): a triangle of half-width the scale (1 when enlarging) around the output pixel's centre in input
    coordinates, normalised to sum to 1. `tests/test_images_pipeline.py` holds it to torch's own resize."""
    scale = (lengths.float() / size)[:, None, None]  # input pixels per output pixel
    centre = (torch.arange(size, device=lengths.device, dtype=torch.float32)[None, :, None] + 0.5) * scale
    support = scale.clamp_min(1.0)
    position = torch.arange(longest, device=lengths.device, dtype=torch.float32)[None, None, :]
    weights = (1 - ((position + 0.5 - centre) / support).abs()).clamp_min_(0)
    weights *= position < lengths[:, None, None]
    return weights / weights.sum(-1, keepdim=True)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device` without waiting: through pinned memory on CUDA (a copy from pageable
    memory would wait for the device)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def crop_resize_on_device(pixels: torch.Tensor, box: Box, size: tuple[int, int], flip: bool) -> torch.Tensor:
    """One decoded image's crop `box`, resized to `size` with antialiasing (the CPU path's filter) and flipped: a few
    kernels per image (benchmarks/gpu_check.py's `device_decode` counts them and times the batch's)."""
    from torchvision.transforms.v2.functional import resize

    left, top, right, bottom = box
    out = resize(pixels[:, top:bottom, left:right], list(size), antialias=True)
    return out.flip(-1) if flip else out
