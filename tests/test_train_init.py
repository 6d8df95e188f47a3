"""`--init`: a run starts from one of our runs, one of our exports, or an official I-JEPA checkpoint written here in
I-JEPA's own layout (its key names, DDP's `module.` prefix, its column-first sin-cos table and channel order)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.core.errors import UserError
from tests.support.commands import tcjepa
from tests.support.training import sets
from train.config import ModelConfig, TrainConfig
from train.initial import initialise
from train.jepa import build_models

TINY = {"model": "vit_tiny", "depth": 2, "predictor_width": 96, "predictor_depth": 2, "image_size": 64}
TINY_ARGS = [
    *("--conditioning", "none", "--model", "vit_tiny", "--image-size", "64", "--patch-size", "16"),
    *("--batch-size", "8", "--no-progress"),
    *sets("depth=2", "predictor_width=96", "predictor_depth=2", "num_workers=0"),
]


def _models(seed: int, patch_size: int = 16, conditioning: str = "none"):
    torch.manual_seed(seed)
    return build_models(ModelConfig.of(TrainConfig(**TINY, patch_size=patch_size, conditioning=conditioning)), None)


def _swapped(t: torch.Tensor, axis: int) -> torch.Tensor:
    n = t.shape[axis]
    return torch.cat([t.narrow(axis, n // 2, n - n // 2), t.narrow(axis, 0, n // 2)], dim=axis)


def _official_table(width: int, side: int) -> torch.Tensor:
    """I-JEPA's get_2d_sincos_pos_embed, from its definition: meshgrid(w, h), the first half encodes grid[0] (w)."""

    def one_d(dim: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=float) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(side, dtype=float), np.arange(side, dtype=float)), axis=0)
    table = np.concatenate([one_d(width // 2, grid[0]), one_d(width // 2, grid[1])], axis=1)
    return torch.from_numpy(table).float()[None]


def _official_block(key: str, value: torch.Tensor) -> torch.Tensor:
    """A residual-stream parameter in I-JEPA's channel order: what reads the stream by column, what writes it by
    row, the rest untouched."""
    if key.endswith(("qkv.weight", "fc1.weight")):
        return _swapped(value, 1)
    if key.endswith(("qkv.bias", "fc1.bias")):
        return value
    return _swapped(value, 0)


def _official_encoder(encoder) -> dict:
    state = {
        "module." + k.replace("patch_embed.", "patch_embed.proj."): _official_block(k, v)
        for k, v in encoder.state_dict().items()
    }
    state["module.pos_embed"] = _official_table(encoder.width, encoder.grid[0])
    return state


def _official_predictor(predictor) -> dict:
    names = {"embed.": "predictor_embed.", "blocks.": "predictor_blocks.", "norm.": "predictor_norm."}
    names["proj."] = "predictor_proj."
    state = {}
    for key, value in predictor.state_dict().items():
        if key == "mask_token":
            value = _swapped(value, 2)
        elif key == "embed.weight" or key == "proj.weight":
            value = _swapped(_swapped(value, 0), 1)
        elif key in ("embed.bias", "proj.bias"):
            value = _swapped(value, 0)
        else:
            value = _official_block(key, value)
        prefix = next(p for p in names if key.startswith(p)) if key != "mask_token" else ""
        state["module." + (names[prefix] + key[len(prefix) :] if prefix else key)] = value
    width = predictor.state_dict()["norm.weight"].shape[0]
    state["module.predictor_pos_embed"] = _official_table(width, 4)
    return state


@pytest.fixture
def official(tmp_path):
    """(our models, an I-JEPA `.pth.tar` of them written in the official layout)."""
    model, target = _models(seed=1)
    with torch.no_grad():  # a target that differs from the context encoder, as after training
        for p in target.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = tmp_path / "IN1K-vit.h.14-300e.pth.tar"
    checkpoint = {
        "encoder": _official_encoder(model.encoder),
        "predictor": _official_predictor(model.predictor),
        "target_encoder": _official_encoder(target),
        "opt": {},
        "epoch": 300,
    }
    torch.save(checkpoint, path)
    return (model, target), path


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_an_official_ijepa_checkpoint_maps_onto_our_weights(official, capsys):
    (model, target), path = official
    fresh, fresh_target = _models(seed=2)
    assert not _equal(fresh, model)
    initialise(path, fresh, fresh_target)
    assert _equal(fresh, model) and _equal(fresh_target, target)
    said = capsys.readouterr().err
    assert "from the I-JEPA checkpoint" in said and "(epoch 300)" in said


def test_the_mapped_network_computes_ijepas_function_up_to_swapped_channel_halves(official):
    """I-JEPA's encoder (its weights, its column-first table) and ours after mapping give the same features, the two
    halves of the channels swapped: the table's layout was mapped, not ignored."""
    (model, _), path = official
    theirs, _ = _models(seed=3)
    state = torch.load(path, weights_only=True)["encoder"]
    theirs.encoder.load_state_dict(
        {
            k.removeprefix("module.").replace("patch_embed.proj.", "patch_embed."): v
            for k, v in state.items()
            if k != "module.pos_embed"
        }
    )
    theirs.encoder.pos_embed = state["module.pos_embed"][0]
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ours, official_features = model.encoder(images), theirs.encoder(images)
    assert torch.allclose(ours, _swapped(official_features, 2), atol=1e-5)
    assert not torch.allclose(ours, official_features, atol=1e-3)


def test_a_text_run_takes_ijepas_encoders_and_a_new_predictor(official, capsys):
    _, path = official
    torch.manual_seed(4)
    model, target = build_models(ModelConfig.of(TrainConfig(**TINY, patch_size=16, conditioning="cross")), 16)
    before = {k: v.clone() for k, v in model.predictor.state_dict().items()}
    initialise(path, model, target)
    assert all(torch.equal(v, before[k]) for k, v in model.predictor.state_dict().items())
    assert "new predictor" in capsys.readouterr().err


def test_another_architecture_or_file_is_refused_in_one_line(official, tmp_path):
    _, path = official
    with pytest.raises(UserError, match="is not I-JEPA's sin-cos table of this run's 8×8 grid") as caught:
        initialise(path, *_models(seed=5, patch_size=8))
    assert "\n" not in str(caught.value)
    torch.manual_seed(6)
    deeper = build_models(ModelConfig.of(TrainConfig(**{**TINY, "depth": 3}, patch_size=16, conditioning="none")), None)
    with pytest.raises(UserError, match=r"does not fit this run's architecture \(blocks.2.norm1.weight is missing"):
        initialise(path, *deeper)
    other = tmp_path / "other.pth.tar"
    torch.save({"state_dict": {}}, other)
    with pytest.raises(UserError, match="not an I-JEPA checkpoint"):
        initialise(other, *_models(seed=7))
    with pytest.raises(UserError, match="no such run, export directory or checkpoint file"):
        initialise(tmp_path / "absent", *_models(seed=7))


@pytest.mark.slow
def test_init_from_our_run_and_our_export_through_the_cli(tmp_path, synth_dir):
    first = tmp_path / "first"
    tcjepa("train", synth_dir / "images", "--out", first, *TINY_ARGS, "--steps", "2")
    state = torch.load(first / "checkpoint.pt", weights_only=True)
    model, target = _models(seed=8)
    initialise(first, model, target)
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    tcjepa("export", first, "--out", tmp_path / "export")
    model, target = _models(seed=9)
    initialise(tmp_path / "export", model, target)
    assert all(torch.equal(v, state["target"][k]) for k, v in target.state_dict().items())
    assert all(torch.equal(v, state["target"][k]) for k, v in model.encoder.state_dict().items())
    second = tmp_path / "second"
    done = tcjepa("train", synth_dir / "images", "--out", second, *TINY_ARGS, "--steps", "1", "--init", first)
    assert f"init: context encoder, predictor and target encoder from {first} (step 2)" in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 1
    refused = tcjepa(
        "train", synth_dir / "images", "--out", tmp_path / "third", *TINY_ARGS, "--steps", "1",
        "--patch-size", "8", "--init", first, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "does not fit this run's architecture" in refused.stderr.splitlines()[-1]
