"""Frozen features of a trained run, and of its floors, extracted once and cached beside the run.

Evaluation, export and visualisation start from the run's EMA target encoder (the one the paper evaluates).
Images are resized and centre-cropped as the field does (evaluation/preprocess.py). One pass over the
images gives three feature sets, so that no number is read without its floors:

- `encoder`: the run's target encoder (pooled = mean over patches of the final LayerNorm's tokens);
- `baseline`: a randomly initialised encoder of the same architecture (seeded);
- `pixels`: the mean (normalised) colour of each patch; pooled = all of them, i.e. the image downsampled to
  the patch grid.

The cache lives in `RUN/features/<key>/<set>/`: `pooled.npy` (float32 `[n, D]`), optionally `patches.npy`
(float16 `[n, L, D]`), `sizes.npy` and `meta.json`. The key covers the checkpoint step, the image size, the
preprocessing and every image's location, size and modification time, so a new checkpoint or changed images
give a new extraction; each set is written to a temporary directory and renamed, so an interrupted
extraction leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from evaluation.preprocess import CROP_FRACTION, resize_and_crop
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.images import decode
from pipeline.core.sources import ImageReader, ImageRef
from train.checkpoint import load_checkpoint
from train.choices import VIT_SIZES
from train.config import TrainConfig, apply, saved_config
from train.data import image_policy, normalise
from train.vit import VisionTransformer, build_vit

FEATURES_DIR = "features"
ENCODERS = ("target", "context")
FEATURE_SETS = ("encoder", "baseline", "pixels")
_CONTEXT_PREFIX = "encoder."  # the context encoder inside the checkpoint's JEPA model


@dataclass
class TrainedRun:
    state: dict[str, Any]  # the checkpoint (memory-mapped tensors): model, target, optimizer, step, config
    config: TrainConfig
    step: int

    @property
    def grid(self) -> tuple[int, int]:
        side = self.config.image_size // self.config.patch_size
        return side, side


@dataclass
class TrainedEncoder:
    encoder: VisionTransformer  # eval mode, on CPU
    config: TrainConfig
    step: int


def load_run(run: Path) -> TrainedRun:
    """`run`'s checkpoint and config; a one-line error when there is no trained run there."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"{run}: no such run directory")
    state = load_checkpoint(run)
    if state is None:
        raise UserError(f"{run} has no checkpoint.pt yet; train it first (tcjepa train ... --out {run})")
    config = apply(TrainConfig(), saved_config(state["config"]), f"{run}/checkpoint.pt")
    return TrainedRun(state, config, int(state["step"]))


def _architecture(trained: TrainedRun) -> VisionTransformer:
    cfg = trained.config
    return build_vit(cfg.model, cfg.image_size, cfg.patch_size, cfg.width, cfg.depth, cfg.heads)


def run_encoder(trained: TrainedRun, which: str = "target") -> VisionTransformer:
    """The run's EMA target encoder or its context encoder, in eval mode, without gradients."""
    if which not in ENCODERS:
        raise UserError(f"--encoder {which}: choose target or context")
    encoder = _architecture(trained)
    if which == "target":
        weights = trained.state["target"]
    else:
        model = trained.state["model"]
        weights = {k.removeprefix(_CONTEXT_PREFIX): v for k, v in model.items() if k.startswith(_CONTEXT_PREFIX)}
    encoder.load_state_dict(weights)
    return encoder.eval().requires_grad_(False)


