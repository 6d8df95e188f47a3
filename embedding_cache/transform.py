"""What a store does to T5's vectors before keeping them: an optional fixed PCA, then its codec.

Both are fitted once, when a store is made, on a deterministic sample of the captions being
embedded (`fit_transform`), and are part of the encoder recipe: the recipe records the
choices (`storage_dtype`, `projection.dim`, ...) and the sha256 of each fitted array, so two
stores share a recipe hash only if their vectors are comparable. The arrays live in the
store's root, readable by plain zarr::

    projection/mean          float32 [d]        vector = (t5_vector - mean) @ components.T
    projection/components    float32 [K, d]     (the top-K principal axes, largest first)
    channel_scales           float32 [w]        int8 only, when the fit chose pre-scaling

Every later embed into the store reuses them (`StoreTransform.load`, checked against the
recipe), so a resumed or parallel run stores exactly comparable vectors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.codec import CODECS, dequantize_numpy, fit_channel_scales, quantize_int8, token_dtype
from pipeline.core.errors import DataProblem, UserError

FIT_TOKENS = 65536  # token vectors in the fitting sample (captions taken by smallest key until this many)
PCA_BLOCK = 8192  # rows per covariance update
ROOT_ARRAYS = ("projection", "channel_scales")  # what a store root may hold besides `segments`


def array_sha256(array: np.ndarray) -> str:
    """sha256 of an array's row-major little-endian bytes: a checksum independent of zarr's file layout."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).data).hexdigest()


def codec_of(recipe: dict[str, Any]) -> str:
    """The store codec a recipe names (recipes written before there was a choice are float16)."""
    return str(recipe.get("storage_dtype", "float16"))


def root_arrays(recipe: dict[str, Any]) -> tuple[str, ...]:
    """The fitted arrays (of `ROOT_ARRAYS`) that a store of this recipe keeps in its root."""
    needed = {
        "projection": "projection" in recipe,
        "channel_scales": bool((recipe.get("int8") or {}).get("channel_scales_sha256")),
    }
    return tuple(name for name in ROOT_ARRAYS if needed[name])


def needs_fit(recipe: dict[str, Any]) -> bool:
    """Whether a store of this recipe is made only after fitting on a sample (a projection, or int8's scaling)."""
    return "projection" in recipe or codec_of(recipe) == "int8"


@dataclass(frozen=True)
class Projection:
    """A fixed linear map from T5's width d to K: `(x - mean) @ components.T`."""

    mean: np.ndarray  # float32 [d]
    components: np.ndarray  # float32 [K, d], orthonormal rows, largest variance first
    explained_variance: float  # fraction of the sample's variance the K axes keep

    def apply(self, vectors: np.ndarray) -> np.ndarray:
        return (np.asarray(vectors, dtype=np.float32) - self.mean) @ self.components.T


def fit_pca(sample: np.ndarray, dim: int) -> Projection:
    """PCA of `sample` (`[n, d]` token vectors) to `dim` axes, by an eigendecomposition of the covariance.

    The covariance is accumulated in float64 blocks (memory d² whatever the sample), and numpy's `eigh` is
    deterministic for the same input; each axis's sign is fixed (its largest entry positive), so the same sample
    always gives the same bytes.
    """
    n, d = sample.shape
    mean = np.zeros(d)
    for start in range(0, n, PCA_BLOCK):
        mean += np.asarray(sample[start : start + PCA_BLOCK], dtype=np.float64).sum(axis=0)
    mean /= n
    cov = np.zeros((d, d))
    for start in range(0, n, PCA_BLOCK):
        block = np.asarray(sample[start : start + PCA_BLOCK], dtype=np.float64) - mean
        cov += block.T @ block
    cov /= max(n - 1, 1)
    values, vectors = np.linalg.eigh(cov)
    order = np.argsort(values)[::-1][:dim]
    components = vectors[:, order].T
    signs = np.sign(components[np.arange(dim), np.abs(components).argmax(axis=1)])
    components *= np.where(signs == 0, 1.0, signs)[:, None]
    total = float(np.clip(values, 0, None).sum())
    kept = float(np.clip(values[order], 0, None).sum())
    return Projection(mean.astype(np.float32), components.astype(np.float32), kept / total if total > 0 else 1.0)


