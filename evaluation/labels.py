"""Probe labels: JSONL lines `{"image": ..., "label": ...}`, optionally with per-cell maps and tags.

`image` is a path relative to the labels file's folder (or `--image-root`), or a
source id as `tcjepa` lists it (a tar member `shard.tar/member.png`, a table row
`name::7`). `label` is any string or integer. A line may add:

- per-cell maps for the dense probes: `"cells": [[...], ...]` (rows of integer
  classes, negative = unlabelled; probe `dense`) and any number of named maps
  `"cell_maps": {"shape": [[...], ...], ...}` (probe `dense_shape`, ...), all with
  `"cell_size"` (cell side in pixels of the original image), as `tcjepa synth` writes;
- `"tags": [...]`: the image's set of labels (strings or integers, possibly none) for the
  multi-label probe; lines without it are left out of that probe;
- `"split": "train" | "val" | "test"` to use a dataset's own split instead of a
  random one (then every line must have it).

Per-patch labels follow the run's patch grid: each patch takes the class of the
cell under its centre, after the image is resized and centre-cropped as features
are extracted (evaluation/preprocess.py).

Class folders (`--train DIR/train --val DIR/val`, the ImageNet layout
`<split>/<class>/<image>`) give labels without a file: the class is the folder name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evaluation.preprocess import placement
from pipeline.core.errors import UserError
from pipeline.core.refs import ImageRef
from pipeline.core.sources import list_images

CELLS = "cells"  # the per-cell map given as "cells" (probe `dense`); others are named in "cell_maps"
_MAP_NAME = re.compile(r"[a-z0-9_]+")


def dense_probe_name(cell_map: str) -> str:
    """The report's name of the dense probe on one per-cell map: `dense` on "cells", `dense_NAME` on another."""
    return "dense" if cell_map == CELLS else f"dense_{cell_map}"


@dataclass
class Labels:
    image_index: np.ndarray  # int64 [m]: index into the image list of each labelled image
    classes: list[str]  # image-level class names; label ids index into it
    label: np.ndarray  # int64 [m]
    cell_maps: dict[str, list[np.ndarray | None]]  # map name -> per labelled image: int [rows, cols] classes, or None
    cell_size: list[int]  # per labelled image: cell side in original pixels (0 without cell maps)
    split: list[str] | None  # per labelled image: "train" | "val" | "test", when the file gives splits
    unmatched: int  # label lines whose image is not among the images given (folders: images without a class)
    tag_names: list[str]  # the multi-label vocabulary: every tag of the file, sorted
    tags: np.ndarray  # bool [m, len(tag_names)]: the tags of each labelled image
    tagged: np.ndarray  # bool [m]: the image's line gives tags (the others are left out of the multi-label probe)

    @property
    def map_names(self) -> list[str]:
        """The per-cell maps that some labelled image has, "cells" first."""
        return sorted(
            (k for k, v in self.cell_maps.items() if any(g is not None for g in v)), key=lambda k: (k != CELLS, k)
        )

    @property
    def has_tags(self) -> bool:
        return bool(self.tagged.any())

    def digest(self) -> str:
        """sha256 of everything a probe reads from the labels: classes, per-cell maps, tags and the split."""
        h = hashlib.sha256()
        for part in (self.classes, self.cell_size, self.split, self.tag_names, sorted(self.cell_maps)):
            h.update(json.dumps(part).encode() + b"\0")
        for array in (self.label, self.tags, self.tagged):
            h.update(f"{array.dtype}{array.shape}".encode() + np.ascontiguousarray(array).tobytes())
        for name in sorted(self.cell_maps):
            for cells in self.cell_maps[name]:
                h.update(b"-" if cells is None else f"{cells.dtype}{cells.shape}".encode() + cells.tobytes())
        return h.hexdigest()


def _line_error(path: Path, number: int, why: str) -> UserError:
    return UserError(f"--labels {path}, line {number}: {why}")


