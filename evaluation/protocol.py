"""The evaluation protocol in one torch-free place: the probes and the report read their settings from here, and
`tcjepa eval --help` states them without loading torch."""

from __future__ import annotations

from typing import Any

CROP_FRACTION = 0.875  # resize the shorter side to size / 0.875, centre-crop size (224 from 256)
# Logistic regression on standardised features, fitted by L-BFGS to a gradient below GRAD_TOLERANCE; the penalty
# l2 (on the mean loss: scikit-learn's C = 1 / (l2 · n)) swept on L2_GRID, extended past a winning end to L2_LIMITS.
L2_GRID = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
L2_LIMITS = (1e-9, 1e2)
GRAD_TOLERANCE = 1e-4  # scikit-learn's default `tol` for the same (mean-scaled) objective
LBFGS_MAX_ITER = 1000
KNN_K = 20
KNN_T = 0.07
DENSE_MAX_PATCHES = 100_000
ATTENTIVE_LRS = (1e-3, 3e-3, 1e-2)
ATTENTIVE_LIMITS = (1e-5, 1e-1)
ATTENTIVE_EPOCHS = 40
ATTENTIVE_MIN_STEPS = 300
ATTENTIVE_BATCH = 128
# Every report holds the encoder's probes and, beside them, the same probes on each floor.
FLOORS = {
    "baseline": "the same probes on a randomly initialised encoder of the run's architecture, seeded apart from the "
    "run (floor_seed: --floor-seed, or drawn from --seed; never the run's own starting weights)",
    "pixels": "the same probes on raw pixels: the mean normalised colour of each patch (pooled: all of them, "
    "the image downsampled to the patch grid)",
    "patch_pixels": "the same probes on raw pixels: each patch's full normalised pixels, 3·p² values, what the "
    "patch embedding reads (pooled: their mean over patches, as the encoder's tokens are pooled)",
}


def _grid(values: tuple[float, ...]) -> str:
    return "{" + ", ".join(f"{v:g}" for v in values) + "}"


HELP = (
    f"Preprocessing: shorter side resized to size/{CROP_FRACTION} (bicubic) and centre crop (photographs), or the "
    f"whole image resized (square images at the model's size, or whose label cells the patch grid divides; "
    f"--eval-resize), ImageNet mean/std. "
    f"Hyper-parameters are picked on a validation split held out of the training images; the test split "
    f"(--val with class folders) is scored once. "
    f"linear: logistic regression on standardised mean-pooled features, fitted to convergence by L-BFGS (largest "
    f"gradient entry below {GRAD_TOLERANCE:g}), L2 penalty {_grid(L2_GRID)} on the mean loss, extended past a "
    f"winning end, the best refitted on train + validation. "
    f"knn: k = {KNN_K}, DINO's weighted vote exp(cos/T), T = {KNN_T}. "
    f"dense: the linear probe per patch (mIoU), one per per-cell map. "
    f"multilabel: one logistic regression per tag on pooled features, swept as linear on validation mAP (test mAP). "
    f"attentive: a cross-attention query, AdamW, lr {_grid(ATTENTIVE_LRS)}, extended past a winning end. "
    f"Every report also holds the floors, the same probes on a random encoder of the same architecture seeded apart "
    f"from the run (`baseline`), on the mean colour of each patch (`pixels`) and on each patch's full pixels "
    f"(`patch_pixels`)."
)


def describe() -> dict[str, Any]:
    """The protocol's settings, as the report records them."""
    logistic = {
        "solver": "L-BFGS, full batch, strong-Wolfe line search, standardised features",
        "l2": list(L2_GRID),
        "l2_limits": list(L2_LIMITS),
        "gradient_tolerance": GRAD_TOLERANCE,
        "max_iterations": LBFGS_MAX_ITER,
    }
    return {
        "selection": "validation split held out of the training images; test scored once",
        "linear": logistic,
        "knn": {"k": KNN_K, "T": KNN_T, "vote": "sum of exp(cos / T) over the k nearest"},
        "dense": {"probe": "linear, per patch, one per per-cell map", "max_patches": DENSE_MAX_PATCHES},
        "multilabel": {
            "probe": "one logistic regression per tag, binary cross-entropy summed over tags, swept as linear",
            "selection": "validation mean average precision",
            "metric": "mean average precision over the tags with a positive among the test images",
        },
        "attentive": {
            "lr": list(ATTENTIVE_LRS),
            "lr_limits": list(ATTENTIVE_LIMITS),
            "epochs": ATTENTIVE_EPOCHS,
            "min_steps": ATTENTIVE_MIN_STEPS,
        },
    }
