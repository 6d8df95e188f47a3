"""Captions of synth's grid scenes in phrasings `tcjepa synth` never writes: the tiny T5 is taught synth's own, and
these measure how much of its binding carries over to captions it was not taught (`tiny_t5.probe_accuracy`).

An object's phrase is drawn from families of descriptions (some synth's, "a red circle", some not, "a circle whose
colour is red"), and of exact positions, word orders and caption frames that synth never uses ("on the far left, at
the very top: ...", "third from the top and first from the left", "Spotted: ...").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.devkit.synth import ORDINALS, Mention, Obj

VERTICAL = ("at the very top", "just above the middle", "just below the middle", "at the very bottom")
HORIZONTAL = ("on the far left", "left of centre", "right of centre", "on the far right")

# A description: (words, where the colour word starts in them or -1, whether colour and shape are both named).
Description = tuple[str, int, bool]
DESCRIPTIONS: tuple[Callable[[Obj], Description], ...] = (
    lambda o: (f"{o.colour} {o.shape}", 0, True),
    lambda o: (f"{o.shape} coloured {o.colour}", len(o.shape) + 10, True),
    lambda o: (f"{o.size} {o.colour} {o.shape}", len(o.size) + 1, True),
    lambda o: (f"{o.shape}", -1, False),
    lambda o: (f"{o.colour} {o.texture} {o.shape}", 0, True),
    lambda o: (f"{o.shape} whose colour is {o.colour}", len(o.shape) + 17, True),
)
# An exact position on a grid of at most 4 x 4 cells (the vertical and horizontal words name 4 each).
POSITIONS: tuple[Callable[[Obj], str], ...] = (
    lambda o: f"at row {o.row + 1}, col {o.col + 1}",
    lambda o: f"in the {ORDINALS[o.row]} row and {ORDINALS[o.col]} column",
    lambda o: f"{ORDINALS[o.row]} from the top and {ORDINALS[o.col]} from the left",
    lambda o: f"{VERTICAL[o.row]} and {HORIZONTAL[o.col]}",
    lambda o: f"at cell ({o.row + 1}, {o.col + 1})",
    lambda o: f"{HORIZONTAL[o.col]}, {VERTICAL[o.row]}",
)
# How a description (with its article) and a position make one phrase; the position may be left out.
ORDERS: tuple[Callable[[str, str], str], ...] = (
    lambda what, where: f"{what} {where}",
    lambda what, where: f"{where}, {what}",
    lambda what, where: f"{what}, {where}",
    lambda what, where: f"{where} there is {what}",
    lambda what, where: f"{where}: {what}",
)
FRAMES = ("The image shows {}.", "I see {}.", "{}.", "Spotted: {}.", "Somewhere here: {}.")
JOINERS = ("; ", ", ", " and ", ". ")
UNPLACED = 0.2  # share of mentions without a position


@dataclass(frozen=True)
class Phrased:
    """A caption, its mentions (as synth's: the whole object phrase, whether it names the cell and the class), and
    each mention's colour-word span (None where the phrase names no colour)."""

    text: str
    mentions: tuple[Mention, ...]
    colour_spans: tuple[tuple[int, int] | None, ...]


def phrased_caption(objs: list[Obj], rng: np.random.Generator, most: int = 4) -> Phrased:
    """A caption of 1 to `most` of `objs` (a grid scene of at most 4 x 4 cells), each part drawn from its families."""
    frame, joiner = FRAMES[int(rng.integers(len(FRAMES)))], JOINERS[int(rng.integers(len(JOINERS)))]
    chosen = rng.permutation(len(objs))[: int(rng.integers(1, min(most, len(objs)) + 1))]
    head, tail = frame.split("{}")
    text, mentions, colours = head, [], []
    for k, i in enumerate(chosen):
        o = objs[i]
        words, colour_at, class_named = DESCRIPTIONS[int(rng.integers(len(DESCRIPTIONS)))](o)
        what = ("an " if words[0] in "aeiou" else "a ") + words
        placed = bool(rng.random() >= UNPLACED)
        where = POSITIONS[int(rng.integers(len(POSITIONS)))](o)
        phrase = ORDERS[int(rng.integers(len(ORDERS)))](what, where) if placed else what
        at = phrase.index(what) + len(what) - len(words) + colour_at  # the colour word's start in the phrase
        if k:
            text += joiner
        if k == 0 and frame.startswith("{}") or joiner == ". ":
            phrase = phrase[0].upper() + phrase[1:]
        start = len(text)
        text += phrase
        mentions.append(Mention(o, start, len(text), placed, class_named))
        at += start
        colours.append((at, at + len(o.colour)) if colour_at >= 0 else None)
    return Phrased(text + tail, tuple(mentions), tuple(colours))