def read_labels(path: Path, refs: Sequence[ImageRef], image_root: Path | None = None) -> Labels:
    """Labels matched to `refs` by resolved file path or by source id; lines for other images are counted, not used."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--labels {path}: no such file")
    root = Path(image_root) if image_root is not None else path.parent
    by_path = {os.path.realpath(r.path): i for i, r in enumerate(refs) if r.kind == "file"}
    by_id = {r.source_id: i for i, r in enumerate(refs)}
    index: list[int] = []
    raw: list[str] = []
    maps: list[dict[str, np.ndarray]] = []
    cell_size: list[int] = []
    raw_tags: list[list[str] | None] = []
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
        grids, size = _cell_maps(row, path, number)
        maps.append(grids)
        cell_size.append(size)
        raw_tags.append(_tags(row, path, number))
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
    names = sorted({m for grids in maps for m in grids}, key=lambda k: (k != CELLS, k))
    tag_names, tag_matrix = _tag_matrix(raw_tags)
    return Labels(
        np.array(index, dtype=np.int64),
        classes,
        np.array([ids[r] for r in raw], dtype=np.int64),
        {name: [grids.get(name) for grids in maps] for name in names},
        cell_size,
        [str(s) for s in split] if split and split[0] is not None else None,
        unmatched,
        tag_names,
        tag_matrix,
        np.array([t is not None for t in raw_tags], dtype=bool),
    )


def _grid(value: object, what: str, path: Path, number: int) -> np.ndarray:
    try:
        grid = np.array(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        grid = np.empty(0, dtype=np.int64)
    if grid.ndim != 2 or grid.size == 0:
        raise _line_error(path, number, f"{what} must be a non-empty list of equal-length rows of integers")
    return grid


def _cell_maps(row: dict, path: Path, number: int) -> tuple[dict[str, np.ndarray], int]:
    """The line's per-cell maps by name ("cells" and those under "cell_maps") and their cell size (0 without)."""
    named = row.get("cell_maps", {})
    if not isinstance(named, dict):
        raise _line_error(path, number, 'cell_maps must be an object {"name": [[...], ...], ...}')
    grids: dict[str, np.ndarray] = {}
    if CELLS in row:
        grids[CELLS] = _grid(row[CELLS], CELLS, path, number)
    for name, value in named.items():
        if name == CELLS or not _MAP_NAME.fullmatch(name):
            raise _line_error(path, number, f"cell_maps name {name!r}: use lower-case letters, digits and _, not cells")
        grids[name] = _grid(value, f"cell_maps.{name}", path, number)
    if not grids:
        return grids, 0
    size = row.get("cell_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise _line_error(path, number, f"cells need a positive integer cell_size (pixels), got {size!r}")
    return grids, size


def _tags(row: dict, path: Path, number: int) -> list[str] | None:
    if "tags" not in row:
        return None
    tags = row["tags"]
    if not isinstance(tags, list) or any(not isinstance(t, (str, int)) or isinstance(t, bool) for t in tags):
        raise _line_error(path, number, f"tags must be a list of strings or integers, got {tags!r}")
    return [str(t) for t in tags]


def _tag_matrix(raw: list[list[str] | None]) -> tuple[list[str], np.ndarray]:
    """(the sorted tag vocabulary, bool [m, tags] of each line's tags; all False where a line has none)."""
    names = sorted({t for tags in raw if tags for t in tags})
    ids = {t: k for k, t in enumerate(names)}
    out = np.zeros((len(raw), len(names)), dtype=bool)
    for row, tags in enumerate(raw):
        out[row, [ids[t] for t in tags or []]] = True
    return names, out


def patch_labels(
    cells: np.ndarray,
    cell_size: int,
    original: tuple[int, int],
    image_size: int,
    grid: tuple[int, int],
    geometry: str = "crop",
) -> np.ndarray:
    """int `[gh * gw]` class of the cell under each patch centre (row-major); -1 outside the map.

    `original` is the image's (width, height) in pixels; the run's `grid` (rows, cols) of patches tiles the
    `image_size` evaluation image (`placement` under `geometry`), which is mapped back to the original pixels.
    """
    width, height = original
    gh, gw = grid
    crop = placement(original, image_size, geometry)
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
    parts: list[Sequence[ImageRef]] = []
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
    for part, name in zip(parts, ("train", "test")):
        for ref in part:
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
        {},
        [0] * len(refs),
        split,
        unmatched,
        [],
        np.zeros((len(refs), 0), dtype=bool),
        np.zeros(len(refs), dtype=bool),
    )
