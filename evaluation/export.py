"""`tcjepa export`: a run's target encoder as safetensors + config, for timm and for this code.

The weights use timm's `VisionTransformer` names (`patch_embed.proj.*`, `blocks.*`,
`norm.*`, `pos_embed`), so they load into timm's class-token-free, average-pooled
ViT built from `config.json`'s "timm" arguments:

    import json, timm, safetensors.torch
    cfg = json.load(open("DIR/config.json"))
    model = timm.models.vision_transformer.VisionTransformer(**cfg["timm"])
    model.load_state_dict(safetensors.torch.load_file("DIR/model.safetensors"))
    tokens = model.forward_features(x)   # [B, L, D], equal to ours
    pooled = model(x)                    # [B, D], mean over patches (num_classes=0)

`fc_norm=False` keeps the LayerNorm on every token before pooling, as our encoder
does; the fixed sin-cos position embedding is stored as timm's `pos_embed`.
`load_exported(DIR)` rebuilds our `VisionTransformer`. Inputs are RGB in [0, 1]
normalised with the ImageNet mean and std (in `config.json`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from evaluation.features import load_trained_encoder
from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes
from train.data import IMAGENET_MEAN, IMAGENET_STD
from train.vit import VisionTransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMAT = "tcjepa-encoder"


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


def encoder_config(encoder: VisionTransformer, image_size: int) -> dict[str, Any]:
    depth = len(encoder.blocks)
    mlp_ratio = encoder.blocks[0].mlp.fc1.out_features / encoder.width
    return {
        "image_size": image_size,
        "patch_size": encoder.patch_size,
        "width": encoder.width,
        "depth": depth,
        "heads": encoder.heads,
        "mlp_ratio": mlp_ratio,
    }


def export_run(run: Path, out: Path) -> dict[str, Any]:
    """Write `out/model.safetensors` and `out/config.json` from `run`'s checkpoint; returns the config."""
    trained = load_trained_encoder(run)
    enc, cfg = trained.encoder, trained.config
    ours = encoder_config(enc, cfg.image_size)
    config = {
        "format": FORMAT,
        "source_run": str(Path(run).resolve()),
        "step": trained.step,
        "model": cfg.model,
        "conditioning": cfg.conditioning,
        "encoder": ours,
        "normalise": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "timm": {
            "img_size": cfg.image_size,
            "patch_size": enc.patch_size,
            "embed_dim": enc.width,
            "depth": ours["depth"],
            "num_heads": enc.heads,
            "mlp_ratio": ours["mlp_ratio"],
            "class_token": False,
            "global_pool": "avg",
            "fc_norm": False,
            "num_classes": 0,
        },
    }
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS}.tmp"
    save_file(to_timm_names(enc.state_dict(), enc.pos_embed), str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    atomic_write_bytes(out / CONFIG, (json.dumps(config, indent=1) + "\n").encode())
    return config


def load_exported(directory: Path) -> VisionTransformer:
    """Our `VisionTransformer` from an exported directory (eval mode)."""
    directory = Path(directory)
    try:
        config = json.loads((directory / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{directory}/{CONFIG} cannot be read ({exc})") from None
    if config.get("format") != FORMAT:
        raise UserError(f"{directory} is not a `tcjepa export` directory ({CONFIG} format {config.get('format')!r})")
    e = config["encoder"]
    encoder = VisionTransformer(e["image_size"], e["patch_size"], e["width"], e["depth"], e["heads"], e["mlp_ratio"])
    encoder.load_state_dict(from_timm_names(load_file(str(directory / WEIGHTS))))
    return encoder.eval()
