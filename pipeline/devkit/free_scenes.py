"""Free scenes: overlapping shapes anywhere on textured backgrounds, so that neither position nor a patch's own
pixels answer what a patch belongs to.

On the grid scenes (`pipeline.devkit.synth`, layout `grid`) every object sits in its own cell on one grey
background: position alone predicts ~71% of a random-init target encoder's features at patch 8, and a patch's own
pixels tell its cell's shape (0.85 patch accuracy). A JEPA can then lower its loss from position and pixels, and a
probe measures the pixels, not what the encoder learned from context. Here:

- the background is one of several dull colours under one of several strong textures (noise, a gradient,
  stripes, checks) at a random angle, period and phase, so position cannot predict it;
- 4 to 8 objects per scene, each centred anywhere, 18 to 36 px across on 64 px (about 2 to 5 patches of 8 px),
  drawn in order so later ones hide parts of earlier ones: a patch mostly shows a fragment (an edge, a corner, a
  stripe) whose shape only the surroundings tell.

Labels (`labels.jsonl`, as the grid scenes write them): per `cell_size` cell (image_size / 8 by default), the class
(colour × shape) and the shape of the object on top at the cell's centre, 0 for background; the image label is the
shape of the largest object (what a pooled feature must infer from its parts); `tags` are the (colour, shape) pairs
present. Captions name objects by colour, shape, size and texture, where they are on a 3 × 3 layout of regions,
and which is in front when two overlap (`full`: every object; `partial`: one to three, some loosely).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.devkit.synth import (
    CAPTIONS_PER_IMAGE,
    COLOURS,
    SHAPES,
    TEXTURES,
    article,
    class_names,
    join_phrases,
    shape_mask,
    texture_mask,
)

BACKGROUNDS = {
    "slate": (70, 80, 90),
    "olive": (95, 95, 60),
    "brown": (100, 75, 60),
    "teal": (50, 90, 90),
    "grey": (85, 85, 85),
    "plum": (90, 65, 90),
}
BACKGROUND_TEXTURES = ("noise", "gradient", "stripes", "checks")
OBJECTS = (4, 8)  # fewest and most objects per scene
SIDE = (18 / 64, 36 / 64)  # an object's side as a fraction of the image's
LABEL_GRID = 8  # label cells per side
REGIONS = ("top", "middle", "bottom"), ("left", "centre", "right")


@dataclass(frozen=True)
class FreeObj:
    cy: float  # centre, as a fraction of the image
    cx: float
    side: float  # as a fraction of the image
    shape: str
    colour: str
    texture: str
    depth: int  # drawing order: a higher depth hides a lower one

    @property
    def size(self) -> str:
        return "large" if self.side >= sum(SIDE) / 2 else "small"

    @property
    def region(self) -> str:
        row, col = (min(int(v * 3), 2) for v in (self.cy, self.cx))
        return "centre" if (row, col) == (1, 1) else f"{REGIONS[0][row]} {REGIONS[1][col]}".replace("middle ", "")


def draw_free_scene(rng: np.random.Generator) -> tuple[list[FreeObj], dict[str, object]]:
    """The objects (in drawing order) and the background's colour, texture, period and phase."""
    n = int(rng.integers(OBJECTS[0], OBJECTS[1] + 1))
    objs = [
        FreeObj(
            float(rng.uniform(0.1, 0.9)),
            float(rng.uniform(0.1, 0.9)),
            float(rng.uniform(*SIDE)),
            SHAPES[rng.integers(len(SHAPES))],
            list(COLOURS)[rng.integers(len(COLOURS))],
            TEXTURES[rng.integers(len(TEXTURES))],
            depth,
        )
        for depth in range(n)
    ]
    background = {
        "colour": list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))],
        "texture": BACKGROUND_TEXTURES[rng.integers(len(BACKGROUND_TEXTURES))],
        "period": float(rng.uniform(4, 16)),
        "phase": float(rng.uniform(0, 1)),
        "angle": float(rng.uniform(0, 2 * np.pi)),  # of stripes and gradients: no direction is the usual one
    }
    return objs, background


