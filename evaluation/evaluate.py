"""`tcjepa eval`: frozen-feature probes of a trained run on labelled images, one JSON report.

Labelled images are matched to the images given, their target-encoder features
are extracted once (cached in the run), split into train / validation / test
(seeded, or the labels file's own split), and each probe is fitted and scored.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.features import extract_features
from evaluation.labels import Labels, patch_labels, read_labels
from evaluation.probes import ProbeResult, Split, attentive_probe, dense_probe, knn_probe, linear_probe, random_split
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes
from pipeline.core.sources import list_images

PROBES = ("linear", "knn", "dense", "attentive")
EVAL_DIR = "eval"


@dataclass
class EvalConfig:
    run: Path
    images: list[Path]
    labels: Path
    probes: tuple[str, ...] = PROBES
    image_root: Path | None = None
    test_fraction: float = 0.2
    val_fraction: float = 0.2
    seed: int = 0
    device: str = "auto"
    batch_size: int = 64
    workers: int = 2
    report: Path | None = None
    progress: bool = True


def _split(labels: Labels, usable: np.ndarray, cfg: EvalConfig) -> Split:
    """Split the usable labelled rows: the file's own split when it has one, else a seeded random one."""
    if labels.split is None:
        part = random_split(len(usable), cfg.test_fraction, cfg.val_fraction, cfg.seed)
        return Split(usable[part.train], usable[part.val], usable[part.test])
    names = np.array(labels.split)[usable]
    train, val, test = (usable[names == s] for s in ("train", "val", "test"))
    if len(test) == 0 or len(train) < 2:
        raise UserError("--labels gives a split without test images or with fewer than 2 train images")
    if len(val) == 0:  # carve validation out of train, seeded
        order = np.random.default_rng([cfg.seed, 11]).permutation(train)
        n_val = max(1, round(len(train) * cfg.val_fraction))
        train, val = np.sort(order[n_val:]), np.sort(order[:n_val])
    return Split(train, val, test)


def _dense_labels(labels: Labels, sizes: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """int `[m, L]` per-patch classes of every labelled image (-1 where it has no cell map)."""
    out = np.full((len(labels.label), grid[0] * grid[1]), -1, dtype=np.int64)
    for row, (cells, size) in enumerate(zip(labels.cells, labels.cell_size)):
        if cells is not None and sizes[row, 0] > 0:
            out[row] = patch_labels(cells, size, (int(sizes[row, 0]), int(sizes[row, 1])), grid)
    return out


def one_line(report: dict[str, Any]) -> str:
    """The report as one table row: step, each probe's metrics, split sizes."""
    parts = [f"step {report['step']}"]
    for name, result in report["probes"].items():
        parts.append(f"{name} " + " ".join(f"{k} {v:.3f}" for k, v in result["metrics"].items()))
    s = report["split"]
    parts.append(f"train {s['train']} val {s['val']} test {s['test']}")
    return " | ".join(parts)


def evaluate(cfg: EvalConfig, default_probes: bool = False) -> dict[str, Any]:
    """Run the probes of `cfg`; writes the JSON report (default `RUN/eval/<labels stem>.json`) and returns it.

    With `default_probes`, a probe the labels cannot support (dense without cell maps) is dropped, not refused.
    """
    unknown = [p for p in cfg.probes if p not in PROBES]
    if unknown:
        raise UserError(f"--probe {unknown[0]}: unknown probe; choose from {', '.join(PROBES)}")
    refs = list_images(cfg.images)
    if not refs:
        raise UserError(f"no images found in {', '.join(map(str, cfg.images))}")
    labels = read_labels(cfg.labels, refs, cfg.image_root)
    probes = tuple(p for p in PROBES if p in cfg.probes and (p != "dense" or labels.has_cells or not default_probes))
    if "dense" in probes and not labels.has_cells:
        raise UserError(f'--probe dense needs per-cell labels ("cells" and "cell_size" in {cfg.labels}); none has them')
    need_patches = "dense" in probes or "attentive" in probes
    features = extract_features(
        cfg.run,
        [refs[i] for i in labels.image_index],
        with_patches=need_patches,
        device=cfg.device,
        batch_size=cfg.batch_size,
        workers=cfg.workers,
        progress=cfg.progress,
    )
    usable = np.flatnonzero(features.decoded)
    if len(usable) < len(labels.label):
        print(
            f"eval: {len(labels.label) - len(usable)} labelled images could not be read or decoded; left out",
            file=sys.stderr,
        )
    try:
        split = _split(labels, usable, cfg)
        results: dict[str, ProbeResult] = {}
        for name in probes:
            if name == "linear":
                results[name] = linear_probe(features.pooled, labels.label, split, cfg.seed)
            elif name == "knn":
                results[name] = knn_probe(features.pooled, labels.label, split)
            elif name == "dense":
                dense = _dense_labels(labels, features.sizes, features.grid)
                results[name] = dense_probe(features.patches, dense, split, cfg.seed)
            else:
                results[name] = attentive_probe(
                    features.patches, labels.label, split, cfg.seed, resolve_device(cfg.device)
                )
    except ValueError as exc:
        raise UserError(f"eval: {exc}") from None
    report = {
        "run": str(cfg.run),
        "step": features.step,
        "labels": str(cfg.labels),
        "seed": cfg.seed,
        "images": len(refs),
        "labelled": len(labels.label),
        "unmatched_labels": labels.unmatched,
        "undecodable": int(len(labels.label) - len(usable)),
        "classes": len(labels.classes),
        "split": split.sizes(),
        "split_source": "labels file" if labels.split is not None else "random",
        "features": str(features.directory),
        "probes": {k: v.to_dict() for k, v in results.items()},
    }
    out = cfg.report or Path(cfg.run) / EVAL_DIR / f"{Path(cfg.labels).stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, (json.dumps(report, indent=1) + "\n").encode())
    report["report"] = str(out)
    return report
