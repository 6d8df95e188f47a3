"""How much of a synthetic scene set do position and a patch's own pixels answer? The shortcuts, measured.

A JEPA on small, regular data can lower its loss from where a patch is, and a probe can be answered by a patch's
own pixels; neither says anything about what an encoder learned from context. For a `tcjepa synth` directory
(either layout), with a random-init tiny ViT at the given patch size (the target encoder a run starts from):

- `position_share`: the share of the layer-normed target features' variance that each position's mean over the
  images explains (1 − Σ‖z_ip − μ_p‖² / Σ‖z_ip − μ‖²). A random-init ViT adds its full sin-cos position
  embedding to a small patch embedding, so even on uniform noise it is 0.35 at patch 8 (the floor of this measure
  on the untrained target); trained runs log the same share of their target (`val_position_share`);
- the dense probes (per-cell class and shape, `evaluation.probes.dense_probe`, converged, on a seeded split) and the
  multi-label probe on three feature sets: each patch's full pixels, the mean colour of each patch, and the
  random-init encoder; the ceiling of every probe is 1 (labels are a function of the image), and `majority` is
  the share of the most common class, what a probe that reads nothing scores.

Prints one JSON line.

  python -m benchmarks.scene_stats --synth data --patch-size 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synth", type=Path, required=True, help="A `tcjepa synth` directory.")
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--images", type=int, default=600, help="At most this many scenes.")
    parser.add_argument("--seed", type=int, default=123, help="Seed of the random-init encoder and the split.")
    parser.add_argument("--depth", type=int, default=6, help="Depth of the tiny ViT (width 192, 3 heads).")
    args = parser.parse_args()

    import torch
    from PIL import Image

    from evaluation.features import full_patches, pixel_patches
    from evaluation.labels import patch_labels
    from evaluation.probes import dense_probe, multilabel_probe, random_split
    from train.data import normalise
    from train.vit import build_vit

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows = [json.loads(line) for line in (args.synth / "labels.jsonl").read_text().splitlines()][: args.images]
    meta = json.loads((args.synth / "classes.json").read_text())
    size = int(meta["image_size"])
    images = np.stack([np.asarray(Image.open(args.synth / r["image"]).convert("RGB")) for r in rows])
    x = normalise(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
    torch.manual_seed(args.seed)
    encoder = build_vit("vit_tiny", size, args.patch_size, None, args.depth, None).eval()
    with torch.no_grad():
        tokens = torch.cat([encoder(x[i : i + 64]) for i in range(0, len(x), 64)]).float()
    z = torch.nn.functional.layer_norm(tokens, tokens.shape[-1:]).double()
    total = (z - z.mean((0, 1))).square().sum()
    within = (z - z.mean(0)).square().sum()
    grid = (size // args.patch_size,) * 2
    sets = {
        "patch_pixels": full_patches(x, args.patch_size).numpy(),
        "patch_colours": pixel_patches(x, args.patch_size).numpy(),
        "random_init": tokens.numpy(),
    }
    split = random_split(len(rows), 0.2, 0.2, args.seed)
    tags = sorted({t for r in rows for t in r["tags"]})
    tagged = np.array([[t in r["tags"] for t in tags] for r in rows])
    result: dict[str, object] = {
        "synth": str(args.synth),
        "layout": meta.get("layout", "grid"),
        "images": len(rows),
        "patch_size": args.patch_size,
        "position_share": round(float(1 - within / total), 4),
    }
    maps = {"dense": [r["cells"] for r in rows], "dense_shape": [r["cell_maps"]["shape"] for r in rows]}
    for name, cells in maps.items():
        labels = np.stack(
            [patch_labels(np.array(c), r["cell_size"], (size, size), size, grid, "whole") for c, r in zip(cells, rows)]
        )
        counts = np.bincount(labels[labels >= 0])
        figures: dict[str, object] = {"majority": round(float(counts.max() / counts.sum()), 4)}
        for feature, values in sets.items():
            probe = dense_probe(values, labels, split, args.seed, name=name)
            figures[feature] = {k: round(v, 4) for k, v in probe.metrics.items()}
        result[name] = figures
    result["multilabel"] = {
        feature: round(multilabel_probe(values.mean(1), tagged, split).metrics["map"], 4)
        for feature, values in sets.items()
    }
    print_result(result)


if __name__ == "__main__":
    main()
