"""The optimiser: AdamW over parameter groups (no decay on biases and 1-D parameters, the text conditioner's learning
rate scaled), and each step's learning rate and weight decay set on those groups.
"""

from __future__ import annotations

import torch

from train.config import TrainConfig
from train.jepa import JEPA


def is_text_parameter(name: str) -> bool:
    """The conditioner's own parameters (cross-attention, its norm, the sequence-mode text projection)."""
    return (
        ".cross." in name or ".norm_cross." in name or name.startswith(("predictor.text_embed", "predictor.text_type"))
    )


def apply_schedules(group: dict, lr: float, weight_decay: float) -> None:
    """Set one AdamW group's learning rate and weight decay for a step.

    AdamW's decay shrinks a weight by lr · weight_decay per step, so a group whose learning rate is scaled
    (`lr_scale`, the text conditioner's) gets weight_decay / lr_scale: its decay per step stays that of every
    other weight, only its gradient steps grow.
    """
    group["lr"] = lr * group["lr_scale"]
    group["weight_decay"] = weight_decay / group["lr_scale"] if group["decay"] else 0.0


def param_groups(model: JEPA, text_lr_scale: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and 1-D parameters; the text conditioner's LR scaled."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim > 1
        groups.setdefault((decay, is_text_parameter(name)), []).append(p)
    return [
        {"params": params, "decay": decay, "lr_scale": text_lr_scale if text else 1.0}
        for (decay, text), params in sorted(groups.items())
    ]


def make_optimizer(model: JEPA, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `param_groups`; on CUDA the fused kernel (one launch for every parameter, no host sync)."""
    fused = True if device.type == "cuda" else None
    return torch.optim.AdamW(param_groups(model, cfg.text_lr_scale), lr=cfg.lr, betas=cfg.betas, fused=fused)
