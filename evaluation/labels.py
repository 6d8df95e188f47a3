"""Probe labels: JSONL lines `{"image": ..., "label": ...}`, optionally with a per-cell map.

`image` is a path relative to the labels file's folder (or `--image-root`), or a
source id as `tcjepa` lists it (a tar member `shard.tar/member.png`, a table row
`name::7`). `label` is any string or integer. For the dense probe a line may add
`"cells": [[...], ...]` (rows of integer classes, negative = unlabelled) and
`"cell_size"` (cell side in pixels of the original image), as `tcjepa synth` writes,
and `"split": "train" | "val" | "test"` to use a dataset's own split instead of a
random one (then every line must have it).

Per-patch labels follow the run's patch grid: each patch takes the class of the
cell under its centre, after the image is resized and centre-cropped as features
are extracted (evaluation/preprocess.py).

Class folders (`--train DIR/train --val DIR/val`, the ImageNet layout
`<split>/<class>/<image>`) give labels without a file: the class is the folder name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evaluation.preprocess import centre_crop
from pipeline.core.errors import UserError
from pipeline.core.sources import ImageRef, list_images


@dataclass
class Labels:
    image_index: np.ndarray  # int64 [m]: index into the image list of each labelled image
    classes: list[str]  # image-level class names; label ids index into it
    label: np.ndarray  # int64 [m]
    cells: list[np.ndarray | None]  # per labelled image: int [rows, cols] cell classes, or None
    cell_size: list[int]  # per labelled image: cell side in original pixels (0 without cells)
    split: list[str] | None  # per labelled image: "train" | "val" | "test", when the file gives splits
    unmatched: int  # label lines whose image is not among the images given (folders: images without a class)

    @property
    def has_cells(self) -> bool:
        return any(c is not None for c in self.cells)


def _line_error(path: Path, number: int, why: str) -> UserError:
    return UserError(f"--labels {path}, line {number}: {why}")


def read_labels(path: Path, refs: list[ImageRef], image_root: Path | None = None) -> Labels:
    """Labels matched to `refs` by resolved file path or by source id; lines for other images are counted, not used."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--labels {path}: no such file")
    root = Path(image_root) if image_root is not None else path.parent
    by_path = {os.path.realpath(r.path): i for i, r in enumerate(refs) if r.kind == "file"}
    by_id = {r.source_id: i for i, r in enumerate(refs)}
    index: list[int] = []
    raw: list[str] = []
    cells: list[np.ndarray | None] = []
    cell_size: list[int] = []
    split: list[str | None] = []
    seen: set[int] = set()
    unmatched = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise UserError(f"--labels {path}: not UTF-8 text (byte {exc.start}); labels are JSONL") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _line_error(path, number, f"not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str) or "label" not in row:
            raise _line_error(path, number, 'expected {"image": "...", "label": ...}')
        if not isinstance(row["label"], (str, int)) or isinstance(row["label"], bool):
            raise _line_error(path, number, f"label must be a string or an integer, got {row['label']!r}")
        i = by_path.get(os.path.realpath(root / row["image"]), by_id.get(row["image"]))
        if i is None:
            unmatched += 1
            continue
        if i in seen:
            raise _line_error(path, number, f"{row['image']} is labelled twice")
        seen.add(i)
        index.append(i)
        raw.append(str(row["label"]))
        grid, size = _cells(row, path, number)
        cells.append(grid)
        cell_size.append(size)
        if row.get("split") not in (None, "train", "val", "test"):
            raise _line_error(path, number, f"split must be train, val or test, got {row['split']!r}")
        split.append(row.get("split"))
    if not index:
        raise UserError(
            f"--labels {path}: none of its {unmatched} images is among the images given; "
            "image paths are read relative to the labels file (or --image-root)"
        )
    if any(s is not None for s in split) and any(s is None for s in split):
        raise UserError(f"--labels {path}: some lines give a split and others do not; give it on every line or none")
    classes = sorted(set(raw))
    ids = {c: k for k, c in enumerate(classes)}
    return Labels(
        np.array(index, dtype=np.int64),
        classes,
        np.array([ids[r] for r in raw], dtype=np.int64),
        cells,
        cell_size,
        [str(s) for s in split] if split and split[0] is not None else None,
        unmatched,
    )


def _cells(row: dict, path: Path, number: int) -> tuple[np.ndarray | None, int]:
    if "cells" not in row:
        return None, 0
    try:
        grid = np.array(row["cells"], dtype=np.int64)
    except (TypeError, ValueError):
        grid = np.empty(0, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise _line_error(path, number, "cells must be a non-empty list of equal-length rows of integers")
    size = row.get("cell_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise _line_error(path, number, f"cells need a positive integer cell_size (pixels), got {size!r}")
    return grid, size


def patch_labels(
    cells: np.ndarray, cell_size: int, original: tuple[int, int], image_size: int, grid: tuple[int, int]
) -> np.ndarray:
    """int `[gh * gw]` class of the cell under each patch centre (row-major); -1 outside the map.

    `original` is the image's (width, height) in pixels; the run's `grid` (rows, cols) of patches tiles the
    `image_size` evaluation crop (`centre_crop`), which is mapped back to the original pixels.
    """
    width, height = original
    gh, gw = grid
    crop = centre_crop(original, image_size)
    ys = (crop.top + (np.arange(gh) + 0.5) * image_size / gh) * height / crop.height
    xs = (crop.left + (np.arange(gw) + 0.5) * image_size / gw) * width / crop.width
    rows = np.floor(ys / cell_size).astype(np.int64)
    cols = np.floor(xs / cell_size).astype(np.int64)
    out = np.full((gh, gw), -1, dtype=np.int64)
    inside_r = rows < cells.shape[0]
    inside_c = cols < cells.shape[1]
    out[np.ix_(inside_r, inside_c)] = cells[np.ix_(rows[inside_r], cols[inside_c])]
    return out.reshape(-1)


def _folder_class(ref: ImageRef) -> str | None:
    """The class folder an image of a `<split>/<class>/...` tree sits in, or None for one at the top."""
    head, sep, _ = ref.source_id.split("::")[0].partition("/")  # a tar member's path inside the shard is not a folder
    return head if sep else None


def folder_labels(train: Path, val: Path) -> tuple[list[ImageRef], Labels]:
    """The images of two ImageNet-layout folders (`<split>/<class>/<image>`) and their labels: the class is the
    folder name; `train`'s images form the train split, `val`'s the test split (validation is carved out of
    train). Images outside a class folder, and `val` images of a class `train` lacks, are counted, not used."""
    refs: list[ImageRef] = []
    parts: list[list[ImageRef]] = []
    for option, folder in (("--train", train), ("--val", val)):
        if not Path(folder).is_dir():
            raise UserError(
                f"{option} {folder}: not a folder (expected the ImageNet layout {option[2:]}/<class>/<image>)"
            )
        listed = list_images([Path(folder)])
        if not any(_folder_class(r) for r in listed):
            raise UserError(f"{option} {folder}: no image sits in a class folder (expected {folder}/<class>/<image>)")
        parts.append(listed)
    classes = sorted({c for r in parts[0] if (c := _folder_class(r)) is not None})
    ids = {c: k for k, c in enumerate(classes)}
    index: list[int] = []
    label: list[int] = []
    split: list[str] = []
    unmatched = 0
    for listed, name in zip(parts, ("train", "test")):
        for ref in listed:
            cls = _folder_class(ref)
            if cls not in ids:
                unmatched += 1
                continue
            index.append(len(refs))
            refs.append(ref)
            label.append(ids[cls])
            split.append(name)
    if "test" not in split:
        raise UserError(f"--val {val}: none of its class folders is among --train's ({len(classes)} classes)")
    return refs, Labels(
        np.arange(len(refs), dtype=np.int64),
        classes,
        np.array(label, dtype=np.int64),
        [None] * len(refs),
        [0] * len(refs),
        split,
        unmatched,
    )
