"""Decode and normalise one image, or say in a few words why it cannot be used.

Every bad file becomes a reason string instead of an exception: zero-byte,
truncated or corrupt data, decompression bombs (PIL's limit,
about 89 M pixels), images too small to describe.
Usable images come out RGB (alpha composited on white, CMYK/palette/16-bit
converted, EXIF orientation applied) and no larger than a pixel budget, so the
engine never sees a 100-megapixel scan.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 1024 * 1024
MIN_SIDE = 4


@dataclass(frozen=True)
class ImagePolicy:
    """How images are normalised before captioning; part of the caption recipe."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    min_side: int = MIN_SIDE

    def recipe(self) -> dict[str, object]:
        return {
            "mode": "RGB",
            "alpha": "white",
            "exif_transpose": True,
            "max_pixels": self.max_pixels,
            "resample": "bicubic",
            "min_side": self.min_side,
        }


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB with any transparency composited on white."""
    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        im = im.point(lambda v: v / 256).convert("L")
    return im.convert("RGB")


def decode(data: bytes | None, policy: ImagePolicy) -> tuple[Image.Image | None, str | None]:
    """(RGB image within the pixel budget, None) or (None, reason)."""
    if not data:
        return None, "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im: Image.Image = Image.open(io.BytesIO(data))
            width, height = im.size
            if min(width, height) < policy.min_side:
                return None, f"too small ({width}x{height} pixels)"
            im = ImageOps.exif_transpose(im)
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, f"decompression bomb (over {Image.MAX_IMAGE_PIXELS:,} pixels)"
    except UnidentifiedImageError:
        return None, "not an image (unrecognised format)"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return None, f"corrupt or truncated image ({str(exc).splitlines()[0][:80]})"
    im = to_rgb(im)
    if im.width * im.height > policy.max_pixels:
        scale = math.sqrt(policy.max_pixels / (im.width * im.height))
        im = im.resize((max(int(im.width * scale), 1), max(int(im.height * scale), 1)), Image.Resampling.BICUBIC)
    return im, None
