"""Do `tcjepa eval`'s linear probes converge? One report's probes against scikit-learn, on the same features.

For a report written by `tcjepa eval`, rebuild its labelled rows and split exactly as the evaluation did (its
labels, seed and fractions), read the features it cached, and fit every logistic probe of the report (linear,
dense per cell map, multi-label) with scikit-learn's `LogisticRegression` (L-BFGS, `tol` 1e-8, up to 10,000
iterations) on each feature set cached beside it: the same standardisation, the penalty chosen on the same
validation split by the same rule over the same penalties (C = 1 / (l2 · n)), refitted on train + validation, scored
once on test. Prints, per probe and feature set, both test figures and their difference, then one JSON line:
`max_abs_difference` and whether every figure agrees within `--within` (default 0.01).

  python -m benchmarks.probe_check runs/cross/eval/labels.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment
from evaluation.evaluate import EvalConfig, _dense_labels, _labelled_images, _split, _tagged
from evaluation.features import set_directory
from evaluation.probes import mean_average_precision, mean_iou, patch_split

MAX_ITER = 10_000


def _standardise(train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    mean, std = train.mean(0), np.maximum(train.std(0), 1e-6)
    return [(a - mean) / std for a in (train, *others)]


def _fit(x: np.ndarray, y: np.ndarray, l2: float, multilabel: bool) -> Any:
    """scikit-learn's fit of the probe's problem: one multinomial model, or one binary model per label."""
    from sklearn.linear_model import LogisticRegression

    def one(target: np.ndarray) -> Any:
        if len(np.unique(target)) < 2:  # a label never (or always) present in training: a constant
            return float(target.mean())
        return LogisticRegression(C=1 / (l2 * len(x)), tol=1e-8, max_iter=MAX_ITER).fit(x, target)

    return [one(y[:, j]) for j in range(y.shape[1])] if multilabel else one(y)


def _scores(model: Any, x: np.ndarray, multilabel: bool, classes: int = 0) -> np.ndarray:
    """Log-probabilities `[n, classes]` (a class the training rows lack, or a probability of 0 in float64, at
    e^-745), or per-label logits for the multi-label problem."""
    if not multilabel:
        out = np.full((len(x), classes), np.log(1e-323))
        out[:, model.classes_] = np.log(np.clip(model.predict_proba(x), 1e-323, None))
        return out
    columns = [
        np.full(len(x), math.log(m / (1 - m)) if 0 < m < 1 else (50.0 if m else -50.0))
        if isinstance(m, float)
        else m.decision_function(x)
        for m in model
    ]
    return np.stack(columns, axis=1)


def _selection(scores: np.ndarray, y: np.ndarray, multilabel: bool) -> tuple[float, float]:
    """(metric, loss) as the probe selects: accuracy then cross-entropy, or mAP then binary cross-entropy."""
    if multilabel:
        score, _ = mean_average_precision(scores, y > 0.5)
        p = 1 / (1 + np.exp(-scores))
        loss = float(-(y * np.log(p + 1e-300) + (1 - y) * np.log(1 - p + 1e-300)).sum(1).mean())
        return (-1.0 if math.isnan(score) else score), loss
    return float((scores.argmax(1) == y).mean()), float(-scores[np.arange(len(y)), y].mean())


def sklearn_probe(
    x: np.ndarray, y: np.ndarray, rows: tuple[np.ndarray, np.ndarray, np.ndarray], grid: list[float], kind: str
) -> dict[str, Any]:
    """The probe's test figure by scikit-learn: the penalty of `grid` chosen on validation, refitted on train +
    validation."""
    multilabel = kind == "multilabel"
    classes = 0 if multilabel else int(y.max()) + 1
    train, val, test = rows
    xt, xv = _standardise(x[train], x[val])
    ranked = []
    for l2 in grid:
        scores = _scores(_fit(xt, y[train], l2, multilabel), xv, multilabel, classes)
        metric, loss = _selection(scores, y[val], multilabel)
        ranked.append((metric, -loss, l2))
    best = max(ranked)
    tied = [r for r in ranked if r[:2] == best[:2]]
    l2 = sorted(r[2] for r in tied)[len(tied) // 2]
    trainval = np.concatenate([train, val])
    xtv, xs = _standardise(x[trainval], x[test])
    scores = _scores(_fit(xtv, y[trainval], l2, multilabel), xs, multilabel, classes)
    if multilabel:
        figure = mean_average_precision(scores, y[test] > 0.5)[0]
    elif kind == "dense":
        pred = scores.argmax(1)
        figure = {"patch_accuracy": float((pred == y[test]).mean()), "miou": mean_iou(pred, y[test], classes)}
    else:
        figure = float((scores.argmax(1) == y[test]).mean())
    return {"l2": l2, "figure": figure}


def check(report_path: Path, within: float) -> dict[str, Any]:
    report = json.loads(report_path.read_text())
    cfg = EvalConfig(
        run=Path(report["run"]),
        images=None,
        labels=Path(report["labels"]) if report.get("labels") else None,
        train=Path(report["train"]) if report.get("train") else None,
        val=Path(report["val"]) if report.get("val") else None,
        test_fraction=report["floor_inputs"]["split"]["test_fraction"],
        val_fraction=report["floor_inputs"]["split"]["val_fraction"],
        seed=report["seed"],
        image_root=Path(report["image_root"]) if report.get("image_root") else None,
    )
    if cfg.labels is not None:
        cfg.images = [Path(p) for p in report["image_sources"]]
    refs, labels, _ = _labelled_images(cfg)
    features = Path(report["features"]).parent
    geometry = report["floor_inputs"]["geometry"]
    sets = {"encoder": set_directory("encoder", report["floor_seed"], report.get("encoder", "target"))}
    sets.update({name: set_directory(name, report["floor_seed"]) for name in ("baseline", "pixels", "patch_pixels")})
    rows_out, worst = [], 0.0
    for name, folder in sets.items():
        directory = features / folder
        if not (directory / "pooled.npy").exists():
            continue  # floors lent by another report live beside that report's run
        part = report["probes"] if name == "encoder" else report[name]["probes"]
        pooled = np.load(directory / "pooled.npy")
        sizes = np.load(directory / "sizes.npy")
        usable = np.flatnonzero(sizes[:, 0] > 0)
        split = _split(labels, usable, cfg)
        for probe, result in part.items():
            if "l2" not in result["chosen"]:
                continue
            grid = sorted((float(k.removeprefix("l2=")) for k in result["validation"]), reverse=True)
            if probe == "linear":
                ours, theirs = (
                    result["metrics"]["top1"],
                    sklearn_probe(pooled, labels.label, (split.train, split.val, split.test), grid, "linear"),
                )
                figure = theirs["figure"]
            elif probe == "multilabel":
                tagged = _tagged(split, labels.tagged)
                theirs = sklearn_probe(
                    pooled, labels.tags.astype(np.float64), (tagged.train, tagged.val, tagged.test), grid, "multilabel"
                )
                ours, figure = result["metrics"]["map"], theirs["figure"]
            else:
                patches = np.load(directory / "patches.npy", mmap_mode="r")
                grid_side = int(round(math.sqrt(patches.shape[1])))
                dense = _dense_labels(
                    labels,
                    sizes,
                    json.loads((directory / "meta.json").read_text())["image_size"],
                    (grid_side, grid_side),
                    geometry,
                )[probe]
                x, y, rows = patch_split(patches, dense, split, report["seed"])
                theirs = sklearn_probe(x, y, rows, grid, "dense")
                ours, figure = result["metrics"]["patch_accuracy"], theirs["figure"]["patch_accuracy"]
            difference = abs(ours - figure)
            worst = max(worst, difference)
            line = {
                "set": name,
                "probe": probe,
                "ours": round(ours, 4),
                "sklearn": round(figure, 4),
                "difference": round(difference, 4),
                "l2_ours": result["chosen"]["l2"],
                "l2_sklearn": theirs["l2"],
                "at_edge": result["chosen"]["at_edge"],
                "converged": result["chosen"]["converged"],
            }
            rows_out.append(line)
            print(json.dumps(line), file=sys.stderr, flush=True)
    return {
        "report": str(report_path),
        "checked": len(rows_out),
        "max_abs_difference": round(worst, 4),
        "within": within,
        "agree": worst <= within,
        "any_at_edge": any(r["at_edge"] for r in rows_out),
        "all_converged": all(r["converged"] for r in rows_out),
        "rows": rows_out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="A report of `tcjepa eval`.")
    parser.add_argument("--within", type=float, default=0.01, help="Largest difference that counts as agreement.")
    args = parser.parse_args()
    print_result(check(args.report, args.within))


if __name__ == "__main__":
    main()