def random_encoder(trained: TrainedRun, seed: int) -> VisionTransformer:
    """The run's architecture as initialised for training, from a seeded generator: the baseline's encoder."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = _architecture(trained)
    return encoder.eval().requires_grad_(False)


def load_trained_encoder(run: Path, which: str = "target") -> TrainedEncoder:
    """The target (or context) encoder of `run`'s checkpoint, with the run's config."""
    trained = load_run(run)
    return TrainedEncoder(run_encoder(trained, which), trained.config, trained.step)


def pixel_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """float `[B, L, 3]`: the mean colour of each patch (row-major) of normalised images `[B, 3, H, W]`."""
    return F.avg_pool2d(images, patch_size).flatten(2).transpose(1, 2)


class EvalImages(torch.utils.data.Dataset):
    """Image i as uint8 `[3, S, S]` (resized and centre-cropped) and its original (width, height)."""

    def __init__(self, refs: list[ImageRef], image_size: int) -> None:
        self.refs = refs
        self.size = image_size
        self.policy = image_policy(image_size)
        self.reader = ImageReader()

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixels, original (width, height)); (0, 0) where the image could not be read or decoded."""
        try:
            data = self.reader.read(self.refs[i])
        except OSError:
            data = None
        im, _ = decode(data, self.policy)
        if im is None:
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
        pixels = resize_and_crop(im, self.size)
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), torch.tensor(im.size)


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def images_digest(image_size: int, refs: list[ImageRef]) -> str:
    """Digest of what any feature set of `refs` depends on besides the encoder: image size and crop, and each
    image's place and file stat, in order."""
    h = hashlib.sha256(f"size={image_size};crop={CROP_FRACTION};n={len(refs)}\n".encode())
    stats: dict[str, tuple[int, int]] = {}
    for ref in refs:
        if ref.path not in stats:
            stats[ref.path] = _stat(ref.path)
        h.update(
            f"{ref.source_id}\0{ref.kind}\0{ref.path}\0{ref.offset}\0{ref.size}\0{ref.column}\0{stats[ref.path]}\n".encode()
        )
    return h.hexdigest()


def cache_key(step: int, image_size: int, refs: list[ImageRef]) -> str:
    """The feature cache's folder name: digest of the checkpoint step and :func:`images_digest`."""
    return hashlib.sha256(f"step={step};{images_digest(image_size, refs)}".encode()).hexdigest()[:16]


def architecture(config: TrainConfig) -> dict[str, Any]:
    """The encoder's architecture as the run's config gives it: what the random baseline is built from."""
    return {k: getattr(config, k) for k in ("model", "image_size", "patch_size", "width", "depth", "heads")}


@dataclass
class Features:
    pooled: np.ndarray  # float32 [n, D]: mean over patches of the layer-normed tokens (pixels: every patch's colour)
    patches: np.ndarray | None  # float16 [n, L, D] (memory-mapped), when asked for
    sizes: np.ndarray  # int64 [n, 2]: original (width, height); (0, 0) where it could not be read or decoded
    step: int
    grid: tuple[int, int]
    image_size: int
    directory: Path

    @property
    def decoded(self) -> np.ndarray:
        return self.sizes[:, 0] > 0


def _load(directory: Path, with_patches: bool, step: int, grid: tuple[int, int]) -> Features | None:
    meta_path = directory / "meta.json"
    if not meta_path.exists() or (with_patches and not (directory / "patches.npy").exists()):
        return None
    patches = np.load(directory / "patches.npy", mmap_mode="r") if with_patches else None
    size = int(json.loads(meta_path.read_text())["image_size"])
    return Features(
        np.load(directory / "pooled.npy"), patches, np.load(directory / "sizes.npy"), step, grid, size, directory
    )


def set_directory(name: str, seed: int) -> str:
    """The cache folder of feature set `name` (the baseline's depends on its seed)."""
    return f"baseline-seed{seed}" if name == "baseline" else name


class _SetWriter:
    """Fills one feature set's arrays batch by batch in a temporary directory, then publishes it."""

    def __init__(self, final: Path, n: int, dim: int, patch_dim: int, length: int, with_patches: bool) -> None:
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.pooled = np.zeros((n, dim), dtype=np.float32)
        self.patches = (
            np.lib.format.open_memmap(self.tmp / "patches.npy", "w+", np.float16, (n, length, patch_dim))
            if with_patches
            else None
        )

    def add(self, rows: slice, pooled: torch.Tensor, patches: torch.Tensor) -> None:
        self.pooled[rows] = pooled.float().cpu().numpy()
        if self.patches is not None:
            self.patches[rows] = patches.to(torch.float16).cpu().numpy()

    def publish(self, sizes: np.ndarray, meta: dict[str, Any]) -> None:
        if self.patches is not None:
            self.patches.flush()
            self.patches = None
        np.save(self.tmp / "pooled.npy", self.pooled)
        np.save(self.tmp / "sizes.npy", sizes)
        (self.tmp / "meta.json").write_text(json.dumps({**meta, "width": self.pooled.shape[1]}, indent=1) + "\n")
        with_patches = (self.tmp / "patches.npy").exists()
        if (self.final / "meta.json").exists() and (not with_patches or (self.final / "patches.npy").exists()):
            shutil.rmtree(self.tmp)  # another process finished the same extraction first
            return
        if self.final.exists():  # a pooled-only extraction, superseded by this one with patches
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)


