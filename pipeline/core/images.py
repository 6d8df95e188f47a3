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

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

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


def open_image(data: bytes | None, min_side: int = MIN_SIDE) -> tuple[Image.Image | None, str | None]:
    """(image whose header is read but whose pixels are not yet decoded, None) or (None, reason).

    Only the header is parsed, so the caller can still ask a JPEG for a reduced decode (`load_rgb`)."""
    if not data:
        return None, "empty file"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im: Image.Image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, f"decompression bomb (over {Image.MAX_IMAGE_PIXELS:,} pixels)"
    except UnidentifiedImageError:
        return None, "not an image (unrecognised format)"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return None, _corrupt(exc)
    width, height = im.size
    if min(width, height) < min_side:
        return None, f"too small ({width}x{height} pixels)"
    return im, None


def exif_orientation(im: Image.Image) -> int:
    """The EXIF orientation tag of an opened image (1, upright, when absent or unreadable)."""
    try:
        return int(im.getexif().get(ExifTags.Base.Orientation, 1))
    except (OSError, SyntaxError, ValueError, EOFError, TypeError):
        return 1


def oriented_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened image once its EXIF orientation is applied, read from the header alone."""
    width, height = im.size
    return (height, width) if exif_orientation(im) in (5, 6, 7, 8) else (width, height)


def load_rgb(im: Image.Image, reduce: int = 1) -> tuple[Image.Image | None, str | None]:
    """Decode an opened image's pixels: RGB, EXIF orientation applied; (None, reason) for corrupt data.

    `reduce` > 1 lets a JPEG decode at 1/2, 1/4 or 1/8 scale (draft mode: libjpeg scales the DCT, skipping most of
    the work), the largest of these not above `reduce`; other formats decode whole.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if reduce > 1:
                width, height = im.size
                im.draft(None, (max(width // reduce, 1), max(height // reduce, 1)))
            im = ImageOps.exif_transpose(im)
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, f"decompression bomb (over {Image.MAX_IMAGE_PIXELS:,} pixels)"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return None, _corrupt(exc)
    return to_rgb(im), None


def _corrupt(exc: BaseException) -> str:
    return f"corrupt or truncated image ({str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__})"


def decode(data: bytes | None, policy: ImagePolicy) -> tuple[Image.Image | None, str | None]:
    """(RGB image within the pixel budget, None) or (None, reason)."""
    im, reason = open_image(data, policy.min_side)
    if im is None:
        return None, reason
    im, reason = load_rgb(im)
    if im is None:
        return None, reason
    if im.width * im.height > policy.max_pixels:
        scale = math.sqrt(policy.max_pixels / (im.width * im.height))
        im = im.resize((max(int(im.width * scale), 1), max(int(im.height * scale), 1)), Image.Resampling.BICUBIC)
    return im, None
