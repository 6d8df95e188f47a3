"""Images in tests: PNGs of one colour, and a catalogue of bad images with the reason each must fail for."""

from __future__ import annotations

import io
from typing import Any

import numpy as np


def png(colour: Any, size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    """A PNG of one colour."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


def bad_image_catalogue() -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, expected failure reason prefix or None when it must decode)."""
    from PIL import Image

    rgb = png("green", (40, 30))
    jpeg = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(jpeg, format="JPEG")
    palette = io.BytesIO()
    Image.new("P", (20, 20), 3).save(palette, format="PNG", transparency=3)
    sixteen = io.BytesIO()
    Image.fromarray(np.full((20, 20), 40000, dtype=np.uint16)).save(sixteen, format="PNG")
    bomb = io.BytesIO()
    Image.new("1", (10_000, 9_000)).save(bomb, format="PNG")
    return {
        "ok.png": (rgb, None),
        "truncated.png": (rgb[: len(rgb) // 2], "corrupt or truncated"),
        "zero.png": (b"", "empty file"),
        "pixel.png": (png("red", (1, 1)), "too small"),
        "bomb.png": (bomb.getvalue(), "decompression bomb"),
        "cmyk.jpg": (jpeg.getvalue(), None),
        "palette_alpha.png": (palette.getvalue(), None),
        "rgba.png": (png((255, 0, 0, 0), (20, 20), "RGBA"), None),
        "la.png": (png((128, 255), (20, 20), "LA"), None),
        "sixteen_bit.png": (sixteen.getvalue(), None),
        "png_named.jpg": (png("blue", (40, 30)), None),
        "text.png": (b"hello, I am not an image", "not an image"),
        "huge_but_decodable.png": (png("white", (3000, 2000)), None),
    }
