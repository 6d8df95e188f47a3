"""`tcjepa eval`: frozen-feature probes of a trained run on labelled images, with their floors, one JSON report.

Labelled images come from a labels file matched to the images given, or from class folders (ImageNet layout).
Their features are extracted once (cached in the run) for one of the run's encoders (the EMA target by default,
or the context encoder) and for the floors: a random encoder of the same architecture seeded apart from the run
(`baseline`), the mean colour of each patch (`pixels`) and each patch's full pixels (`patch_pixels`). The rows are
split into train / validation / test (seeded, the labels file's own split, or `--train` / `--val`), and each probe
is fitted and scored on every feature set: a number is never read without its floors. `--steps` probes the
checkpoints a run kept, one report each, the floors measured once, and draws the learning curves against them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evaluation import protocol
from evaluation.features import (
    FEATURE_SETS,
    Features,
    TrainedRun,
    architecture,
    at_step,
    extract_features,
    floor_seed,
    image_sizes,
    images_digest,
    kept_steps,
    load_run,
)
from evaluation.labels import Labels, dense_probe_name, folder_labels, patch_labels, read_labels
from evaluation.preprocess import EVAL_RESIZE, choose_geometry
from evaluation.preprocess import describe as describe_preprocessing
from evaluation.probes import (
    ProbeResult,
    Split,
    attentive_probe,
    dense_probe,
    knn_probe,
    linear_probe,
    multilabel_probe,
    random_split,
)
from evaluation.protocol import FLOORS
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes
from pipeline.core.refs import ImageRef
from pipeline.core.sources import list_images
from train.config import TrainConfig
from train.data import IMAGENET_MEAN, IMAGENET_STD

logger = logging.getLogger(__name__)

PROBES = ("linear", "knn", "dense", "multilabel", "attentive")
EVAL_DIR = "eval"


@dataclass
class EvalConfig:
    run: Path
    images: list[Path] | None = None
    labels: Path | None = None
    train: Path | None = None  # class folders (ImageNet layout): train and val replace images and labels
    val: Path | None = None
    probes: tuple[str, ...] = PROBES
    image_root: Path | None = None
    test_fraction: float = 0.2
    val_fraction: float = 0.2
    seed: int = 0
    device: str = "auto"
    batch_size: int = 64
    num_workers: int = 2  # DataLoader processes decoding images
    report: Path | None = None
    progress: bool = True
    floors_from: Path | None = None  # an earlier report whose floors are reused when they were measured alike
    encoder: str = "target"  # the run's encoder probed: its EMA target or its context encoder
    eval_resize: str = "auto"  # auto | crop | whole (evaluation.preprocess)
    floor_seed: int | None = None  # the random floor's generator seed (None: drawn from `seed`, apart from the run's)
    step: int | None = None  # a checkpoint the run kept (None: its newest)


def _labelled_images(cfg: EvalConfig) -> tuple[Sequence[ImageRef], Labels, str]:
    """(every image given, their labels, the report's default name) from a labels file or class folders."""
    if cfg.train is not None or cfg.val is not None:
        if cfg.train is None or cfg.val is None:
            raise UserError("--train and --val go together: give both class folders (DIR/train and DIR/val)")
        if cfg.images or cfg.labels is not None:
            raise UserError("--train/--val replace IMAGES and --labels: give class folders or a labels file, not both")
        refs, labels = folder_labels(cfg.train, cfg.val)
        return refs, labels, Path(cfg.train).resolve().parent.name
    if not cfg.images or cfg.labels is None:
        raise UserError("give IMAGES and --labels FILE, or class folders with --train DIR/train --val DIR/val")
    listed = list_images(cfg.images)
    if not listed:
        raise UserError(f"no images found in {', '.join(map(str, cfg.images))}")
    return listed, read_labels(cfg.labels, listed, cfg.image_root), Path(cfg.labels).stem


def _split(labels: Labels, usable: np.ndarray, cfg: EvalConfig) -> Split:
    """Split the usable labelled rows: the given split when there is one, else a seeded random one."""
    if labels.split is None:
        part = random_split(len(usable), cfg.test_fraction, cfg.val_fraction, cfg.seed)
        return Split(usable[part.train], usable[part.val], usable[part.test])
    names = np.array(labels.split)[usable]
    train, val, test = (usable[names == s] for s in ("train", "val", "test"))
    if len(test) == 0 or len(train) < 2:
        source = "--val" if cfg.train is not None else "--labels"
        raise UserError(f"{source} gives a split without test images or with fewer than 2 train images")
    if len(val) == 0:  # carve validation out of train, seeded
        order = np.random.default_rng([cfg.seed, 11]).permutation(train)
        n_val = max(1, round(len(train) * cfg.val_fraction))
        train, val = np.sort(order[n_val:]), np.sort(order[:n_val])
    return Split(train, val, test)


def _dense_labels(
    labels: Labels, sizes: np.ndarray, image_size: int, grid: tuple[int, int], geometry: str
) -> dict[str, np.ndarray]:
    """Per dense probe (one per per-cell map): int `[m, L]` per-patch classes of every labelled image (-1 where
    it has no such map)."""
    out = {}
    for name in labels.map_names:
        classes = np.full((len(labels.label), grid[0] * grid[1]), -1, dtype=np.int64)
        for row, (cells, size) in enumerate(zip(labels.cell_maps[name], labels.cell_size)):
            if cells is not None and sizes[row, 0] > 0:
                original = (int(sizes[row, 0]), int(sizes[row, 1]))
                classes[row] = patch_labels(cells, size, original, image_size, grid, geometry)
        out[dense_probe_name(name)] = classes
    return out


def geometry_of(cfg: EvalConfig, trained: TrainedRun, refs: Sequence[ImageRef], labels: Labels) -> tuple[str, str]:
    """(`crop` or `whole`, why): `--eval-resize` as given, or chosen from the labelled images' sizes (headers only)
    and their label cells."""
    if cfg.eval_resize not in EVAL_RESIZE:
        raise UserError(f"--eval-resize {cfg.eval_resize}: choose {', '.join(EVAL_RESIZE)}")
    if cfg.eval_resize != "auto":
        return cfg.eval_resize, "--eval-resize"
    cells = labels.cell_size if labels.map_names else None
    return choose_geometry(image_sizes(refs), trained.config.image_size, trained.config.patch_size, cells)


def resolved_floor_seed(cfg: EvalConfig, run_seed: int) -> int:
    """The random floor's seed: `--floor-seed`, refused when it is the run's own, or one drawn from `--seed`."""
    if cfg.floor_seed is None:
        return floor_seed(cfg.seed, run_seed)
    if cfg.floor_seed == run_seed:
        raise UserError(
            f"--floor-seed {cfg.floor_seed} is the run's own seed: its random encoder would be the run's starting "
            "weights, not a floor; choose another, or leave it out"
        )
    return cfg.floor_seed


def _tagged(split: Split, tagged: np.ndarray) -> Split:
    """The split's rows whose labels give tags: the multi-label probe's."""
    return Split(*(rows[tagged[rows]] for rows in (split.train, split.val, split.test)))


def _probe_all(
    probes: tuple[str, ...],
    features: Features,
    labels: Labels,
    dense: dict[str, np.ndarray],
    split: Split,
    seed: int,
    device: torch.device,
) -> dict[str, Any]:
    """Each probe of `probes` on one feature set, as report entries (`dense` gives one per per-cell map)."""
    results: dict[str, ProbeResult] = {}
    for name in probes:
        if name == "linear":
            results[name] = linear_probe(features.pooled, labels.label, split, device)
        elif name == "knn":
            results[name] = knn_probe(features.pooled, labels.label, split, device=device)
        elif name == "dense":
            assert features.patches is not None
            for probe, classes in dense.items():
                results[probe] = dense_probe(features.patches, classes, split, seed, device, name=probe)
        elif name == "multilabel":
            results[name] = multilabel_probe(features.pooled, labels.tags, _tagged(split, labels.tagged), device)
        else:
            assert features.patches is not None
            results[name] = attentive_probe(features.patches, labels.label, split, seed, device)
    return {k: v.to_dict() for k, v in results.items()}


def floor_inputs(
    cfg: EvalConfig,
    run_config: TrainConfig,
    refs: Sequence[ImageRef],
    labels: Labels,
    probes: tuple[str, ...],
    geometry: str,
    floor: int,
) -> dict[str, Any]:
    """Everything the floors' probe results depend on: the encoder architecture and the floor's seed (the random
    baseline), the labelled images in order and how they are placed, the labels, the probes, the split and the
    seed, and the protocol. Two runs of the same architecture evaluated alike have the same floors; a report records
    these so that another can reuse them."""
    return {
        "architecture": architecture(run_config),
        "floor_seed": floor,
        "images": images_digest(run_config.image_size, refs, geometry),
        "geometry": geometry,
        "labels": labels.digest(),
        "probes": list(probes),
        "split": {"test_fraction": cfg.test_fraction, "val_fraction": cfg.val_fraction},
        "seed": cfg.seed,
        "protocol": protocol.describe(),
    }


def reused_floors(path: Path, inputs: dict[str, Any]) -> dict[str, Any]:
    """The floors of the report at `path` (`--floors-from`), refused unless they were measured on the same
    `floor_inputs` (of the probes, at least those asked for now: the floors lent are those probes')."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--floors-from {path}: not a readable eval report ({exc})") from None
    if not isinstance(earlier, dict) or "floor_inputs" not in earlier or any(f not in earlier for f in FLOORS):
        raise UserError(f"--floors-from {path}: not a report of `tcjepa eval` with its floors and their inputs")
    measured = earlier["floor_inputs"]
    different = [
        key
        for key in inputs
        if (
            not set(inputs[key]) <= set(measured.get(key) or [])
            if key == "probes"
            else measured.get(key) != inputs[key]
        )
    ]
    if different:
        raise UserError(
            f"--floors-from {path}: its floors were measured with other {', '.join(different)}; "
            "leave --floors-from out to measure this run's own"
        )
    wanted = set(inputs["probes"])

    def asked(name: str) -> bool:  # a dense probe per cell map is `dense` or `dense_NAME`
        return name in wanted or (name.startswith("dense_") and "dense" in wanted)

    return {
        floor: {**earlier[floor], "probes": {k: v for k, v in earlier[floor]["probes"].items() if asked(k)}}
        for floor in FLOORS
    }


def one_line(report: dict[str, Any]) -> str:
    """The report as one table row: step, each probe's metrics with its floors in brackets, split sizes."""
    parts = [f"step {report['step']}"]
    for name, result in report["probes"].items():
        floors = [
            f"{floor} {report[floor]['probes'][name]['metrics'][key]:.3f}"
            for floor in FLOORS
            if floor in report
            for key in list(result["metrics"])[:1]
        ]
        metrics = " ".join(f"{k} {v:.3f}" for k, v in result["metrics"].items())
        parts.append(f"{name} {metrics}" + (f" ({', '.join(floors)})" if floors else ""))
    s = report["split"]
    parts.append(f"train {s['train']} val {s['val']} test {s['test']}")
    return " | ".join(parts)


def report_path(cfg: EvalConfig, name: str) -> Path:
    """Where the report goes: `--report`, or `RUN/eval/<name>[.step-N][.context].json`."""
    if cfg.report is not None:
        return cfg.report
    step = f".step-{cfg.step:08d}" if cfg.step is not None else ""
    which = ".context" if cfg.encoder == "context" else ""
    return Path(cfg.run) / EVAL_DIR / f"{name}{step}{which}.json"


def evaluate(cfg: EvalConfig, default_probes: bool = False) -> dict[str, Any]:
    """Run the probes of `cfg` on the run and its floors; writes the JSON report (`report_path`) and returns it.

    `dense` runs once per per-cell map of the labels (`dense` on "cells", `dense_NAME` on "cell_maps"."NAME").
    With `default_probes`, a probe the labels cannot support (dense without cell maps, multilabel without tags)
    is dropped, not refused.
    """
    unknown = [p for p in cfg.probes if p not in PROBES]
    if unknown:
        raise UserError(f"--probe {unknown[0]}: unknown probe; choose from {', '.join(PROBES)}")
    refs, labels, name = _labelled_images(cfg)
    supported = {"dense": bool(labels.map_names), "multilabel": labels.has_tags}
    probes = tuple(p for p in PROBES if p in cfg.probes and (supported.get(p, True) or not default_probes))
    where = "a labels file; class folders have none" if cfg.labels is None else f"{cfg.labels}; none has them"
    if "dense" in probes and not supported["dense"]:
        raise UserError(f'--probe dense needs per-cell labels ("cells" or "cell_maps", and "cell_size", in {where})')
    if "multilabel" in probes and not supported["multilabel"]:
        raise UserError(f'--probe multilabel needs each image\'s set of labels ("tags" in {where})')
    need_patches = "dense" in probes or "attentive" in probes
    labelled = [refs[i] for i in labels.image_index]
    trained = load_run(cfg.run)
    if cfg.step is not None:
        trained = at_step(trained, cfg.run, cfg.step)
    floor = resolved_floor_seed(cfg, trained.config.seed)
    geometry, why = geometry_of(cfg, trained, labelled, labels)
    inputs = floor_inputs(cfg, trained.config, labelled, labels, probes, geometry, floor)
    reused = reused_floors(cfg.floors_from, inputs) if cfg.floors_from is not None else None
    sets = extract_features(
        cfg.run,
        labelled,
        with_patches=need_patches,
        device=cfg.device,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        progress=cfg.progress,
        floor_seed=floor,
        sets=("encoder",) if reused else FEATURE_SETS,
        trained=trained,
        encoder=cfg.encoder,
        geometry=geometry,
    )
    features = sets["encoder"]
    usable = np.flatnonzero(features.decoded)
    if len(usable) < len(labels.label):
        logger.warning(
            f"eval: {len(labels.label) - len(usable)} labelled images could not be read or decoded; left out"
        )
    if labels.unmatched and cfg.train is not None:
        logger.warning(f"eval: {labels.unmatched} images outside a --train class folder; left out")
    dense = (
        _dense_labels(labels, features.sizes, features.image_size, features.grid, geometry) if "dense" in probes else {}
    )
    device = resolve_device(cfg.device)
    try:
        split = _split(labels, usable, cfg)
        results = {
            which: _probe_all(probes, feature_set, labels, dense, split, cfg.seed, device)
            for which, feature_set in sets.items()
        }
    except ValueError as exc:
        raise UserError(f"eval: {exc}") from None
    floors = reused or {name: {"what": what, "probes": results[name]} for name, what in FLOORS.items()}
    if not reused:
        floors["baseline"]["seed"] = floor
    report = {
        "run": str(cfg.run),
        "step": features.step,
        "encoder": cfg.encoder,
        "labels": None if cfg.labels is None else str(cfg.labels),
        **({"train": str(cfg.train), "val": str(cfg.val)} if cfg.train is not None else {}),
        "image_sources": [str(p) for p in cfg.images or []],
        "image_root": None if cfg.image_root is None else str(cfg.image_root),
        "seed": cfg.seed,
        "run_seed": trained.config.seed,
        "floor_seed": floor,
        "images": len(refs),
        "labelled": len(labels.label),
        "unmatched_labels": labels.unmatched,
        "undecodable": int(len(labels.label) - len(usable)),
        "classes": len(labels.classes),
        "split": split.sizes(),
        "split_source": "folders" if cfg.train is not None else "labels file" if labels.split is not None else "random",
        "features": str(features.directory),
        "protocol": {
            **protocol.describe(),
            "preprocessing": {
                **describe_preprocessing(features.image_size, geometry),
                "chosen_by": why,
                "normalise": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
            },
        },
        "probes": results["encoder"],
        **floors,
        "floor_inputs": inputs,
        **({"floors_from": str(cfg.floors_from)} if reused else {}),
    }
    out = report_path(cfg, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, (json.dumps(report, indent=1) + "\n").encode())
    report["report"] = str(out)
    return report


def steps_to_probe(run: Path, asked: str) -> list[int]:
    """`--steps`: `all` (every step whose encoders the run kept, and its newest checkpoint's), or steps separated
    by commas."""
    trained_step = load_run(run).step
    kept = sorted(set(kept_steps(run)) | {trained_step})
    if asked.strip() == "all":
        return kept
    try:
        steps = sorted({int(part) for part in asked.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--steps {asked}: give steps separated by commas (100,200,300) or `all`") from None
    missing = [step for step in steps if step not in kept]
    if not steps or missing:
        raise UserError(
            f"--steps {asked}: the run kept encoders of steps {', '.join(map(str, kept))} only; train with "
            "checkpoint_every_keep to keep more"
        )
    return steps


def evaluate_steps(cfg: EvalConfig, steps: list[int], default_probes: bool = False) -> list[dict[str, Any]]:
    """One report per step (`report_path`), the floors measured with the first and reused by the rest, then the
    learning curves against the floors (`evaluation.curves`)."""
    from evaluation.curves import plot_learning_curves

    if cfg.report is not None:
        raise UserError("--report names one file: leave it out with --steps (one report per step under RUN/eval/)")
    reports: list[dict[str, Any]] = []
    for step in steps:
        floors_from = cfg.floors_from if not reports else Path(reports[0]["report"])
        reports.append(evaluate(replace(cfg, step=step, floors_from=floors_from), default_probes))
    first = Path(reports[0]["report"])
    plot_learning_curves(reports, first.with_name(first.name.replace(f".step-{steps[0]:08d}", "")))
    return reports
