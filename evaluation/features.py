"""Frozen features of a trained run, and of its floors, extracted once and cached beside the run.

Evaluation, export and visualisation start from one of the run's two encoders: the EMA target encoder (the one the
paper evaluates, by default) or the context encoder (`--encoder context`), of the newest checkpoint or of one the
run kept (`checkpoints/step-N.NAME.safetensors`, or under FSDP its shards). Images are resized as
`evaluation/preprocess.py` says (the field's centre crop, or the whole image for scenes). One pass over the images
gives up to four feature sets, so that no number is read without its floors:

- `encoder`: the run's encoder (pooled = mean over patches of the final LayerNorm's tokens);
- `baseline`: a randomly initialised encoder of the same architecture, seeded apart from the run (its own
  `floor_seed`: the run's starting weights are never its floor);
- `pixels`: the mean (normalised) colour of each patch; pooled = all of them, i.e. the image downsampled to
  the patch grid;
- `patch_pixels`: each patch's full (normalised) pixels, 3·p² values; pooled = their mean over patches, as the
  encoder's are pooled.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from evaluation.preprocess import CROP_FRACTION, prepare
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.images import decode
from pipeline.core.refs import ImageRef
from pipeline.core.sources import ImageReader
from train.checkpoint import CONTEXT_PREFIX, kept_encoder_steps, load_checkpoint, load_kept_encoders
from train.choices import VIT_SIZES
from train.config import ModelConfig, TrainConfig, apply, saved_config
from train.data import image_policy, normalise
from train.vit import VisionTransformer, build_vit

FEATURES_DIR = "features"
ENCODERS = ("target", "context")
FEATURE_SETS = ("encoder", "baseline", "pixels", "patch_pixels")
_FLOOR_STREAM = 0xF1005  # the random floor's seed stream, apart from every run seed


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


def kept_steps(run: Path) -> list[int]:
    """The steps whose two encoders the run kept (`train.checkpoint.kept_encoder_steps`)."""
    return kept_encoder_steps(Path(run))


def at_step(trained: TrainedRun, run: Path, step: int) -> TrainedRun:
    """`trained` with the encoders the run kept at `step` in place of its newest checkpoint's."""
    if step == trained.step:
        return trained
    encoders = load_kept_encoders(Path(run), step)
    if encoders is None:
        kept = ", ".join(map(str, kept_steps(run))) or "none"
        raise UserError(
            f"--steps {step}: {run} kept no encoders of step {step} (kept: {kept}); train with "
            "checkpoint_every_keep to keep more"
        )
    context = {CONTEXT_PREFIX + k: v for k, v in encoders["context_encoder"].items()}
    return TrainedRun({"target": encoders["target_encoder"], "model": context}, trained.config, step)


def floor_seed(eval_seed: int, run_seed: int) -> int:
    """The random floor's seed: drawn from the evaluation's `--seed` on a stream of its own (so that every run of a
    sweep shares its floor), never the run's seed (whose encoder would be the run's own starting weights)."""
    import numpy as np

    seed = int(np.random.SeedSequence([eval_seed, _FLOOR_STREAM]).generate_state(1)[0])
    return seed + 1 if seed == run_seed else seed


def _architecture(trained: TrainedRun) -> VisionTransformer:
    """The run's encoder as its saved model section builds it (untrained)."""
    return build_vit(**architecture(trained.config))


def run_encoder(trained: TrainedRun, which: str = "target") -> VisionTransformer:
    """The run's EMA target encoder or its context encoder, in eval mode, without gradients."""
    if which not in ENCODERS:
        raise UserError(f"--encoder {which}: choose target or context")
    encoder = _architecture(trained)
    if which == "target":
        weights = trained.state["target"]
    else:
        model = trained.state["model"]
        weights = {k.removeprefix(CONTEXT_PREFIX): v for k, v in model.items() if k.startswith(CONTEXT_PREFIX)}
    encoder.load_state_dict(weights)
    return encoder.eval().requires_grad_(False)


def random_encoder(trained: TrainedRun, seed: int) -> VisionTransformer:
    """The run's architecture as initialised for training, from generator seed `seed` (`floor_seed`): the
    baseline's encoder."""
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


def full_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """float `[B, L, 3·p²]`: each patch's pixels (row-major patches; channel, row, column within one) of normalised
    images `[B, 3, H, W]`: what the patch embedding reads."""
    return F.unfold(images, patch_size, stride=patch_size).transpose(1, 2)


def image_sizes(refs: Sequence[ImageRef]) -> list[tuple[int, int]]:
    """Each image's (width, height) once its EXIF orientation is applied, read from its header alone; (0, 0) where
    it cannot be read: what `--eval-resize auto` decides on."""
    from pipeline.core.images import open_image, oriented_size

    reader, out = ImageReader(), []
    for ref in refs:
        try:
            im, _ = open_image(reader.read(ref))
        except OSError:
            im = None
        out.append((0, 0) if im is None else oriented_size(im))
    return out


class EvalImages(torch.utils.data.Dataset):
    """Image i as uint8 `[3, S, S]` (placed by `geometry`) and its original (width, height)."""

    def __init__(self, refs: list[ImageRef], image_size: int, geometry: str = "crop") -> None:
        self.refs = refs
        self.size = image_size
        self.geometry = geometry
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
        pixels = prepare(im, self.size, self.geometry)
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), torch.tensor(im.size)


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def images_digest(image_size: int, refs: Sequence[ImageRef], geometry: str = "crop") -> str:
    """Digest of what any feature set of `refs` depends on besides the encoder: image size and placement, and each
    image's place and file stat, in order."""
    placed = f"crop={CROP_FRACTION}" if geometry == "crop" else "whole"
    h = hashlib.sha256(f"size={image_size};{placed};n={len(refs)}\n".encode())
    stats: dict[str, tuple[int, int]] = {}
    for ref in refs:
        if ref.path not in stats:
            stats[ref.path] = _stat(ref.path)
        h.update(
            f"{ref.source_id}\0{ref.kind}\0{ref.path}\0{ref.offset}\0{ref.size}\0{ref.column}\0{stats[ref.path]}\n".encode()
        )
    return h.hexdigest()