@dataclass(frozen=True)
class StoreTransform:
    """A store's projection (or none) and codec: T5 vectors in, stored arrays out."""

    codec: str
    projection: Projection | None = None
    channel_scales: np.ndarray | None = None  # float32 [width], int8 only

    @property
    def token_dtype(self) -> np.dtype:
        return token_dtype(self.codec)

    def encode(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, scales) to store for T5's `[n, d]` vectors: projected, then float16, or int8 + float32 scales."""
        projected = vectors if self.projection is None else self.projection.apply(vectors)
        if self.codec == "int8":
            return quantize_int8(projected, self.channel_scales)
        return np.asarray(projected, dtype=np.float16), None

    def roundtrip(self, vectors: np.ndarray) -> np.ndarray:
        """float32: what a reader of this store returns for T5's `vectors` (to compare fresh vectors with stored)."""
        tokens, scales = self.encode(vectors)
        return dequantize_numpy(tokens, scales, self.channel_scales, np.float32)

    @classmethod
    def load(cls, root: Path, recipe: dict[str, Any]) -> StoreTransform:
        """The transform of the store at `root`, its arrays checked against the sha256s its recipe records."""
        import zarr

        codec = codec_of(recipe)
        if codec not in CODECS:
            raise UserError(f"{root}: stores vectors as {codec!r}, which this tcjepa cannot read (it knows {CODECS})")

        def read(name: str, sha256: str) -> np.ndarray:
            try:
                array = np.asarray(zarr.open_array(str(root / name), mode="r")[:])
            except (FileNotFoundError, KeyError, ValueError):
                raise DataProblem(f"{root}/{name}: missing or unreadable; the store's recipe needs it") from None
            if array_sha256(array) != sha256:
                raise DataProblem(f"{root}/{name}: does not match the sha256 in the store's recipe (edited or damaged)")
            return array.astype(np.float32, copy=False)

        projection = None
        if "projection" in recipe:
            fitted = recipe["projection"]
            projection = Projection(
                read("projection/mean", fitted["mean_sha256"]),
                read("projection/components", fitted["components_sha256"]),
                float(fitted["explained_variance"]),
            )
        int8 = recipe.get("int8") or {}
        channel_scales = (
            read("channel_scales", int8["channel_scales_sha256"]) if int8.get("channel_scales_sha256") else None
        )
        return cls(codec, projection, channel_scales)

    def write(self, root: Path) -> None:
        """Write the fitted arrays into the store root at `root` (plain zarr arrays, one chunk each)."""
        import zarr

        group = zarr.open_group(str(root), mode="a", zarr_format=3)
        arrays: dict[str, np.ndarray] = {}
        if self.projection is not None:
            arrays["projection/mean"] = self.projection.mean
            arrays["projection/components"] = self.projection.components
        if self.channel_scales is not None:
            arrays["channel_scales"] = self.channel_scales
        for name, array in arrays.items():
            group.create_array(name, data=array, chunks=array.shape, compressors=None)


def fit_transform(
    sample: np.ndarray, codec: str, project_dim: int | None, captions: int
) -> tuple[dict[str, Any], StoreTransform]:
    """Fit a store's transform on `sample` (`[n, d]` T5 token vectors of `captions` captions); returns the recipe
    entries that record it and the transform."""
    entries: dict[str, Any] = {}
    fit = {"fit_captions": captions, "fit_tokens": len(sample)}
    projection = None
    if project_dim is not None:
        if len(sample) < project_dim:
            raise UserError(
                f"--project-dim {project_dim}: the fitting sample has only {len(sample)} token vectors; embed more "
                "captions or choose a smaller dimension"
            )
        projection = fit_pca(sample, project_dim)
        entries["projection"] = {
            "method": "pca",
            "dim": project_dim,
            "source_width": int(sample.shape[1]),
            "explained_variance": round(projection.explained_variance, 6),
            "mean_sha256": array_sha256(projection.mean),
            "components_sha256": array_sha256(projection.components),
            **fit,
        }
    channel_scales = None
    if codec == "int8":
        projected = sample if projection is None else projection.apply(sample)
        chosen = fit_channel_scales(projected)
        channel_scales = chosen.scales
        entries["int8"] = {
            "scaling": "per-token absmax",
            "channel_alpha": chosen.alpha,
            "channel_scales_sha256": None if channel_scales is None else array_sha256(channel_scales),
            "fit_min_cosine": round(chosen.min_cosine, 6),
            **fit,
        }
    return entries, StoreTransform(codec, projection, channel_scales)


def fit_summary(entries: dict[str, Any]) -> str:
    """What `fit_transform` chose, in words: the projection's explained variance, int8's pre-scaling."""
    parts = []
    if "projection" in entries:
        p = entries["projection"]
        parts.append(
            f"PCA {p['source_width']} -> {p['dim']} keeps {100 * p['explained_variance']:.1f}% of the variance of "
            f"{p['fit_tokens']} token vectors"
        )
    if "int8" in entries:
        q = entries["int8"]
        scaling = (
            "per-token absmax alone" if q["channel_alpha"] == 0 else f"channel pre-scaling RMS^{q['channel_alpha']}"
        )
        parts.append(f"int8 with {scaling} (worst token cosine {q['fit_min_cosine']:.5f} on {q['fit_tokens']} tokens)")
    return "; ".join(parts)


def requested(recipe: dict[str, Any]) -> dict[str, Any]:
    """The part of a recipe a user chooses (model, lengths, dtypes, codec, projection dim), without what was fitted."""
    out = {k: v for k, v in recipe.items() if k != "int8"}
    if "projection" in out:
        out["projection"] = {"method": out["projection"]["method"], "dim": out["projection"]["dim"]}
    out["storage_dtype"] = codec_of(recipe)
    return out


def is_fitted(recipe: dict[str, Any]) -> bool:
    """Whether `recipe` carries fitted entries (a store's full recipe), not only a request."""
    return "int8" in recipe or "mean_sha256" in recipe.get("projection", {})
