"""Frozen target-encoder features of a trained run, extracted once and cached beside it.

Evaluation, export and visualisation all start from the run's EMA target encoder
(the one the paper evaluates). Images are resized whole to the run's image size,
without a crop, so per-patch features line up with per-cell labels.

The cache lives in `RUN/features/<key>/`: `pooled.npy` (float32 `[n, D]`, mean over
patches), optionally `patches.npy` (float16 `[n, L, D]`) and `meta.json`. The key
covers the checkpoint step, the image size and every image's location, size and
modification time, so a new checkpoint or changed images give a new extraction; it
is written to a temporary directory and renamed, so an interrupted extraction
leaves nothing half-written.
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
from PIL import Image
from tqdm import tqdm

from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.images import decode
from pipeline.core.sources import ImageReader, ImageRef
from train.checkpoint import load_checkpoint
from train.config import TrainConfig, apply
from train.data import image_policy, normalise
from train.vit import VisionTransformer, build_vit

FEATURES_DIR = "features"


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
    encoder: VisionTransformer  # the EMA target encoder, eval mode, on CPU
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
    return TrainedRun(state, apply(TrainConfig(), state["config"], f"{run}/checkpoint.pt"), int(state["step"]))


def target_encoder(trained: TrainedRun) -> VisionTransformer:
    """The run's EMA target encoder, in eval mode, without gradients."""
    cfg = trained.config
    encoder = build_vit(cfg.model, cfg.image_size, cfg.patch_size, cfg.width, cfg.depth, cfg.heads)
    encoder.load_state_dict(trained.state["target"])
    return encoder.eval().requires_grad_(False)


def load_trained_encoder(run: Path) -> TrainedEncoder:
    """The target encoder of `run`'s checkpoint, with the run's config."""
    trained = load_run(run)
    return TrainedEncoder(target_encoder(trained), trained.config, trained.step)


def resize_whole(im: Image.Image, size: int) -> np.ndarray:
    """uint8 `[size, size, 3]`: the whole image resized (bicubic, no crop), as features are extracted."""
    return np.asarray(im.resize((size, size), Image.Resampling.BICUBIC), dtype=np.uint8)


class ResizedImages(torch.utils.data.Dataset):
    """Image i as uint8 `[3, S, S]` (the whole image resized, bicubic) and its original (width, height)."""

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
        pixels = resize_whole(im, self.size)
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), torch.tensor(im.size)


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def cache_key(step: int, image_size: int, refs: list[ImageRef]) -> str:
    """Digest of what the features depend on: checkpoint step, image size, each image's place and file stat."""
    h = hashlib.sha256(f"step={step};size={image_size};n={len(refs)}\n".encode())
    stats: dict[str, tuple[int, int]] = {}
    for ref in refs:
        if ref.path not in stats:
            stats[ref.path] = _stat(ref.path)
        h.update(
            f"{ref.source_id}\0{ref.kind}\0{ref.path}\0{ref.offset}\0{ref.size}\0{ref.column}\0{stats[ref.path]}\n".encode()
        )
    return h.hexdigest()[:16]


@dataclass
class Features:
    pooled: np.ndarray  # float32 [n, D]: mean over patches of the layer-normed tokens
    patches: np.ndarray | None  # float16 [n, L, D] (memory-mapped), when asked for
    sizes: np.ndarray  # int64 [n, 2]: original (width, height); (0, 0) where it could not be read or decoded
    step: int
    grid: tuple[int, int]
    directory: Path

    @property
    def decoded(self) -> np.ndarray:
        return self.sizes[:, 0] > 0


def _load(directory: Path, with_patches: bool, step: int, grid: tuple[int, int]) -> Features | None:
    meta_path = directory / "meta.json"
    if not meta_path.exists() or (with_patches and not (directory / "patches.npy").exists()):
        return None
    patches = np.load(directory / "patches.npy", mmap_mode="r") if with_patches else None
    return Features(np.load(directory / "pooled.npy"), patches, np.load(directory / "sizes.npy"), step, grid, directory)


def extract_features(
    run: Path,
    refs: list[ImageRef],
    with_patches: bool = False,
    device: str = "auto",
    batch_size: int = 64,
    workers: int = 2,
    progress: bool = True,
) -> Features:
    """Target-encoder features of `refs`, from the cache when it has them, else extracted and cached."""
    trained = load_run(run)
    cfg, grid = trained.config, trained.grid
    directory = Path(run) / FEATURES_DIR / cache_key(trained.step, cfg.image_size, refs)
    cached = _load(directory, with_patches, trained.step, grid)
    if cached is not None:
        return cached

    dev = resolve_device(device)
    encoder = target_encoder(trained).to(dev)
    n, dim = len(refs), encoder.width
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pooled = np.zeros((n, dim), dtype=np.float32)
    sizes = np.zeros((n, 2), dtype=np.int64)
    patches = (
        np.lib.format.open_memmap(tmp / "patches.npy", "w+", np.float16, (n, encoder.num_patches, dim))
        if with_patches
        else None
    )
    loader = torch.utils.data.DataLoader(
        ResizedImages(refs, cfg.image_size), batch_size=batch_size, num_workers=workers, pin_memory=dev.type == "cuda"
    )
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    done = 0
    with (
        torch.no_grad(),
        autocast,
        tqdm(total=n, desc="features", unit="img", disable=not progress, file=sys.stderr) as bar,
    ):
        for images, original in loader:
            tokens = encoder(normalise(images.to(dev, non_blocking=True))).float()
            rows = slice(done, done + len(images))
            pooled[rows] = tokens.mean(dim=1).cpu().numpy()
            sizes[rows] = original.numpy()
            if patches is not None:
                patches[rows] = tokens.to(torch.float16).cpu().numpy()
            done += len(images)
            bar.update(len(images))
    if patches is not None:
        patches.flush()
        del patches
    np.save(tmp / "pooled.npy", pooled)
    np.save(tmp / "sizes.npy", sizes)
    meta: dict[str, Any] = {
        "run": str(run),
        "step": trained.step,
        "images": n,
        "decoded": int((sizes[:, 0] > 0).sum()),
        "image_size": cfg.image_size,
        "grid": list(grid),
        "width": dim,
        "patches": with_patches,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    finished = _load(directory, with_patches, trained.step, grid)
    if finished is not None:  # another process finished the same extraction first
        shutil.rmtree(tmp)
        return finished
    if directory.exists():  # a pooled-only extraction, superseded by this one with patches
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    features = _load(directory, with_patches, trained.step, grid)
    assert features is not None
    return features
