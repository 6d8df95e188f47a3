"""The training configuration: one flat dataclass, filled from defaults < YAML < CLI flags < `--set key=value`
(`resolve`, which the CLI and any Python caller of `train.loop.run_training` use).

Every field carries its help text (shown by `tcjepa train --help-config`)
and type-checked when set, so a typo or a wrong type is a one-line error, not
a silently ignored option.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.devices import DEVICE_HELP
from pipeline.core.errors import UserError
from pipeline.core.keyvalues import parse_key_values
from pipeline.core.sources import HF_PREFIX
from train.choices import (
    ATTENTION,
    CONDITIONERS,
    CONDITIONING,
    CONTEXT_EQUALISE,
    DECODERS,
    DEVICE_RESIZE,
    LOSSES,
    MODELS,
    POOLING,
    REGULARISER_COSINES,
    VIT_SIZES,
)
from train.masks import MaskConfig, sample_masks

logger = logging.getLogger(__name__)

AUTO = "auto"  # a setting chosen for the run (`resolve_automatic`), said in one line
# ema auto: I-JEPA's start, lowered for short runs until at most this share of the starting weights is left.
REFERENCE_EMA_START, EMA_LEFT_OF_START = 0.996, 0.05
# The automatic validation set: this many images, or 10% of them when that is fewer.
DEFAULT_VAL_IMAGES = 32
# A loader worker builds ~250 images/s with PIL (a 128-image batch in ~0.5 s); a compiled B/16 step eats ~800-950
# per GPU: 4 keep up, 8 leave room for larger images and slower disks.
MAX_LOADER_WORKERS = 8
# The automatic min_context: I-JEPA's 10 context patches on its 14×14 grid, scaled to the run's grid.
REFERENCE_MIN_CONTEXT, REFERENCE_GRID_PATCHES = 10, 14 * 14
# Steps whose masks `validate` draws to refuse mask settings that leave no context before anything is built.
MASK_CHECK_STEPS = 8

# Keys an older tcjepa did not write, with the value its runs had: a saved config without them is read so.
ADDED_KEYS: dict[str, Any] = {"conditioner": "mha"}
# Values an older tcjepa wrote that mean something else now: (key, old value) -> (new value, why).
RENAMED_VALUES: dict[tuple[str, Any], tuple[Any, str]] = {
    ("loss", "l2"): ("mse", "element-wise squared error, what `l2` meant before the paper's `norm` became the default"),
}


def setting(default: Any, help: str) -> Any:
    """A config field with its help text; a list default is copied for each config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def field_help(name: str) -> str:
    """What config key `name` does (from its field)."""
    return str(next(f for f in dataclasses.fields(TrainConfig) if f.name == name).metadata["help"])


def describe_keys() -> str:
    """Every config key with what it does and its default, a line each (`tcjepa train --help-config`)."""
    lines = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if callable(f.default_factory) else f.default
        lines.append(f"{f.name:<20} {f.metadata['help']} (default: {default!r})")
    return "\n".join(lines)


