"""`--init PATH`: a new run's starting weights, from one of our runs, one of our exports, or an official I-JEPA
checkpoint (facebookresearch/ijepa's `.pth.tar`).

- a run directory: its newest checkpoint's context encoder, predictor and target encoder, all of them (the same
  architecture, conditioning included);
- a `tcjepa export` directory (`--format timm`): its encoder, for both the context and the target encoder;
- an I-JEPA checkpoint: `encoder` and `target_encoder` (and `predictor`, when this run has no text and the
  shapes agree), whose keys carry DDP's `module.` prefix.

I-JEPA's 2-D sin-cos table puts the column's half of the channels first (its `get_2d_sincos_pos_embed` meshes
w before h), ours the row's (train.vit.sincos_2d): at patch (i, j) theirs is [e(j), e(i)] and ours [e(i), e(j)].
The tables differ only by swapping the two halves of the channels, so an I-JEPA network is carried over exactly
by swapping the halves of every channel of its residual streams (the encoder's width, and the predictor's):
rows of what writes to the stream, columns of what reads from it, LayerNorm scales and shifts. Our network then
computes theirs with its features' channel halves swapped, which no probe can tell apart. The file's own table is
checked against I-JEPA's formula for this grid: a mismatch means another architecture and is refused.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.core.errors import UserError
from train.checkpoint import has_checkpoint, load_checkpoint
from train.jepa import JEPA
from train.vit import VisionTransformer, sincos_2d

logger = logging.getLogger(__name__)

EXPORT_FORMAT = "tcjepa-encoder"  # evaluation.export's config.json `format` (train does not import evaluation)
IJEPA_PARTS = ("encoder", "target_encoder")

# Where a parameter's dimensions run along a residual stream: `s` the stream's channels, `t` the other stream's
# (the predictor's embed and proj join the two), per name pattern (block names are the same in both networks).
_STREAM_DIMS: list[tuple[str, tuple[str, ...]]] = [
    (r"patch_embed\.(weight|bias)", ("s",)),
    (r"(blocks\.\d+\.)?norm[12]?\.(weight|bias)", ("s",)),
    (r"blocks\.\d+\.attn\.qkv\.weight", ("", "s")),
    (r"blocks\.\d+\.mlp\.fc1\.weight", ("", "s")),
    (r"blocks\.\d+\.(attn\.proj|mlp\.fc2)\.(weight|bias)", ("s",)),
    (r"blocks\.\d+\.(attn\.qkv|mlp\.fc1)\.bias", ("",)),
    (r"mask_token", ("", "", "s")),
    (r"embed\.weight", ("s", "t")),
    (r"embed\.bias", ("s",)),
    (r"proj\.weight", ("t", "s")),
    (r"proj\.bias", ("t",)),
]


def swap_halves(n: int) -> torch.Tensor:
    """The channel order that swaps the two halves of `n` channels (its own inverse)."""
    return torch.cat([torch.arange(n // 2, n), torch.arange(n // 2)])


def swap_stream_halves(state: dict[str, torch.Tensor], width: int, other: int | None = None) -> dict[str, torch.Tensor]:
    """`state` (an encoder's, or a predictor's of `width` between encoders of `other`) with the two halves of its
    residual stream's channels swapped: I-JEPA's channel layout to ours, and back."""
    widths = {"s": width, "t": other}
    out = {}
    for name, tensor in state.items():
        dims = next((d for pattern, d in _STREAM_DIMS if re.fullmatch(pattern, name)), None)
        if dims is None:
            raise UserError(f"unexpected parameter {name!r} in an I-JEPA network; is this an I-JEPA checkpoint?")
        for axis, stream in enumerate(dims):
            if stream:
                size = widths[stream]
                if size is None or tensor.shape[axis] != size:
                    raise UserError(f"I-JEPA parameter {name} has shape {tuple(tensor.shape)}, not {stream} {size}")
                tensor = tensor.index_select(axis, swap_halves(size))
        out[name] = tensor
    return out


def ijepa_table(width: int, grid: tuple[int, int]) -> torch.Tensor:
    """I-JEPA's `[H*W, width]` sin-cos table, columns' half first: ours with its channel halves swapped."""
    return sincos_2d(width, grid)[:, swap_halves(width)]


def _strip_module(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in state.items()}


def _load(module: nn.Module, state: dict[str, torch.Tensor], what: str, path: Path) -> None:
    """`module.load_state_dict(state)`, or a one-line refusal naming the first difference."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or extra or wrong:
        first = (
            f"{wrong[0]} is {tuple(state[wrong[0]].shape)} there, {tuple(own[wrong[0]].shape)} here"
            if wrong
            else f"{(missing or extra)[0]} is {'missing there' if missing else 'not in this model'}"
        )
        raise UserError(
            f"--init {path}: its {what} does not fit this run's architecture ({first}); set model, width, depth, "
            "heads, patch_size, image_size (and predictor_*) to match it"
        )
    module.load_state_dict(state)