def extract_features(
    run: Path,
    refs: list[ImageRef],
    with_patches: bool = False,
    device: str = "auto",
    batch_size: int = 64,
    num_workers: int = 2,
    progress: bool = True,
    seed: int = 0,
    sets: tuple[str, ...] = FEATURE_SETS,
    trained: TrainedRun | None = None,
) -> dict[str, Features]:
    """The feature `sets` of `refs` (of `FEATURE_SETS`: the run's target encoder, the seeded random baseline,
    pixels), from the cache when it has them, else extracted in one pass over the images and cached. `trained`:
    the run as `load_run` gave it, when the caller has loaded it already (a sharded checkpoint is read whole)."""
    unknown = [name for name in sets if name not in FEATURE_SETS]
    if unknown:
        raise ValueError(f"unknown feature set {unknown[0]!r}; choose from {', '.join(FEATURE_SETS)}")
    trained = trained or load_run(run)
    cfg, grid = trained.config, trained.grid
    directory = Path(run) / FEATURES_DIR / cache_key(trained.step, cfg.image_size, refs)
    folders = {name: directory / set_directory(name, seed) for name in sets}
    found = {name: _load(folder, with_patches, trained.step, grid) for name, folder in folders.items()}
    missing = [name for name, features in found.items() if features is None]
    if missing:
        _extract(
            trained,
            refs,
            {name: folders[name] for name in missing},
            with_patches,
            device,
            batch_size,
            num_workers,
            progress,
            seed,
            str(run),
        )
    out = {name: found[name] or _load(folders[name], with_patches, trained.step, grid) for name in sets}
    assert all(f is not None for f in out.values())
    return out  # type: ignore[return-value]


def _extract(
    trained: TrainedRun,
    refs: list[ImageRef],
    folders: dict[str, Path],
    with_patches: bool,
    device: str,
    batch_size: int,
    num_workers: int,
    progress: bool,
    seed: int,
    run: str,
) -> None:
    """One pass over `refs` computing the feature sets named in `folders`, each published to its folder."""
    cfg, grid = trained.config, trained.grid
    dev = resolve_device(device)
    encoders = {"encoder": lambda: run_encoder(trained), "baseline": lambda: random_encoder(trained, seed)}
    models = {name: encoders[name]().to(dev) for name in folders if name in encoders}
    n, length, width = len(refs), grid[0] * grid[1], cfg.width or VIT_SIZES[cfg.model].width
    dims = {"encoder": (width, width), "baseline": (width, width), "pixels": (3 * length, 3)}  # (pooled, per patch)
    writers = {name: _SetWriter(folder, n, *dims[name], length, with_patches) for name, folder in folders.items()}
    sizes = np.zeros((n, 2), dtype=np.int64)
    loader = torch.utils.data.DataLoader(
        EvalImages(refs, cfg.image_size), batch_size=batch_size, num_workers=num_workers, pin_memory=dev.type == "cuda"
    )
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    done = 0
    with (
        torch.no_grad(),
        tqdm(total=n, desc="features", unit="img", disable=not progress, file=sys.stderr) as bar,
    ):
        for images, original in loader:
            x = normalise(images.to(dev, non_blocking=True))
            rows = slice(done, done + len(images))
            sizes[rows] = original.numpy()
            for name, writer in writers.items():
                if name == "pixels":
                    colours = pixel_patches(x, cfg.patch_size)
                    writer.add(rows, colours.flatten(1), colours)
                else:
                    with autocast:
                        tokens = models[name](x).float()
                    writer.add(rows, tokens.mean(dim=1), tokens)
            done += len(images)
            bar.update(len(images))
    meta = {
        "run": run,
        "step": trained.step,
        "images": n,
        "decoded": int((sizes[:, 0] > 0).sum()),
        "image_size": cfg.image_size,
        "crop_fraction": CROP_FRACTION,
        "grid": list(grid),
        "patches": with_patches,
    }
    for name, writer in writers.items():
        writer.publish(sizes, {**meta, "set": name, **({"seed": seed} if name == "baseline" else {})})