@dataclass
class TrainConfig:
    """Every setting of a training run. Each field says what it does (`tcjepa train --help-config` lists them);
    `apply` type-checks values set from YAML or the command line, `validate` refuses combinations that cannot work."""

    # data
    images: list[str] = setting(
        [],
        "image sources (folders, .parquet, HF datasets dirs, .tar shards), as for `tcjepa caption`; tar shards may be "
        "fsspec URLs (s3://bucket/shard.tar, or a prefix holding .tar shards): each node fetches the shards of its "
        "partitions into --mirror, checked against the index, and reads only those copies",
    )
    cache: str | None = setting(
        None,
        "caption cache: a directory or an fsspec URL such as s3://bucket/cache, mirrored locally (needed unless "
        "conditioning is none)",
    )
    store: str | None = setting(
        None, "embedding store made by `tcjepa embed` from that cache: a directory or an fsspec URL (mirrored locally)"
    )
    mirror: str | None = setting(
        None,
        "local directory for copies of a cache, store or image tar shards given as fsspec URLs (s3://...); "
        "default ~/.cache/tcjepa/mirror",
    )
    recipes: list[str] = setting(
        [], "caption recipes to train on (names or hash prefixes); required when the cache holds several"
    )
    image_column: str | None = setting(None, "image column of Parquet / HF datasets sources")
    split: str = setting("train", "split of hf:PATH_OR_ID image sources (datasets.load_dataset) that do not name one")
    min_coverage: float = setting(0.95, "stop unless at least this fraction of images has ≥1 caption (0 disables)")
    captions_per_image: int = setting(
        8, "N: captions per image per step (a random N of those available when there are more)"
    )
    max_words: int = setting(128, "longest caption, in tokens, fed to the predictor (longer ones are cut)")
    val_images: int = setting(
        0,
        f"images held out for the fixed validation batch (0: automatic, min({DEFAULT_VAL_IMAGES}, 10% of the images))",
    )
    crop_scale: tuple[float, float] = setting((0.3, 1.0), "random resized crop: range of the crop's area fraction")
    crop_ratio: tuple[float, float] = setting(
        (0.75, 1.3333333333333333), "random resized crop: range of the crop's aspect ratio"
    )
    hflip: bool = setting(False, "random horizontal flip (off: captions say left and right)")
    num_workers: int | None = setting(
        None,
        "DataLoader worker processes per rank (0: load in the training process; default: the CPUs this process may "
        f"use, shared among the node's ranks, less one for each rank's step, at most {MAX_LOADER_WORKERS})",
    )
    decode: str = setting(
        "cpu",
        f"{' | '.join(DECODERS)}: where training images are decoded; gpu decodes each batch's JPEGs with nvJPEG on "
        "the CUDA device and crops and resizes there (other images, and runs without CUDA, decode on the CPU)",
    )
    device_resize: str = setting(
        "per_image",
        f"{' | '.join(DEVICE_RESIZE)}: with --decode gpu, each crop resized in its own call (torchvision's resize, a "
        "few kernels an image), or all of a batch's crops at once by two batched matrix products with the same "
        "antialiased bilinear weights (a pixel may differ by one level); which is faster, benchmarks/gpu_check.sh "
        "--phase input measures",
    )
    verify_images: bool = setting(
        False,
        "before training, check every image's sha256 against the run index (a file changed since the index was "
        "built stops the run); otherwise images are hashed only when the index is built",
    )
    # model
    model: str = setting("vit_base", f"encoder size: {', '.join(MODELS)}")
    width: int | None = setting(None, "override the encoder width (custom sizes)")
    depth: int | None = setting(None, "override the encoder depth")
    heads: int | None = setting(None, "override the encoder's attention heads")
    patch_size: int = setting(16, "patch side in pixels (must divide image_size)")
    image_size: int = setting(224, "training image side in pixels")
    predictor_width: int = setting(384, "predictor width")
    predictor_depth: int | None = setting(
        None, "predictor depth (default: by model size, 6 / 12 for large and huge / 16 for giant)"
    )
    predictor_heads: int | None = setting(None, "predictor attention heads (default: the encoder's)")
    conditioning: str = setting(
        "cross", f"{' | '.join(CONDITIONING)}: I-JEPA; caption tokens appended to the predictor's input; TC-JEPA"
    )
    pool: str = setting(
        "after_mlp",
        f"cross mode, {' | '.join(POOLING)}: max-pool over captions after each caption's MLP (the paper's, literally) "
        "or before one shared MLP (N× cheaper)",
    )
    conditioner: str = setting(
        "paper",
        f"cross mode, {' | '.join(CONDITIONERS)}: the paper's bias-free W_Q, W_K, W_V with no output projection "
        "(every update depends on the words), or standard multi-head attention with biases and an output "
        "projection (a content-free path: the ablation)",
    )
    # masks
    num_targets: int = setting(MaskConfig.num_targets, "target blocks per image")
    target_scale: tuple[float, float] = setting(MaskConfig.target_scale, "target block area as a fraction of the image")
    target_aspect: tuple[float, float] = setting(MaskConfig.target_aspect, "target block aspect ratio (height / width)")
    context_scale: tuple[float, float] = setting(
        MaskConfig.context_scale, "context block area as a fraction of the image"
    )
    context_aspect: tuple[float, float] = setting(MaskConfig.context_aspect, "context block aspect ratio")
    min_context: int = setting(
        0,
        "fewest context patches an image may keep after removing targets (0: automatic, I-JEPA's 10 per 14×14 grid "
        "scaled to this grid, at least 1)",
    )
    context_equalise: str = setting(
        MaskConfig.context_equalise,
        f"{' | '.join(CONTEXT_EQUALISE)}: every image keeps the context it sampled, rows padded and the padding masked "
        "out of attention; or I-JEPA's cut of every context to the batch's smallest (makes the task depend on the "
        "batch size)",
    )
    # objective
    loss: str = setting(
        "norm",
        f"prediction distance, {' | '.join(LOSSES)}: mean per-patch L2 norm ‖ẑ − z‖₂ (the paper's); element-wise "
        "squared error (weighs λ and β ~√D more); smooth-L1 (I-JEPA's code). A saved `l2` is read as mse",
    )
    lambda_sparse: float = setting(0.1, "λ, weight of the patch–word sparsity regulariser (cross mode)")
    beta_consistency: float = setting(0.5, "β, weight of the cross-layer consistency regulariser (cross mode)")
    regulariser_cosine: str = setting(
        "full",
        f"{' | '.join(REGULARISER_COSINES)}: the regularisers' patch–word cosine, of the full projected vectors (the "
        "paper's formula), or per attention head with each caption's keys centred over its words (what the softmax "
        "acts on; a shift shared by all words cannot make every cosine negative)",
    )
    sigreg: float = setting(
        0.0,
        "weight of LeJEPA's SIGReg on the context encoder's tokens (their projections on random directions pushed "
        "towards N(0, 1), an anti-collapse term; 0: off, the paper's objective)",
    )
    sigreg_directions: int = setting(256, "random directions SIGReg projects on (drawn anew each step)")
    # optimisation
    batch_size: int = setting(64, "global batch size (all ranks together; divisible by the number of processes)")
    partitions: int = setting(
        1,
        "canonical partitions of the images, along store segments or tar shards: each node of N (N dividing P) reads "
        "and mirrors only its P/N partitions, and every step is the same on any such N (batch_size divisible by P)",
    )
    steps: int = setting(1000, "optimizer steps in the whole run")
    lr: float = setting(1e-3, "peak learning rate")
    start_lr: float = setting(2e-4, "learning rate at step 0 (linear warmup to lr)")
    final_lr: float = setting(1e-6, "learning rate at the last step (cosine from lr)")
    warmup_steps: int = setting(100, "linear warmup steps")
    text_lr_scale: float = setting(1.0, "learning-rate multiplier for the text conditioner's parameters")
    weight_decay: tuple[float, float] = setting(
        (0.04, 0.4), "weight decay, cosine from the first value to the second (not on biases and 1-D params)"
    )
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas")
    ema: tuple[float, float] | str = setting(
        "auto",
        "target-encoder EMA momentum, linear from the first value to the second; auto: from I-JEPA's 0.996 (or "
        "lower, for a run too short to wash out the starting weights: the largest start that leaves at most 5% of "
        "them in the target encoder at the end) to 1.0",
    )
    grad_clip: float = setting(0.0, "clip the gradient norm to this value (0: off)")
    # runtime
    seed: int = setting(0, "seed for weights, data order, crops, masks and caption sampling")
    device: str = setting("auto", DEVICE_HELP)
    bf16: bool = setting(
        True,
        "bf16 autocast (no GradScaler needed) where the device computes bf16; a CPU without AVX512-BF16 or AMX "
        "runs float32",
    )
    compile: bool = setting(
        False,
        "torch.compile each encoder and predictor block (batch, sequence and caption lengths marked dynamic: one "
        "graph for every step's masks and captions), and the text regularisers' two passes over the cosine maps",
    )
    checkpoint_activations: bool = setting(
        False, "recompute each encoder and predictor block in the backward instead of keeping its activations"
    )
    attention: str = setting(
        "masked",
        f"{' | '.join(ATTENTION)}: how packed contexts and (none, cross) predictor sequences attend: in rows padded "
        "to the longest with a key mask, or each row's real tokens alone as nested jagged tensors (flash's "
        "variable-length kernel on CUDA; on a CPU a slow reference; not with --compile off CUDA nor with "
        "--checkpoint-activations). The same values either way; which is faster on a GPU, "
        "benchmarks/gpu_check.sh --phase attention measures",
    )
    accum_steps: int = setting(
        1, "micro-batches per step: a process's rows are split in this many, one backward each, one optimizer step"
    )
    fsdp: bool = setting(False, "shard the models with FSDP2 (for vit_huge / vit_giant) instead of DDP")
    shard_within_node: bool = setting(
        False, "with fsdp: HSDP, parameters sharded across a node's GPUs and replicated across nodes (2-D mesh)"
    )
    ddp_bucket_mb: int = setting(25, "DDP gradient bucket size in MiB (bigger: fewer all-reduces, less overlap)")
    log_every: int = setting(
        10,
        "steps between metrics.jsonl lines (and, with --no-progress, lines on stderr: loss terms, lr, images/s, ETA)",
    )
    log: list[str] = setting(
        [],
        "also send the metrics to: tensorboard (event files in RUN/tensorboard; pip install tensorboard), wandb "
        "(Weights & Biases, project tcjepa; WANDB_MODE=offline works without an account)",
    )
    val_every: int = setting(100, "steps between validation passes")
    checkpoint_every: int = setting(200, "steps between checkpoints")
    checkpoint_keep: int = setting(2, "checkpoints kept: the newest this many (older ones are removed)")
    checkpoint_every_keep: int = setting(
        0, "also keep for good every checkpoint whose step is a multiple of this (as I-JEPA's -epN; 0: none)"
    )
    init: str | None = setting(
        None,
        "start from these weights instead of random ones: a tcjepa run directory, a `tcjepa export` directory or an "
        "official I-JEPA checkpoint (.pth.tar); a run that has a checkpoint resumes from it instead",
    )

    @property
    def text_cache(self) -> str:
        """The caption cache of a run that reads text (`validate` refuses such a run without one)."""
        if self.cache is None:
            raise UserError(f"conditioning {self.conditioning} needs --cache")
        return self.cache

    @property
    def text_store(self) -> str:
        """The embedding store of a run that reads text (`validate` refuses such a run without one)."""
        if self.store is None:
            raise UserError(f"conditioning {self.conditioning} needs --store")
        return self.store


