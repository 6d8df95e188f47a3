"""The training configuration: one flat dataclass, filled from defaults < YAML < CLI flags < `--set key=value`.

Every field is documented in `FIELD_HELP` (shown by `tcjepa train --help-config`)
and type-checked when set, so a typo or a wrong type is a one-line error, not
a silently ignored option.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.errors import UserError
from pipeline.core.keyvalues import parse_key_values
from train.masks import MaskConfig


@dataclass
class TrainConfig:
    # data
    images: list[str] = field(default_factory=list)
    cache: str | None = None
    store: str | None = None
    mirror: str | None = None
    recipes: list[str] = field(default_factory=list)
    image_column: str | None = None
    min_coverage: float = 0.95
    captions_per_image: int = 8
    max_words: int = 128
    val_images: int = 32
    crop_scale: tuple[float, float] = (0.3, 1.0)
    crop_ratio: tuple[float, float] = (0.75, 1.3333333333333333)
    hflip: bool = False
    num_workers: int = 2
    # model
    model: str = "vit_base"
    width: int | None = None
    depth: int | None = None
    heads: int | None = None
    patch_size: int = 16
    image_size: int = 224
    predictor_width: int = 384
    predictor_depth: int | None = None
    predictor_heads: int | None = None
    conditioning: str = "cross"
    pool: str = "after_mlp"
    # masks
    num_targets: int = MaskConfig.num_targets
    target_scale: tuple[float, float] = MaskConfig.target_scale
    target_aspect: tuple[float, float] = MaskConfig.target_aspect
    context_scale: tuple[float, float] = MaskConfig.context_scale
    context_aspect: tuple[float, float] = MaskConfig.context_aspect
    min_context: int = MaskConfig.min_context
    # objective
    loss: str = "l2"
    lambda_sparse: float = 0.1
    beta_consistency: float = 0.5
    # optimisation
    batch_size: int = 64
    steps: int = 1000
    lr: float = 1e-3
    start_lr: float = 2e-4
    final_lr: float = 1e-6
    warmup_steps: int = 100
    text_lr_scale: float = 1.0
    weight_decay: tuple[float, float] = (0.04, 0.4)
    betas: tuple[float, float] = (0.9, 0.999)
    ema: tuple[float, float] = (0.996, 1.0)
    grad_clip: float = 0.0
    # runtime
    seed: int = 0
    device: str = "auto"
    bf16: bool = True
    compile: bool = False
    fsdp: bool = False
    log_every: int = 10
    val_every: int = 100
    checkpoint_every: int = 200


FIELD_HELP: dict[str, str] = {
    "images": "image sources (folders, .parquet, HF datasets dirs, .tar shards), as for `tcjepa caption`",
    "cache": "caption cache directory (needed unless conditioning is none)",
    "store": "embedding store made by `tcjepa embed` from that cache",
    "mirror": "local directory for copies of a cache or store given as an fsspec URL (s3://...); default "
    "~/.cache/tcjepa/mirror",
    "recipes": "caption recipes to train on (names or hash prefixes); required when the cache holds several",
    "image_column": "image column of Parquet / HF datasets sources",
    "min_coverage": "stop unless at least this fraction of images has ≥1 caption (0 disables)",
    "captions_per_image": "N: captions per image per step (a random N of those available when there are more)",
    "max_words": "longest caption, in tokens, fed to the predictor (longer ones are cut)",
    "val_images": "images held out for the fixed validation batch",
    "crop_scale": "random resized crop: range of the crop's area fraction",
    "crop_ratio": "random resized crop: range of the crop's aspect ratio",
    "hflip": "random horizontal flip (off: captions say left and right)",
    "num_workers": "DataLoader worker processes per rank",
    "model": "encoder size: vit_tiny, vit_small, vit_base, vit_large, vit_huge, vit_giant",
    "width": "override the encoder width (custom sizes)",
    "depth": "override the encoder depth",
    "heads": "override the encoder's attention heads",
    "patch_size": "patch side in pixels (must divide image_size)",
    "image_size": "training image side in pixels",
    "predictor_width": "predictor width",
    "predictor_depth": "predictor depth (default: by model size, 6 / 12 for large and huge / 16 for giant)",
    "predictor_heads": "predictor attention heads (default: the encoder's)",
    "conditioning": "none (I-JEPA), sequence (caption tokens appended once), cross (TC-JEPA)",
    "pool": "cross mode: max-pool over captions after_mlp (literal) or before_mlp (one shared MLP, N× cheaper)",
    "num_targets": "target blocks per image",
    "target_scale": "target block area as a fraction of the image",
    "target_aspect": "target block aspect ratio (height / width)",
    "context_scale": "context block area as a fraction of the image",
    "context_aspect": "context block aspect ratio",
    "min_context": "fewest context patches an image may keep after removing targets",
    "loss": "prediction distance: l2 (squared error) or smooth_l1",
    "lambda_sparse": "λ, weight of the patch–word sparsity regulariser (cross mode)",
    "beta_consistency": "β, weight of the cross-layer consistency regulariser (cross mode)",
    "batch_size": "global batch size (all ranks together; divisible by the number of processes)",
    "steps": "optimizer steps in the whole run",
    "lr": "peak learning rate",
    "start_lr": "learning rate at step 0 (linear warmup to lr)",
    "final_lr": "learning rate at the last step (cosine from lr)",
    "warmup_steps": "linear warmup steps",
    "text_lr_scale": "learning-rate multiplier for the text conditioner's parameters",
    "weight_decay": "weight decay, cosine from the first value to the second (not on biases and 1-D params)",
    "betas": "AdamW betas",
    "ema": "target-encoder EMA momentum, linear from the first value to the second",
    "grad_clip": "clip the gradient norm to this value (0: off)",
    "seed": "seed for weights, data order, crops, masks and caption sampling",
    "device": "auto (cuda if present), cpu, cuda, cuda:N",
    "bf16": "bf16 autocast (no GradScaler is needed for bf16)",
    "compile": "torch.compile the encoder and predictor",
    "fsdp": "shard the models with FSDP (for vit_huge / vit_giant) instead of DDP",
    "log_every": "steps between metrics.jsonl lines",
    "val_every": "steps between validation passes",
    "checkpoint_every": "steps between checkpoints",
}

# Options that change neither the data nor the maths: a resumed run may change them.
RUNTIME_ONLY = {
    "num_workers",
    "device",
    "compile",
    "log_every",
    "val_every",
    "checkpoint_every",
    "images",
    "cache",
    "store",
    "mirror",
}


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """`value` converted to the field's type, or a UserError that names the key and the expected type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(name, value, inner[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"config key {name!r}: expected {len(args)} numbers like [a, b], got {value!r}")
        return tuple(_check_type(name, v, a) for v, a in zip(value, args))
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"config key {name!r}: expected a list, got {value!r}")
        return [_check_type(name, v, args[0]) for v in value]
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"config key {name!r}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config key {name!r}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise UserError(f"config key {name!r}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config key {name!r}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, Path)):
            raise UserError(f"config key {name!r}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type {hint} for {name}")


