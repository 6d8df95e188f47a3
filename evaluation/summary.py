"""The figures of one finished run: its probes (from an eval report) and its last validation and speed (from
metrics)."""

from __future__ import annotations

from typing import Any


def run_figures(metrics: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, float]:
    """One run's figures: its probes (from the eval report) and its last validation and mean speed (from its
    metrics)."""
    val = [m for m in metrics if "val_loss_predict" in m][-1]
    logged = [m["images_per_s"] for m in metrics if "images_per_s" in m]
    speed = logged[1:] or logged  # the first interval includes start-up
    probes = {name: result["metrics"] for name, result in report["probes"].items()}
    figures = {
        "linear": probes["linear"]["top1"],
        "knn": probes["knn"]["top1"],
        "dense_accuracy": probes["dense"]["patch_accuracy"],
        "dense_miou": probes["dense"]["miou"],
    }
    if "attentive" in probes:
        figures["attentive"] = probes["attentive"]["top1"]
    return {
        **figures,
        "val_true": val["val_loss_predict"],
        "val_shuffled": val["val_loss_predict_shuffled"],
        "val_notext": val["val_loss_predict_notext"],
        "ratio": val["val_loss_predict"] / val["val_loss_predict_shuffled"],
        "images_per_s": sum(speed) / len(speed),
    }