def _background(spec: dict[str, object], size: int, rng: np.random.Generator) -> np.ndarray:
    base = np.array(BACKGROUNDS[str(spec["colour"])], dtype=np.float32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    period, phase, angle = (float(spec[k]) for k in ("period", "phase", "angle"))  # type: ignore[arg-type]
    along = np.cos(angle) * xx + np.sin(angle) * yy  # pixels along the texture's direction
    texture = spec["texture"]
    if texture == "gradient":
        shade = (along - along.min()) / max(float(np.ptp(along)), 1.0) * 1.6 - 0.8 + (phase - 0.5)
    elif texture == "stripes":
        shade = 0.8 * np.sign(np.sin(2 * np.pi * (along / period + phase)))
    elif texture == "checks":
        across = -np.sin(angle) * xx + np.cos(angle) * yy
        shade = 0.8 * np.sign(np.sin(2 * np.pi * (along / period + phase)) * np.sin(2 * np.pi * (across / period)))
    else:
        shade = rng.normal(0, 0.6, size=(size, size))
    img = base * (1 + 0.5 * shade[..., None])
    return img + rng.normal(0, 4, size=img.shape)


def _object_box(o: FreeObj, size: int) -> tuple[int, int, int]:
    """(top, left, side) in pixels."""
    side = max(int(round(o.side * size)), 4)
    return int(round(o.cy * size - side / 2)), int(round(o.cx * size - side / 2)), side


def render_free(objs: list[FreeObj], background: dict[str, object], size: int, rng: np.random.Generator) -> np.ndarray:
    img = _background(background, size, rng)
    for o in objs:
        top, left, side = _object_box(o, size)
        mask = shape_mask(o.shape, side, 0.95)
        colour = np.array(COLOURS[o.colour], dtype=np.float32)
        shade = np.where(texture_mask(o.texture, side)[..., None], colour, colour * 0.45)
        y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + side, size), min(left + side, size)
        if y0 >= y1 or x0 >= x1:
            continue
        part = mask[y0 - top : y1 - top, x0 - left : x1 - left]
        block = img[y0:y1, x0:x1]
        block[part] = shade[y0 - top : y1 - top, x0 - left : x1 - left][part]
    return np.clip(img, 0, 255).astype(np.uint8)


def _on_top(objs: list[FreeObj], size: int) -> np.ndarray:
    """int `[size, size]`: the index of the object drawn on top at each pixel, -1 for background."""
    top_of = np.full((size, size), -1, dtype=np.int64)
    for k, o in enumerate(objs):
        top, left, side = _object_box(o, size)
        mask = shape_mask(o.shape, side, 0.95)
        y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + side, size), min(left + side, size)
        if y0 < y1 and x0 < x1:
            region = top_of[y0:y1, x0:x1]
            region[mask[y0 - top : y1 - top, x0 - left : x1 - left]] = k
    return top_of


def free_label_line(name: str, objs: list[FreeObj], size: int) -> dict:
    """One labels.jsonl line: per label cell the class and shape on top at the cell's centre, the largest object's
    shape, and the (colour, shape) pairs present."""
    cell = size // LABEL_GRID
    top_of = _on_top(objs, size)
    centres = top_of[cell // 2 :: cell, cell // 2 :: cell][:LABEL_GRID, :LABEL_GRID]
    classes = [0] + [1 + list(COLOURS).index(o.colour) * len(SHAPES) + SHAPES.index(o.shape) for o in objs]
    shapes = [0] + [1 + SHAPES.index(o.shape) for o in objs]
    visible = {k: int((top_of == k).sum()) for k in range(len(objs))}
    largest = max(range(len(objs)), key=lambda k: (visible[k], -k))
    present = {classes[k + 1] for k in range(len(objs)) if visible[k] > 0}
    return {
        "image": name,
        "label": objs[largest].shape,
        "cells": [[classes[k + 1] for k in row] for row in centres.tolist()],
        "cell_size": cell,
        "cell_maps": {"shape": [[shapes[k + 1] for k in row] for row in centres.tolist()]},
        "tags": [name for k, name in enumerate(class_names()) if k in present],
    }


def _describe(o: FreeObj, detail: int) -> str:
    words = [o.colour, o.shape] if detail == 0 else [o.size, o.colour, o.shape]
    return " ".join([o.size, o.texture, o.colour, o.shape] if detail == 2 else words)


def _overlaps(a: FreeObj, b: FreeObj) -> bool:
    return abs(a.cy - b.cy) < (a.side + b.side) / 2 and abs(a.cx - b.cx) < (a.side + b.side) / 2


def free_captions(objs: list[FreeObj], background: dict[str, object], rng: np.random.Generator, mode: str) -> list[str]:
    """Eight captions: `full` names every object with its region (and which is in front of which where they
    overlap); `partial` one to three objects, some by shape or colour alone, some without a region."""
    out = []
    scene = f"a {background['texture']} {background['colour']} background"
    for k in range(CAPTIONS_PER_IMAGE):
        parts: list[tuple[str, object, bool, bool]] = []
        if mode == "full":
            order = rng.permutation(len(objs)) if k % 2 else np.arange(len(objs))
            for i in order:
                o = objs[i]
                phrase = f"{article(_describe(o, (k // 2) % 3))} at the {o.region}"
                above = [b for b in objs if b.depth < o.depth and _overlaps(o, b)]
                if above and k % 3 == 1:
                    phrase += f", in front of the {above[-1].colour} {above[-1].shape}"
                parts.append((phrase, o, True, True))
            lead = f"{len(objs)} shapes on {scene}: "
        else:
            chosen = rng.permutation(len(objs))[: int(rng.integers(1, min(3, len(objs)) + 1))]
            for i in chosen:
                o, what_kind = objs[i], int(rng.integers(4))
                what = (
                    f"a {o.shape}"
                    if what_kind == 0
                    else f"something {o.colour}"
                    if what_kind == 1
                    else article(_describe(o, int(rng.integers(3))))
                )
                placed = rng.random() < 0.5
                parts.append((f"{what} at the {o.region}" if placed else what, o, placed, what_kind >= 2))
            lead = f"Shapes on {scene}, among them "
        out.append(join_phrases(parts, k % 3, lead[0].upper() + lead[1:]).text)  # type: ignore[arg-type]
    return out