_HINTS = typing.get_type_hints(TrainConfig)
FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def apply(config: TrainConfig, updates: dict[str, Any], where: str) -> TrainConfig:
    """A copy of `config` with `updates` type-checked and applied; unknown keys are refused."""
    for key in updates:
        if key not in _HINTS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{where}: unknown config key {key!r}{hint}; see `tcjepa train --help-config`")
    checked = {key: _check_type(key, value, _HINTS[key]) for key, value in updates.items()}
    return dataclasses.replace(config, **checked)


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise UserError(f"--config {path}: expected a mapping of config keys, got {type(doc).__name__}")
    return doc


def parse_set(pairs: list[str]) -> dict[str, Any]:
    """`--set key=value` overrides (`--set ema=[0.99,1.0]`)."""
    return parse_key_values(pairs, "--set", "lr=5e-4")


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain YAML/JSON-ready values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Keys (other than runtime-only ones) whose value differs between a saved run and this config."""
    now = to_dict(current)
    return [k for k in FIELDS if k not in RUNTIME_ONLY and saved.get(k) != now[k]]


CHOICES = {
    "conditioning": ("none", "sequence", "cross"),
    "pool": ("after_mlp", "before_mlp"),
    "loss": ("l2", "smooth_l1"),
    "model": ("vit_tiny", "vit_small", "vit_base", "vit_large", "vit_huge", "vit_giant"),
}
POSITIVE = (
    "captions_per_image",
    "max_words",
    "patch_size",
    "image_size",
    "predictor_width",
    "num_targets",
    "batch_size",
    "steps",
    "log_every",
    "val_every",
    "checkpoint_every",
)


def validate(config: TrainConfig) -> None:
    """Refuse settings that cannot work, with a one-line reason, before anything is built."""
    for key, allowed in CHOICES.items():
        if getattr(config, key) not in allowed:
            raise UserError(f"{key} must be one of {', '.join(allowed)}, got {getattr(config, key)!r}")
    for key in POSITIVE:
        if getattr(config, key) < 1:
            raise UserError(f"{key} must be at least 1, got {getattr(config, key)}")
    if config.image_size % config.patch_size:
        raise UserError(f"patch_size {config.patch_size} does not divide image_size {config.image_size}")
    if config.warmup_steps < 0 or config.num_workers < 0 or config.val_images < 1:
        raise UserError("warmup_steps and num_workers must be >= 0 and val_images >= 1")
    if not 0.0 <= config.min_coverage <= 1.0:
        raise UserError(f"min_coverage must be in [0, 1], got {config.min_coverage}")
    if config.lambda_sparse < 0 or config.beta_consistency < 0:
        raise UserError("lambda_sparse and beta_consistency must be >= 0")
    if not (0 < config.crop_scale[0] <= config.crop_scale[1] <= 1 and 0 < config.crop_ratio[0] <= config.crop_ratio[1]):
        raise UserError(
            f"crop_scale must satisfy 0 < low <= high <= 1 and crop_ratio 0 < low <= high; got {config.crop_scale}, "
            f"{config.crop_ratio}"
        )
    if config.conditioning != "none" and not (config.cache and config.store):
        raise UserError(f"conditioning {config.conditioning} needs --cache and --store (or use --conditioning none)")
    try:
        MaskConfig(
            config.num_targets,
            config.target_scale,
            config.target_aspect,
            config.context_scale,
            config.context_aspect,
            config.min_context,
        )
    except ValueError as exc:
        raise UserError(f"mask settings: {exc}") from None