def _ijepa_encoder(state: dict[str, Any], encoder: VisionTransformer, path: Path, part: str) -> dict[str, torch.Tensor]:
    """An I-JEPA encoder's state dict in our names and channel order; its position table checked for our grid."""
    state = _strip_module(state)
    table = state.pop("pos_embed", None)
    if table is None:
        raise UserError(f"--init {path}: its {part} has no pos_embed; is this an I-JEPA checkpoint?")
    table = table.reshape(-1, table.shape[-1]).float()
    expected = ijepa_table(encoder.width, encoder.grid)
    if table.shape != expected.shape or not torch.allclose(table, expected, atol=1e-5):
        raise UserError(
            f"--init {path}: its {part}'s position table ({tuple(table.shape)}) is not I-JEPA's sin-cos table of "
            f"this run's {encoder.grid[0]}×{encoder.grid[1]} grid and width {encoder.width}; set model, patch_size "
            "and image_size to the checkpoint's"
        )
    renamed = {k.replace("patch_embed.proj.", "patch_embed."): v for k, v in state.items()}
    return swap_stream_halves(renamed, encoder.width)


_IJEPA_PREDICTOR = {
    "predictor_embed.": "embed.",
    "predictor_blocks.": "blocks.",
    "predictor_norm.": "norm.",
    "predictor_proj.": "proj.",
}


def _ijepa_predictor(state: dict[str, Any], model: JEPA) -> dict[str, torch.Tensor] | None:
    """An I-JEPA predictor's state dict in our names and channel order, or None when ours differs (text)."""
    state = _strip_module(state)
    state.pop("predictor_pos_embed", None)
    renamed = {}
    for key, value in state.items():
        for theirs, ours in _IJEPA_PREDICTOR.items():
            if key.startswith(theirs):
                key = ours + key[len(theirs) :]
        renamed[key] = value
    own = model.predictor.state_dict()
    if renamed.keys() != own.keys() or any(renamed[k].shape != own[k].shape for k in own):
        return None
    return swap_stream_halves(renamed, int(own["norm.weight"].shape[0]), model.encoder.width)


def initialise(path: Path, model: JEPA, target: VisionTransformer) -> None:
    """Load `path`'s weights into a new run's models (see the module's docstring), saying what came from where (INFO:
    under torchrun, rank 0's)."""
    path = Path(path)
    said: list[str] = []
    if path.is_dir() and has_checkpoint(path):
        state = load_checkpoint(path)
        assert state is not None
        _load(model, state["model"], "model", path)
        _load(target, state["target"], "target encoder", path)
        said.append(f"init: context encoder, predictor and target encoder from {path} (step {state['step']})")
    elif path.is_dir() and (path / "config.json").exists():
        config = json.loads((path / "config.json").read_text())
        if config.get("format") != EXPORT_FORMAT:
            raise UserError(f"--init {path}: not a `tcjepa export --format timm` directory (nor a run)")
        from safetensors.torch import load_file

        weights = load_file(str(path / "model.safetensors"))
        encoder = {k.replace("patch_embed.proj.", "patch_embed."): v for k, v in weights.items() if k != "pos_embed"}
        _load(model.encoder, encoder, "encoder", path)
        target.load_state_dict(model.encoder.state_dict())
        said.append(f"init: context and target encoder from the export {path} ({config.get('weights')}); new predictor")
    elif path.is_file():
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many types for a file it cannot read
            raise UserError(
                f"--init {path}: cannot be read as a checkpoint ({str(exc).splitlines()[0][:120]})"
            ) from None
        if not isinstance(checkpoint, dict) or not all(isinstance(checkpoint.get(p), dict) for p in IJEPA_PARTS):
            raise UserError(f"--init {path}: not an I-JEPA checkpoint (no `encoder` and `target_encoder` state dicts)")
        _load(model.encoder, _ijepa_encoder(checkpoint["encoder"], model.encoder, path, "encoder"), "encoder", path)
        mapped = _ijepa_encoder(checkpoint["target_encoder"], target, path, "target_encoder")
        _load(target, mapped, "target encoder", path)
        predictor = _ijepa_predictor(checkpoint["predictor"], model) if "predictor" in checkpoint else None
        if predictor is not None:
            model.predictor.load_state_dict(predictor)
        where = f"I-JEPA checkpoint {path}" + (f" (epoch {checkpoint['epoch']})" if "epoch" in checkpoint else "")
        kept = "and predictor " if predictor is not None else ""
        said.append(f"init: context encoder, target encoder {kept}from the {where}, position-table layout mapped")
        if predictor is None:
            said.append("init: new predictor (I-JEPA's has no text conditioning, or another shape)")
    else:
        raise UserError(
            f"--init {path}: no such run, export directory or checkpoint file"
            if not path.exists()
            else f"--init {path}: neither a tcjepa run, a `tcjepa export` directory nor an I-JEPA .pth.tar"
        )
    for line in said:
        logger.info(line)
