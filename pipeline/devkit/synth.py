"""Procedural scenes whose captions say what the masked context cannot.

Each image is a G×G grid of cells; each cell is empty or holds one shape whose
colour, size and texture are drawn independently. Every image gets 8 captions
in varied phrasing. ``full`` captions name every object and its cell, so a
predictor that reads them can tell what sits in a hidden cell, and one that does
not cannot; ``partial`` ones name a few objects, some loosely, as real captions do.

A labels line (`label_line`) holds the image label (the most common colour), the
per-cell class map ``cells`` (colour × shape) with ``cell_size`` in pixels, a second
per-cell map ``cell_maps.shape`` (the shape alone), and ``tags``: the (colour, shape)
pairs the scene holds, for the multi-label probe. `pipeline.devkit.dataset` writes
the scenes to disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import UserError

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 20),
    "cyan": (40, 210, 220),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
SIZES = ("small", "large")
TEXTURES = ("solid", "striped", "dotted")
CAPTIONS_PER_IMAGE = 8
EMPTY_PROB = 0.45
BACKGROUND = (70, 70, 70)
ROW_WORDS = ("top", "upper middle", "lower middle", "bottom")
COL_WORDS = ("left", "centre-left", "centre-right", "right")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


@dataclass(frozen=True)
class Obj:
    row: int
    col: int
    shape: str
    colour: str
    size: str
    texture: str


def cell_class(obj: Obj | None) -> int:
    """Per-cell class: 0 empty, else 1 + colour * len(SHAPES) + shape."""
    if obj is None:
        return 0
    return 1 + list(COLOURS).index(obj.colour) * len(SHAPES) + SHAPES.index(obj.shape)


def class_names() -> list[str]:
    return ["empty"] + [f"{c} {s}" for c in COLOURS for s in SHAPES]


def shape_class(obj: Obj | None) -> int:
    """Per-cell shape class: 0 empty, else 1 + shape (the colour left out)."""
    return 0 if obj is None else 1 + SHAPES.index(obj.shape)


def shape_names() -> list[str]:
    return ["empty", *SHAPES]


def tags(objs: list[Obj]) -> list[str]:
    """The scene's (colour, shape) pairs, each once, in class order: the multi-label probe's labels."""
    present = {cell_class(o) for o in objs}
    return [name for k, name in enumerate(class_names()) if k in present]


def label_line(name: str, objs: list[Obj], grid: int, cell: int) -> dict:
    """One labels.jsonl line: image label, per-cell class and shape maps, the pairs present."""
    cells = [[0] * grid for _ in range(grid)]
    shapes = [[0] * grid for _ in range(grid)]
    for o in objs:
        cells[o.row][o.col] = cell_class(o)
        shapes[o.row][o.col] = shape_class(o)
    return {
        "image": name,
        "label": image_label(objs),
        "cells": cells,
        "cell_size": cell,
        "cell_maps": {"shape": shapes},
        "tags": tags(objs),
    }


def draw_scene(rng: np.random.Generator, grid: int) -> list[Obj]:
    objs = []
    for r in range(grid):
        for c in range(grid):
            if rng.random() < EMPTY_PROB:
                continue
            objs.append(
                Obj(
                    r,
                    c,
                    SHAPES[rng.integers(len(SHAPES))],
                    list(COLOURS)[rng.integers(len(COLOURS))],
                    SIZES[rng.integers(len(SIZES))],
                    TEXTURES[rng.integers(len(TEXTURES))],
                )
            )
    return objs


def shape_mask(shape: str, n: int, frac: float) -> np.ndarray:
    """Boolean n×n mask of `shape` filling `frac` of the cell, centred."""
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) + 0.5
    cy = cx = n / 2
    half = frac * n / 2
    dy, dx = np.abs(yy - cy), np.abs(xx - cx)
    if shape == "circle":
        return dy**2 + dx**2 <= half**2
    if shape == "square":
        return (dy <= half * 0.85) & (dx <= half * 0.85)
    if shape == "diamond":
        return dy + dx <= half
    if shape == "triangle":
        top = cy - half
        return (yy >= top) & (yy <= cy + half) & (dx <= (yy - top) / 2)
    if shape == "cross":
        arm = max(half * 0.35, 0.75)
        return ((dy <= arm) & (dx <= half)) | ((dx <= arm) & (dy <= half))
    raise ValueError(shape)


def texture_mask(texture: str, n: int) -> np.ndarray:
    yy, xx = np.mgrid[0:n, 0:n]
    if texture == "striped":
        return ((yy + xx) // max(n // 8, 1)) % 2 == 0
    if texture == "dotted":
        step = max(n // 4, 2)
        return (yy % step < step // 2) & (xx % step < step // 2)
    return np.ones((n, n), dtype=bool)


def render(objs: list[Obj], grid: int, size: int, rng: np.random.Generator) -> np.ndarray:
    cell = size // grid
    img = np.empty((size, size, 3), dtype=np.float32)
    img[:] = BACKGROUND
    img += rng.normal(0, 6, size=img.shape)
    for o in objs:
        mask = shape_mask(o.shape, cell, 0.9 if o.size == "large" else 0.55)
        colour = np.array(COLOURS[o.colour], dtype=np.float32)
        shade = np.where(texture_mask(o.texture, cell)[..., None], colour, colour * 0.45)
        block = img[o.row * cell : (o.row + 1) * cell, o.col * cell : (o.col + 1) * cell]
        block[mask] = shade[mask]
    return np.clip(img, 0, 255).astype(np.uint8)


def where_phrase(o: Obj, style: int, grid: int) -> str:
    """An exact position: the phrase names the object's cell."""
    if style == 0:
        return f"in row {o.row + 1}, column {o.col + 1}"
    if style == 1 and grid == 4:
        return f"at the {ROW_WORDS[o.row]} {COL_WORDS[o.col]}"
    if style == 2:
        return f"in the {ORDINALS[o.col]} cell of the {ORDINALS[o.row]} row"
    return f"at position ({o.row + 1}, {o.col + 1})"