def cache_key(step: int, image_size: int, refs: list[ImageRef], geometry: str = "crop") -> str:
    """The feature cache's folder name: digest of the checkpoint step and :func:`images_digest`."""
    return hashlib.sha256(f"step={step};{images_digest(image_size, refs, geometry)}".encode()).hexdigest()[:16]


def architecture(config: TrainConfig) -> dict[str, Any]:
    """The encoder's architecture as the run's model section gives it: what the random baseline is built from."""
    return ModelConfig.of(config).encoder


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


def set_directory(name: str, seed: int, encoder: str = "target") -> str:
    """The cache folder of feature set `name` (the baseline's depends on its seed, the encoder's on which it is)."""
    if name == "baseline":
        return f"baseline-seed{seed}"
    return "context-encoder" if name == "encoder" and encoder == "context" else name


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
    floor_seed: int = 0,
    sets: tuple[str, ...] = FEATURE_SETS,
    trained: TrainedRun | None = None,
    encoder: str = "target",
    geometry: str = "crop",
) -> dict[str, Features]:
    """The feature `sets` of `refs` (of `FEATURE_SETS`: the run's `encoder`, target or context, the random baseline
    of generator seed `floor_seed`, the pixel floors), images placed by `geometry`, from the cache when it has
    them, else extracted in one pass over the images and cached. `trained`: the run as `load_run` (or `at_step`)
    gave it, when the caller has loaded it already (a sharded checkpoint is read whole)."""
    unknown = [name for name in sets if name not in FEATURE_SETS]
    if unknown:
        raise ValueError(f"unknown feature set {unknown[0]!r}; choose from {', '.join(FEATURE_SETS)}")
    if encoder not in ENCODERS:
        raise UserError(f"--encoder {encoder}: choose target or context")
    trained = trained or load_run(run)
    cfg, grid = trained.config, trained.grid
    directory = Path(run) / FEATURES_DIR / cache_key(trained.step, cfg.image_size, refs, geometry)
    folders = {name: directory / set_directory(name, floor_seed, encoder) for name in sets}
    found = {name: _load(folder, with_patches, trained.step, grid) for name, folder in folders.items()}
    missing = [name for name, features in found.items() if features is None]
    if missing:
        _extract(
            trained,
            refs,
            {name: folders[name] for name in missing},
            _Extraction(with_patches, device, batch_size, num_workers, progress, floor_seed, encoder, geometry),
            str(run),
        )
    out = {name: found[name] or _load(folders[name], with_patches, trained.step, grid) for name in sets}
    assert all(f is not None for f in out.values())
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class _Extraction:
    with_patches: bool
    device: str
    batch_size: int
    num_workers: int
    progress: bool
    floor_seed: int
    encoder: str
    geometry: str


def _extract(trained: TrainedRun, refs: list[ImageRef], folders: dict[str, Path], how: _Extraction, run: str) -> None:
    """One pass over `refs` computing the feature sets named in `folders`, each published to its folder."""
    cfg, grid, p = trained.config, trained.grid, trained.config.patch_size
    dev = resolve_device(how.device)
    encoders = {
        "encoder": lambda: run_encoder(trained, how.encoder),
        "baseline": lambda: random_encoder(trained, how.floor_seed),
    }
    models = {name: encoders[name]().to(dev) for name in folders if name in encoders}
    n, length, width = len(refs), grid[0] * grid[1], cfg.width or VIT_SIZES[cfg.model].width
    dims = {  # (pooled, per patch)
        "encoder": (width, width),
        "baseline": (width, width),
        "pixels": (3 * length, 3),
        "patch_pixels": (3 * p * p, 3 * p * p),
    }
    writers = {name: _SetWriter(folder, n, *dims[name], length, how.with_patches) for name, folder in folders.items()}
    sizes = np.zeros((n, 2), dtype=np.int64)
    loader = torch.utils.data.DataLoader(
        EvalImages(refs, cfg.image_size, how.geometry),
        batch_size=how.batch_size,
        num_workers=how.num_workers,
        pin_memory=dev.type == "cuda",
    )
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    done = 0
    with (
        torch.no_grad(),
        tqdm(total=n, desc="features", unit="img", disable=not how.progress, file=sys.stderr) as bar,
    ):
        for images, original in loader:
            x = normalise(images.to(dev, non_blocking=True))
            rows = slice(done, done + len(images))
            sizes[rows] = original.numpy()
            for name, writer in writers.items():
                if name == "pixels":
                    colours = pixel_patches(x, p)
                    writer.add(rows, colours.flatten(1), colours)
                elif name == "patch_pixels":
                    pixels = full_patches(x, p)
                    writer.add(rows, pixels.mean(dim=1), pixels)
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
        "geometry": how.geometry,
        "grid": list(grid),
        "patches": how.with_patches,
    }
    extra: dict[str, dict[str, Any]] = {"baseline": {"seed": how.floor_seed}, "encoder": {"encoder": how.encoder}}
    for name, writer in writers.items():
        writer.publish(sizes, {**meta, "set": name, **extra.get(name, {})})