@dataclass(frozen=True)
class ModelConfig:
    """The model section of a run's config: what builds the encoders and the predictor (`train.jepa.build_models`),
    and all that evaluation, export and viz need to rebuild them from a saved run (`ModelConfig.of`)."""

    model: str
    image_size: int
    patch_size: int
    width: int | None
    depth: int | None
    heads: int | None
    predictor_width: int
    predictor_depth: int | None
    predictor_heads: int | None
    conditioning: str
    pool: str
    conditioner: str

    @classmethod
    def of(cls, config: TrainConfig) -> ModelConfig:
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    @property
    def encoder(self) -> dict[str, Any]:
        """The encoder's architecture alone (what a random-init floor of the same encoder is built from)."""
        return {k: getattr(self, k) for k in ("model", "image_size", "patch_size", "width", "depth", "heads")}

    @property
    def resolved_predictor_heads(self) -> int:
        """The predictor's attention heads: `predictor_heads`, or by default the encoder's."""
        return self.predictor_heads or self.heads or VIT_SIZES[self.model].heads


# Options that change neither the data nor the maths: a resumed run may change them.
RUNTIME_ONLY = {
    "num_workers",
    "decode",
    "device_resize",
    "verify_images",
    "device",
    "compile",
    "checkpoint_activations",
    "attention",
    "accum_steps",
    "shard_within_node",
    "ddp_bucket_mb",
    "log_every",
    "log",
    "val_every",
    "checkpoint_every",
    "checkpoint_keep",
    "checkpoint_every_keep",
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
        others = [a for a in args if a not in (type(None), str)]
        if str in args and others:  # a field of numbers that also takes `auto`
            if value == AUTO:
                return AUTO
            if isinstance(value, str):
                raise UserError(f"config key {name!r}: expected numbers like [a, b], or auto, got {value!r}")
            return _check_type(name, value, others[0])
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


def upgrade(updates: dict[str, Any], where: str | None = None) -> dict[str, Any]:
    """`updates` with values an older tcjepa wrote read as what they meant; with `where`, one line says so."""
    out = dict(updates)
    for key, value in updates.items():
        renamed = RENAMED_VALUES.get((key, value)) if isinstance(value, (str, int, float, bool)) else None
        if renamed is not None:
            out[key] = renamed[0]
            if where is not None:
                logger.info(f"{where}: {key}: {value!r} is read as {renamed[0]!r} ({renamed[1]})")
    return out


def saved_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config a run saved (config.yaml, a checkpoint's), with the keys added since read as that run had them."""
    return {**ADDED_KEYS, **config}


def apply(config: TrainConfig, updates: dict[str, Any], where: str) -> TrainConfig:
    """A copy of `config` with `updates` type-checked and applied; unknown keys are refused."""
    updates = upgrade(updates, where)
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


def resolve(
    out: Path, config_file: Path | None = None, flags: dict[str, Any] | None = None, sets: list[str] | None = None
) -> TrainConfig:
    """The config of a run into `out`, as `tcjepa train` makes it: the defaults, then the config `out` saved
    (RUN/config.yaml, read as that run had it), or instead `config_file` (YAML) when one is given, then `flags`
    (config keys; None values are left out), then `sets` (`--set key=value` pairs). Each layer is type-checked
    and refused in one line naming where it came from."""
    saved = Path(out) / "config.yaml"
    config = TrainConfig()
    if config_file is None and saved.exists():
        config = apply(config, saved_config(load_yaml(saved)), str(saved))
    if config_file is not None:
        config = apply(config, load_yaml(config_file), str(config_file))
    config = apply(config, {k: v for k, v in (flags or {}).items() if v is not None}, "command line")
    return apply(config, parse_set(sets or []), "--set")


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain YAML/JSON-ready values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def absolute_paths(config: TrainConfig) -> TrainConfig:
    """`config` with its local paths (images, an `hf:` local data directory, cache, store, mirror, init) made
    absolute, so that the saved config resumes from any directory; URLs and hub ids stay as they are."""
    from pipeline.core.remote import is_remote

    def absolute(location: str | None) -> str | None:
        if location is None or is_remote(location):
            return location
        if location.startswith(HF_PREFIX):
            body = location[len(HF_PREFIX) :]
            name, bracket, split = body.partition("[")
            return f"{HF_PREFIX}{os.path.abspath(name)}{bracket}{split}" if Path(name).exists() else location
        return os.path.abspath(os.path.expanduser(location))

    return dataclasses.replace(
        config,
        images=[str(absolute(p)) for p in config.images],
        cache=absolute(config.cache),
        store=absolute(config.store),
        mirror=absolute(config.mirror),
        init=absolute(config.init),
    )


def differences(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Keys (other than runtime-only ones) whose value differs between a saved run and this config."""
    now, before = to_dict(current), upgrade(saved_config(saved))
    return [k for k in FIELDS if k not in RUNTIME_ONLY and before.get(k) != now[k]]


CHOICES = {
    "conditioning": CONDITIONING,
    "pool": POOLING,
    "conditioner": CONDITIONERS,
    "regulariser_cosine": REGULARISER_COSINES,
    "loss": LOSSES,
    "model": MODELS,
    "context_equalise": CONTEXT_EQUALISE,
    "decode": DECODERS,
    "device_resize": DEVICE_RESIZE,
    "attention": ATTENTION,
}
POSITIVE = (
    "captions_per_image",
    "max_words",
    "patch_size",
    "image_size",
    "predictor_width",
    "num_targets",
    "batch_size",
    "partitions",
    "steps",
    "log_every",
    "val_every",
    "checkpoint_every",
    "checkpoint_keep",
    "accum_steps",
    "ddp_bucket_mb",
    "sigreg_directions",
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
    if min(config.warmup_steps, config.num_workers or 0, config.val_images, config.min_context) < 0:
        raise UserError(
            "warmup_steps, num_workers, val_images and min_context must be >= 0 (0: automatic; for num_workers, "
            "loading in the training process)"
        )
    if config.checkpoint_every_keep < 0:
        raise UserError(f"checkpoint_every_keep must be >= 0 (0: none), got {config.checkpoint_every_keep}")
    if not 0.0 <= config.min_coverage <= 1.0:
        raise UserError(f"min_coverage must be in [0, 1], got {config.min_coverage}")
    if config.lambda_sparse < 0 or config.beta_consistency < 0 or config.sigreg < 0:
        raise UserError("lambda_sparse, beta_consistency and sigreg must be >= 0")
    if not (0 < config.crop_scale[0] <= config.crop_scale[1] <= 1 and 0 < config.crop_ratio[0] <= config.crop_ratio[1]):
        raise UserError(
            f"crop_scale must satisfy 0 < low <= high <= 1 and crop_ratio 0 < low <= high; got {config.crop_scale}, "
            f"{config.crop_ratio}"
        )
    encoder = VIT_SIZES[config.model]
    encoder_width, encoder_heads = config.width or encoder.width, config.heads or encoder.heads
    predictor_heads = resolved_predictor_heads(config)
    for what, width, heads in (
        ("", encoder_width, encoder_heads),
        ("predictor_", config.predictor_width, predictor_heads),
    ):
        if width % heads or width % 4:
            raise UserError(
                f"{what}width {width} must be divisible by {what}heads ({heads}) and by 4 (2-D sin-cos position "
                f"embeddings); e.g. {what}width {heads * 4 * max(round(width / (heads * 4)), 1)}"
            )
    if config.shard_within_node and not config.fsdp:
        raise UserError("shard_within_node shards with FSDP: set fsdp too (--fsdp --shard-within-node)")
    if config.batch_size % config.partitions:
        raise UserError(
            f"batch_size {config.batch_size} is not divisible by partitions {config.partitions} (each partition "
            "gives batch_size / partitions rows of every step)"
        )
    if config.batch_size % config.accum_steps:
        raise UserError(
            f"batch_size {config.batch_size} is not divisible by accum_steps {config.accum_steps} "
            "(each process splits its rows into accum_steps equal micro-batches)"
        )
    if config.conditioning != "none" and not (config.cache and config.store):
        raise UserError(f"conditioning {config.conditioning} needs --cache and --store (or use --conditioning none)")
    try:
        masks = mask_settings(config)
    except ValueError as exc:
        raise UserError(f"mask settings: {exc}") from None
    grid = (config.image_size // config.patch_size,) * 2
    for step in range(MASK_CHECK_STEPS):
        try:
            sample_masks(masks, grid, config.seed, step, config.batch_size)
        except ValueError as exc:
            given = f"min_context {config.min_context} was given explicitly: " if config.min_context else ""
            raise UserError(f"{given}{exc}") from None


def resolved_predictor_heads(config: TrainConfig) -> int:
    """The predictor's attention heads: `predictor_heads`, or by default the encoder's."""
    return ModelConfig.of(config).resolved_predictor_heads


def mask_settings(config: TrainConfig) -> MaskConfig:
    """The run's mask settings, with an automatic `min_context` resolved for its grid."""
    return MaskConfig(
        config.num_targets,
        config.target_scale,
        config.target_aspect,
        config.context_scale,
        config.context_aspect,
        config.min_context or automatic_min_context(config.image_size // config.patch_size),
        config.context_equalise,
    )


def automatic_min_context(grid_side: int) -> int:
    """I-JEPA's 10 context patches of 196, scaled to a `grid_side`² grid (4×4: 1, 8×8: 3, 14×14: 10)."""
    return max(1, round(REFERENCE_MIN_CONTEXT * grid_side * grid_side / REFERENCE_GRID_PATCHES))


def automatic_num_workers(cpus: int, ranks_on_node: int) -> int:
    """DataLoader workers per rank: the node's `cpus` shared among its ranks, one kept for each rank's own thread
    (the step, and the host side of a GPU's), at most MAX_LOADER_WORKERS; 0 (loading in the training process) when
    no CPU is left over."""
    return max(0, min(MAX_LOADER_WORKERS, cpus // max(ranks_on_node, 1) - 1))


def ema_left(start: float, end: float, steps: int) -> float:
    """The share of the starting weights left in the target encoder after `steps` EMA updates whose momentum goes
    linearly from `start` to `end` (Π_t m_t, as the trainer schedules it)."""
    return math.exp(sum(math.log(max(start + (end - start) * t / max(steps, 1), 1e-300)) for t in range(steps)))


def automatic_ema_start(steps: int, end: float = 1.0) -> float:
    """I-JEPA's start (0.996), or, for a run too short for it to wash out the starting weights, the largest start
    that leaves at most `EMA_LEFT_OF_START` of them (found by bisection on `ema_left`, which grows with the start)."""
    if ema_left(REFERENCE_EMA_START, end, steps) <= EMA_LEFT_OF_START:
        return REFERENCE_EMA_START
    low, high = 0.0, REFERENCE_EMA_START
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if ema_left(middle, end, steps) <= EMA_LEFT_OF_START else (low, middle)
    return math.floor(low * 1e5) / 1e5


def ema_schedule(config: TrainConfig) -> tuple[float, float]:
    """The run's EMA momentum at its first and last step: `ema`, or the automatic one (`automatic_ema_start`)."""
    if isinstance(config.ema, str):
        return automatic_ema_start(config.steps), 1.0
    return config.ema


def resolve_automatic(config: TrainConfig, n_images: int) -> TrainConfig:
    """`config` with its automatic settings (0) chosen for this data and grid, each said in one line (INFO: under
    torchrun, rank 0's); an explicit value that cannot work with `n_images` is refused in one line."""
    if n_images < 2:
        raise UserError(f"only {n_images} image(s) indexed: training needs at least 2 (one is held out for validation)")
    val_images, min_context = config.val_images, config.min_context
    if val_images >= n_images:
        raise UserError(
            f"val_images {val_images}: only {n_images} images, so at most {n_images - 1} can be held out for "
            "validation; lower val_images, or set it to 0 for the automatic min(32, 10%)"
        )
    lines = []
    if val_images == 0:
        val_images = max(1, min(DEFAULT_VAL_IMAGES, n_images // 10))
        lines.append(
            f"val_images: {val_images} of the {n_images} images held out for validation (automatic: "
            f"min({DEFAULT_VAL_IMAGES}, 10%); set val_images to choose)"
        )
    if min_context == 0:
        side = config.image_size // config.patch_size
        min_context = automatic_min_context(side)
        lines.append(
            f"min_context: {min_context} patch(es) on the {side}×{side} grid (automatic: 10 per 14×14, scaled; "
            "set min_context to choose)"
        )
    ema = ema_schedule(config)
    if config.ema == AUTO:
        start = ema[0]
        left = ema_left(start, 1.0, config.steps)
        why = "I-JEPA's" if start == REFERENCE_EMA_START else f"lowered from {REFERENCE_EMA_START} for a short run"
        lines.append(
            f"ema: {start} -> 1.0 over {config.steps} steps, {left:.1%} of the starting weights left in the target "
            f"encoder at the end (automatic: {why}; set ema to choose)"
        )
    for line in lines:
        logger.info(line)
    return dataclasses.replace(config, val_images=val_images, min_context=min_context, ema=ema)
