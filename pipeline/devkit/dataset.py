"""A synthetic data set on disk: `generate` writes scenes of either layout with their captions and labels.

Outputs under DIR: ``images/NNNNNN.png``, ``captions.jsonl`` (``{"image",
"captions"}``), ``labels.jsonl`` and ``classes.json`` (the label vocabularies).
Image i depends only on (seed, i): a larger --n extends a smaller one.
The layouts themselves are `pipeline.devkit.synth` (grid) and `pipeline.devkit.free_scenes` (free, which builds
on the grid scenes' shapes and phrasing); this module sits above both, so neither imports the other back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.core.errors import UserError
from pipeline.devkit import free_scenes
from pipeline.devkit.synth import (
    CAPTION_MODES,
    COLOURS,
    SHAPES,
    captions_for,
    class_names,
    draw_scene,
    label_line,
    render,
    shape_names,
)

LAYOUTS = ("grid", "free")


def generate(
    out: Path,
    n: int,
    image_size: int = 64,
    grid: int = 4,
    seed: int = 0,
    captions: str = "full",
    layout: str = "grid",
) -> None:
    """Write `n` scenes with captions (`full` or `partial`, see `scene_captions`) and labels under `out`: `grid`
    scenes (one object per cell), or `free` ones (`pipeline.devkit.free_scenes`: overlapping shapes anywhere on
    textured backgrounds; `grid` is then unused)."""
    if captions not in CAPTION_MODES:
        raise UserError(f"--captions {captions!r}: choose {' or '.join(CAPTION_MODES)}")
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r}: choose {' or '.join(LAYOUTS)}")
    if n < 1:
        raise UserError(f"--n must be at least 1 (got {n})")
    if layout == "grid" and (grid < 1 or image_size % grid or image_size // grid < 4):
        raise UserError(f"--image-size {image_size} must be a multiple of --grid {grid} with cells of at least 4 px")
    if layout == "free" and (image_size % free_scenes.LABEL_GRID or image_size < 32):
        raise UserError(
            f"--image-size {image_size}: free scenes need a multiple of {free_scenes.LABEL_GRID}, at least 32"
        )
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    cell = image_size // grid
    with open(out / "captions.jsonl", "w") as caps, open(out / "labels.jsonl", "w") as labels:
        for i in range(n):
            rng = np.random.default_rng([seed, i])
            name = f"images/{i:06d}.png"
            if layout == "grid":
                objs = draw_scene(rng, grid)
                pixels, texts = render(objs, grid, image_size, rng), captions_for(objs, grid, rng, captions)
                line = label_line(name, objs, grid, cell)
            else:
                free, background = free_scenes.draw_free_scene(rng)
                pixels = free_scenes.render_free(free, background, image_size, rng)
                texts = free_scenes.free_captions(free, background, rng, captions)
                line = free_scenes.free_label_line(name, free, image_size)
            Image.fromarray(pixels).save(out / name, optimize=False)
            caps.write(json.dumps({"image": name, "captions": texts}) + "\n")
            labels.write(json.dumps(line) + "\n")
    meta = {
        "layout": layout,
        "image_labels": ["none", *COLOURS] if layout == "grid" else list(SHAPES),
        "cell_classes": class_names(),
        "cell_maps": {"shape": shape_names()},
        "tags": class_names()[1:],
        "grid": grid if layout == "grid" else free_scenes.LABEL_GRID,
        "image_size": image_size,
        "seed": seed,
        "n": n,
        "captions": captions,
    }
    (out / "classes.json").write_text(json.dumps(meta, indent=1) + "\n")
