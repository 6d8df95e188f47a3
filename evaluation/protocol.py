"""The evaluation protocol in one torch-free place: the probes and the report read their settings from here, and
`tcjepa eval --help` states them without loading torch."""

from __future__ import annotations

from typing import Any

CROP_FRACTION = 0.875  # resize the shorter side to size / 0.875, centre-crop size (224 from 256)
LINEAR_LRS = (1e-3, 1e-2, 1e-1)
LINEAR_WDS = (0.0, 1e-4, 1e-3, 1e-2)
LINEAR_EPOCHS = 10
LINEAR_MIN_STEPS = 300
LINEAR_BATCH = 1024
KNN_K = 20
KNN_T = 0.07
DENSE_MAX_PATCHES = 100_000
ATTENTIVE_LRS = (1e-3, 3e-3, 1e-2)
ATTENTIVE_EPOCHS = 40
ATTENTIVE_MIN_STEPS = 300
ATTENTIVE_BATCH = 128
# Every report holds the encoder's probes and, beside them, the same probes on each floor.
FLOORS = {
    "baseline": "the same probes on a randomly initialised encoder of the run's architecture (seeded with --seed)",
    "pixels": "the same probes on raw pixels: the mean normalised colour of each patch (pooled: all of them, "
    "the image downsampled to the patch grid)",
}


def _grid(values: tuple[float, ...]) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


HELP = (
    f"Preprocessing: shorter side resized to size/{CROP_FRACTION} (bicubic), centre crop, ImageNet mean/std. "
    f"Hyper-parameters are picked on a validation split held out of the training images; the test split "
    f"(--val with class folders) is scored once. "
    f"linear: SGD (momentum 0.9, cosine, {LINEAR_EPOCHS} epochs, at least {LINEAR_MIN_STEPS} steps, batch "
    f"{LINEAR_BATCH}) on standardised mean-pooled features, lr {_grid(LINEAR_LRS)} x weight decay "
    f"{_grid(LINEAR_WDS)}, the best refitted on train + validation. "
    f"knn: k = {KNN_K}, DINO's weighted vote exp(cos/T), T = {KNN_T}. "
    f"dense: the linear probe per patch (mIoU), one per per-cell map. "
    f"multilabel: one logistic regression per tag on pooled features, swept as linear on validation mAP (test mAP). "
    f"attentive: a cross-attention query, AdamW, lr {_grid(ATTENTIVE_LRS)}. "
    f"Every report also holds two floors, the same probes on a seeded random encoder of the same architecture "
    f"(`baseline`) and on raw pixels, the mean colour of each patch (`pixels`)."
)


def describe() -> dict[str, Any]:
    """The protocol's settings, as the report records them."""
    return {
        "selection": "validation split held out of the training images; test scored once",
        "linear": {
            "optimiser": "SGD momentum 0.9, cosine schedule, standardised features",
            "lr": list(LINEAR_LRS),
            "weight_decay": list(LINEAR_WDS),
            "epochs": LINEAR_EPOCHS,
            "min_steps": LINEAR_MIN_STEPS,
            "batch": LINEAR_BATCH,
        },
        "knn": {"k": KNN_K, "T": KNN_T, "vote": "sum of exp(cos / T) over the k nearest"},
        "dense": {"probe": "linear, per patch, one per per-cell map", "max_patches": DENSE_MAX_PATCHES},
        "multilabel": {
            "probe": "one logistic regression per tag, binary cross-entropy summed over tags, swept as linear",
            "selection": "validation mean average precision",
            "metric": "mean average precision over the tags with a positive among the test images",
        },
        "attentive": {"lr": list(ATTENTIVE_LRS), "epochs": ATTENTIVE_EPOCHS, "min_steps": ATTENTIVE_MIN_STEPS},
    }
