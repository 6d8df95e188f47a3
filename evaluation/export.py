"""`tcjepa export`: a run's encoder as safetensors + config, for timm, for Hugging Face transformers, and for us.

`--format timm` (default) writes `model.safetensors` under timm's `VisionTransformer` names and a `config.json`
in timm's own layout (`architecture`, `num_classes`, `model_args`, `pretrained_cfg`) plus our provenance:

    import json, timm
    cfg = json.load(open("DIR/config.json"))
    model = timm.create_model(cfg["architecture"], pretrained=True,
                              pretrained_cfg_overlay={"file": "DIR/model.safetensors"}, **cfg["model_args"])
    # or: timm.create_model("local-dir:DIR", pretrained=True)
    tokens = model.forward_features(x)   # [B, L, D], after the final LayerNorm, equal to ours
    pooled = model(x)                    # [B, D], mean over patches (num_classes=0)

Our encoder in timm's terms: no class token (`class_token=False`), average pooling with the LayerNorm on every
token before it (`global_pool="avg"`, `fc_norm=False`, as timm's I-JEPA models), LayerNorm eps 1e-6, exact
GELU, biased qkv. The fixed 2-D sin-cos position table (rows first, as train/vit.py builds it) is stored as
timm's `pos_embed` parameter, so timm adds exactly our values; it is frozen in our training and free in theirs.
`architecture` is timm's class-token-free average-pooled ViT entry point; `model_args` sets every size.

`--format hf` writes a folder that `transformers.IJepaModel.from_pretrained(DIR)` loads: `config.json`
(`IJepaConfig`) and `model.safetensors` under the names of the Hub's I-JEPA checkpoints (q, k, v split out of
our fused qkv; the position table as `embeddings.position_embeddings`); `last_hidden_state` is our output.
Provenance goes to `tcjepa.json`. `--encoder context` exports the context encoder instead of the EMA target.

Inputs are RGB in [0, 1] normalised with the ImageNet mean and std, resized and centre-cropped as
`tcjepa eval` does (`pretrained_cfg` says so to timm). Files are written world-readable (0644).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from evaluation.features import ENCODERS, load_run, run_encoder
from evaluation.preprocess import INTERPOLATION
from evaluation.protocol import CROP_FRACTION
from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes
from train.data import IMAGENET_MEAN, IMAGENET_STD
from train.vit import LN_EPS, Block, VisionTransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
PROVENANCE = "tcjepa.json"  # --format hf: our fields, beside transformers' config.json
FORMAT = "tcjepa-encoder"
FORMATS = ("timm", "hf")
TIMM_ARCHITECTURE = "vit_base_patch16_gap_224"
FILE_MODE = 0o644


def to_timm_names(state: dict[str, torch.Tensor], pos_embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our encoder's state dict under timm's names, plus the position embedding as a `[1, L, D]` tensor."""
    out = {
        ("patch_embed.proj." + k.removeprefix("patch_embed.") if k.startswith("patch_embed.") else k): v
        for k, v in state.items()
    }
    out["pos_embed"] = pos_embed[None]
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def from_timm_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_timm_names` (the position embedding is dropped: ours is recomputed)."""
    return {k.replace("patch_embed.proj.", "patch_embed."): v for k, v in state.items() if k != "pos_embed"}


_HF_BLOCK = {  # ours (inside blocks.N.) -> the Hub's I-JEPA names (inside encoder.layer.N.)
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


def to_hf_names(state: dict[str, torch.Tensor], pos_embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our encoder's state dict under the names of the Hub's I-JEPA checkpoints (`IJepaModel`, ViT layout)."""
    out = {
        "embeddings.patch_embeddings.projection.weight": state["patch_embed.weight"],
        "embeddings.patch_embeddings.projection.bias": state["patch_embed.bias"],
        "embeddings.position_embeddings": pos_embed[None],
        "layernorm.weight": state["norm.weight"],
        "layernorm.bias": state["norm.bias"],
    }
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for n in range(depth):
        ours, theirs = f"blocks.{n}.", f"encoder.layer.{n}."
        for kind in ("weight", "bias"):
            q, k, v = state[f"{ours}attn.qkv.{kind}"].chunk(3)  # our fused qkv rows: all q, then all k, then all v
            for name, part in (("query", q), ("key", k), ("value", v)):
                out[f"{theirs}attention.attention.{name}.{kind}"] = part
            for mine, hf in _HF_BLOCK.items():
                out[f"{theirs}{hf}.{kind}"] = state[f"{ours}{mine}.{kind}"]
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def encoder_config(encoder: VisionTransformer, image_size: int) -> dict[str, Any]:
    """Our architecture, as `load_exported` rebuilds it."""
    return {
        "image_size": image_size,
        "patch_size": encoder.patch_size,
        "width": encoder.width,
        "depth": len(encoder.blocks),
        "heads": encoder.heads,
        "mlp_ratio": cast(Block, encoder.blocks[0]).mlp.fc1.out_features / encoder.width,
    }


def timm_config(arch: dict[str, Any]) -> dict[str, Any]:
    """timm's config.json fields: `create_model(architecture, **model_args)` builds our encoder."""
    size = arch["image_size"]
    return {
        "architecture": TIMM_ARCHITECTURE,
        "num_classes": 0,
        "num_features": arch["width"],
        "global_pool": "avg",
        "model_args": {
            "img_size": size,
            "patch_size": arch["patch_size"],
            "embed_dim": arch["width"],
            "depth": arch["depth"],
            "num_heads": arch["heads"],
            "mlp_ratio": arch["mlp_ratio"],
            "class_token": False,
            "global_pool": "avg",
            "fc_norm": False,
            "num_classes": 0,
        },
        "pretrained_cfg": {
            "input_size": [3, size, size],
            "fixed_input_size": True,
            "interpolation": INTERPOLATION,
            "crop_pct": CROP_FRACTION,
            "crop_mode": "center",
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        },
    }


def hf_config(arch: dict[str, Any]) -> str:
    """transformers' `IJepaConfig` of our encoder, as its config.json text."""
    from transformers import IJepaConfig

    config = IJepaConfig(
        hidden_size=arch["width"],
        num_hidden_layers=arch["depth"],
        num_attention_heads=arch["heads"],
        intermediate_size=round(arch["width"] * arch["mlp_ratio"]),
        hidden_act="gelu",
        layer_norm_eps=LN_EPS,
        image_size=arch["image_size"],
        patch_size=arch["patch_size"],
        num_channels=3,
        qkv_bias=True,
        architectures=["IJepaModel"],
    )
    return config.to_json_string()


def _write(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)
    os.chmod(path, FILE_MODE)


def _write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, FILE_MODE)  # safetensors creates its file 0600
    tmp.replace(path)


def export_run(run: Path, out: Path, fmt: str = "timm", encoder: str = "target") -> dict[str, Any]:
    """Write `run`'s target (or context) encoder to `out` in `fmt` (timm or hf); returns our provenance."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose timm or hf")
    if encoder not in ENCODERS:
        raise UserError(f"--encoder {encoder}: choose target or context")
    trained = load_run(run)
    enc, cfg = run_encoder(trained, encoder), trained.config
    arch = encoder_config(enc, cfg.image_size)
    provenance = {
        "format": FORMAT,
        "source_run": str(Path(run).resolve()),
        "step": trained.step,
        "weights": encoder,
        "model": cfg.model,
        "conditioning": cfg.conditioning,
        "encoder": arch,
        "normalise": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "preprocessing": {"crop_fraction": CROP_FRACTION, "interpolation": INTERPOLATION},
    }
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "timm":
        _write_weights(out / WEIGHTS, to_timm_names(enc.state_dict(), cast(torch.Tensor, enc.pos_embed)))
        _write(out / CONFIG, (json.dumps({**timm_config(arch), **provenance}, indent=1) + "\n").encode())
    else:
        _write_weights(out / WEIGHTS, to_hf_names(enc.state_dict(), cast(torch.Tensor, enc.pos_embed)))
        _write(out / CONFIG, hf_config(arch).encode())
        _write(out / PROVENANCE, (json.dumps(provenance, indent=1) + "\n").encode())
    return provenance


def load_exported(directory: Path) -> VisionTransformer:
    """Our `VisionTransformer` from a `--format timm` export directory (eval mode)."""
    directory = Path(directory)
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{directory}/{CONFIG} cannot be read ({exc})") from None
    if config.get("format") != FORMAT:
        hint = "; an --format hf export loads with transformers' IJepaModel" if config.get("model_type") else ""
        raise UserError(
            f"{directory} is not a `tcjepa export` directory ({CONFIG} format {config.get('format')!r}){hint}"
        )
    e = config["encoder"]
    encoder = VisionTransformer(e["image_size"], e["patch_size"], e["width"], e["depth"], e["heads"], e["mlp_ratio"])
    encoder.load_state_dict(from_timm_names(load_file(str(directory / WEIGHTS))))
    return encoder.eval()
