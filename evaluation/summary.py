"""The figures of one finished run: its probes with their floors (from an eval report) and its last validation
and speed (from metrics)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evaluation.protocol import FLOORS


def probe_figures(probes: dict[str, Any]) -> dict[str, float]:
    """One number per probe metric of a report's `probes`: `linear`, `knn`, `attentive` (top-1), `multilabel`
    (mAP), and `NAME_accuracy`, `NAME_miou` for each dense probe NAME (`dense`, `dense_shape`, ...)."""
    figures = {}
    for name, result in probes.items():
        metrics = result["metrics"]
        if "patch_accuracy" in metrics:
            figures[f"{name}_accuracy"] = metrics["patch_accuracy"]
            figures[f"{name}_miou"] = metrics["miou"]
        elif "map" in metrics:
            figures[name] = metrics["map"]
        else:
            figures[name] = metrics["top1"]
    return figures


def floor_figures(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """`probe_figures` of each floor of the report (random-init encoder, raw pixels)."""
    return {floor: probe_figures(report[floor]["probes"]) for floor in FLOORS if floor in report}


def recorded_floor_inputs(report: Path) -> dict[str, Any] | None:
    """The `floor_inputs` that the report at `report` records (None when there is no such report, or it was written
    before reports recorded them): whether it can lend its floors to another evaluation."""
    try:
        inputs = json.loads(Path(report).read_text()).get("floor_inputs")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return inputs if isinstance(inputs, dict) else None


def validation_figures(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """The last validation's prediction loss with true / shuffled / no captions, their ratio, RankMe (and, where
    logged, with each position's mean removed, and the position-only loss), and the mean over predictor layers of
    the share of positive patch–word cosines (cross mode only)."""
    val = [m for m in metrics if "val_loss_predict" in m][-1]
    figures = {
        "val_true": val["val_loss_predict"],
        "val_shuffled": val["val_loss_predict_shuffled"],
        "val_notext": val["val_loss_predict_notext"],
        "ratio": val["val_loss_predict"] / val["val_loss_predict_shuffled"],
    }
    if "val_rankme" in val:
        figures["rankme"] = val["val_rankme"]
    if "val_rankme_centred" in val:
        figures["rankme_centred"] = val["val_rankme_centred"]
        figures["position_only"] = val["val_loss_position_only"]
    if val.get("val_positive_cosine"):
        figures["positive_cosine"] = sum(val["val_positive_cosine"]) / len(val["val_positive_cosine"])
    return figures


def run_figures(metrics: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, float]:
    """One run's figures: its probes (from the eval report), its last validation and mean speed (from its
    metrics)."""
    logged = [m["images_per_s"] for m in metrics if "images_per_s" in m]
    speed = logged[1:] or logged  # the first interval includes start-up
    return {**probe_figures(report["probes"]), **validation_figures(metrics), "images_per_s": sum(speed) / len(speed)}