def loose_where_phrase(o: Obj, style: int, grid: int) -> str:
    """A loose position, as real captions give one: a half, a row or a column, never the cell."""
    half = grid // 2
    if style == 0:
        return "near the top" if o.row < half else "near the bottom"
    if style == 1:
        return "on the left" if o.col < half else "on the right"
    if style == 2:
        return f"somewhere in the {ORDINALS[o.row]} row"
    return f"somewhere in the {ORDINALS[o.col]} column"


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def describe(o: Obj, detail: int) -> str:
    if detail == 0:
        return f"{o.colour} {o.shape}"
    if detail == 1:
        return f"{o.size} {o.colour} {o.shape}"
    return f"{o.size} {o.texture} {o.colour} {o.shape}"


@dataclass(frozen=True)
class Mention:
    """Where a caption speaks of an object, and what it says: enough to tell what the text determines."""

    obj: Obj
    start: int  # character span of the whole phrase ("a red circle in row 1, column 2")
    end: int
    cell_named: bool  # the position phrase names the object's cell
    class_named: bool  # both its colour and its shape are named


@dataclass(frozen=True)
class Caption:
    text: str
    mentions: tuple[Mention, ...]


EMPTY_CAPTIONS = (
    "An empty grey grid with no shapes.",
    "Nothing is drawn on the grey background.",
    "A blank scene.",
    "The grid is empty.",
    "No objects at all, only grey.",
    "An empty picture with a grey background.",
    "There are no shapes in any cell.",
    "All cells are empty.",
)
CAPTION_MODES = ("full", "partial")


def join_phrases(parts: list[tuple[str, Obj, bool, bool]], template: int, lead: str) -> Caption:
    """One caption from its object phrases (phrase, object, whether its position is named, whether its class is),
    with each phrase's span; `template` picks the joining, `lead` the opening words of template 1."""
    pieces: list[str] = []
    mentions = []
    if template == 0:
        text, sep, end = "There is ", "; ", "."
    elif template == 1:
        text, sep, end = lead, ", ", "."
    else:
        text, sep, end = "", " ", ""
    for k, (phrase, obj, cell_named, class_named) in enumerate(parts):
        if template == 2:
            phrase = phrase[0].upper() + phrase[1:] + "."
        if k:
            text += sep
        start = len(text)
        text += phrase
        mentions.append(Mention(obj, start, start + len(phrase.rstrip(".")), cell_named, class_named))
        pieces.append(phrase)
    return Caption(text + end, tuple(mentions))


def scene_captions(objs: list[Obj], grid: int, rng: np.random.Generator, mode: str = "full") -> list[Caption]:
    """Eight captions of a scene with the spans of the objects they mention.

    ``full``: each caption names every object and its cell. ``partial``: each names a random 1–3 of the objects,
    some by shape or colour alone and some at a loose position ("near the top"), as real captions do: the text
    then says some things, loosely, and the pixels the rest.
    """
    if mode not in CAPTION_MODES:
        raise UserError(f"--captions {mode!r}: choose {' or '.join(CAPTION_MODES)}")
    if not objs:
        return [Caption(text, ()) for text in EMPTY_CAPTIONS]
    out = []
    for k in range(CAPTIONS_PER_IMAGE):
        if mode == "full":
            order = rng.permutation(len(objs)) if k % 2 else np.arange(len(objs))
            style, detail = k % 4, (k // 2) % 3
            parts = [
                (f"{article(describe(objs[i], detail))} {where_phrase(objs[i], style, grid)}", objs[i], True, True)
                for i in order
            ]
            out.append(join_phrases(parts, k % 3, f"A grid scene with {len(objs)} shapes: "))
            continue
        chosen = rng.permutation(len(objs))[: int(rng.integers(1, min(3, len(objs)) + 1))]
        parts = []
        for i in chosen:
            o, what_kind, loose = objs[i], int(rng.integers(4)), bool(rng.random() < 0.5)
            if what_kind == 0:
                what = f"a {o.shape}"
            elif what_kind == 1:
                what = f"something {o.colour}"
            else:
                what = article(describe(o, int(rng.integers(3))))
            style = int(rng.integers(4))
            where = loose_where_phrase(o, style, grid) if loose else where_phrase(o, style, grid)
            parts.append((f"{what} {where}", o, not loose, what_kind >= 2))
        out.append(join_phrases(parts, k % 3, "A grid scene with, among other things, "))
    return out


def captions_for(objs: list[Obj], grid: int, rng: np.random.Generator, mode: str = "full") -> list[str]:
    """The texts of `scene_captions`."""
    return [c.text for c in scene_captions(objs, grid, rng, mode)]


def image_label(objs: list[Obj]) -> str:
    """Image-level probe label: the most common colour (ties by palette order), or 'none'."""
    if not objs:
        return "none"
    counts = {c: 0 for c in COLOURS}
    for o in objs:
        counts[o.colour] += 1
    return max(counts, key=lambda c: (counts[c], -list(COLOURS).index(c)))
