"""Validation in chunks (train.validation): the figures of one batch of every held-out image, in bounded memory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.common import peak_rss_mb
from benchmarks.startup import build_run
from embedding_cache.store import EmbeddingStore
from tests.support.repo import REPO
from train.config import ModelConfig, TrainConfig
from train.data import StepBatches
from train.data_index import build_index
from train.jepa import build_models
from train.metrics import effective_rank, effective_rank_from_gram
from train.optim import make_optimizer
from train.step import TrainStep
from train.validation import chunks_of, validate_in_chunks


def test_rankme_from_summed_gram_matrices_is_rankme_of_the_stacked_features():
    rng = np.random.default_rng(0)
    # a spectrum spread over three orders of magnitude, as trained features have
    basis = rng.standard_normal((24, 24)) * np.logspace(0, -3, 24)[:, None]
    parts = [torch.from_numpy(rng.standard_normal((n, 24)) @ basis) for n in (50, 7, 130)]
    gram = sum(p.T @ p for p in parts)
    assert effective_rank_from_gram(gram) == pytest.approx(effective_rank(torch.cat(parts)), rel=1e-6)
    collapsed = torch.from_numpy(rng.standard_normal((40, 1)) @ rng.standard_normal((1, 24)))
    assert effective_rank_from_gram(collapsed.T @ collapsed) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(("n", "chunk", "world"), [(10, 3, 1), (10, 3, 2), (4, 2, 4), (7, 16, 3), (12, 4, 3)])
def test_chunks_cover_every_image_once_and_every_process_runs_as_many(n, chunk, world):
    shares = [chunks_of([0, n], chunk, rank, world) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1, "FSDP's forwards are collective"
    counted = np.zeros(n)
    for share in shares:
        for part in share:
            assert 0 < part.rows.stop - part.rows.start <= chunk
            counted[part.rows] += part.weight
    assert counted.tolist() == [1.0] * n


def _config(images: str, cache: str, store: str, width: int, **settings: Any) -> TrainConfig:
    """A tiny two-block model of `width` over the given run, on the CPU in float32."""
    return TrainConfig(
        images=[images],
        cache=cache,
        store=store,
        model="vit_tiny",
        width=width,
        depth=2,
        heads=2,
        predictor_width=width,
        predictor_depth=2,
        patch_size=8,
        captions_per_image=4,
        min_context=4,
        bf16=False,
        device="cpu",
        **settings,
    )


def _tiny(cfg: TrainConfig, width: int | None):
    torch.manual_seed(0)
    model, target = build_models(ModelConfig.of(cfg), width)
    step = TrainStep(model, model, target, make_optimizer(model, cfg, torch.device("cpu")), cfg, torch.device("cpu"))
    model.eval()
    return step, target


def test_the_position_share_is_the_variance_the_position_means_explain():
    """By hand on stacked features `[n, L, D]`: 1 − Σ‖z − μ_p‖² / Σ‖z − μ‖²; features equal at every image: 1;
    features that do not depend on the position: about 0."""
    from train.validation import position_share

    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 5, 3, generator=g, dtype=torch.float64) + torch.randn(1, 5, 3, generator=g, dtype=torch.float64)
    flat = z.reshape(-1, 3)
    expected = 1 - (z - z.mean(0)).square().sum() / (z - z.mean((0, 1))).square().sum()
    assert position_share(flat.T @ flat, z.sum(0), 7) == pytest.approx(float(expected), rel=1e-9)
    same = z[:1].expand(7, -1, -1).reshape(-1, 3)
    assert position_share(same.T @ same, z[:1].expand(7, -1, -1).sum(0), 7) == pytest.approx(1.0)
    noise = torch.randn(2000, 5, 3, generator=g, dtype=torch.float64)
    flat = noise.reshape(-1, 3)
    assert position_share(flat.T @ flat, noise.sum(0), 2000) < 0.01


def test_figures_in_chunks_are_those_of_one_batch(synth_dir, annotated_cache, vector_store, monkeypatch):
    from train import validation

    shuffled: list = []
    make_shuffled = validation._shuffled
    monkeypatch.setattr(validation, "_shuffled", lambda *a: shuffled.append(make_shuffled(*a)) or shuffled[-1])
    index = build_index([synth_dir / "images"], annotated_cache, vector_store, [], progress=False)
    cfg = _config(
        str(synth_dir / "images"), str(annotated_cache), str(vector_store), 32, image_size=32, batch_size=4, seed=1
    )
    cfg = dataclasses.replace(cfg, captions_per_image=3, min_context=2)
    step, target = _tiny(cfg, EmbeddingStore(vector_store).width)
    data = StepBatches(index, np.arange(len(index)), cfg, (4, 4))
    ids = np.arange(0, 22, 2)  # 11 images: chunks of 4 leave 3
    whole = validate_in_chunks(step, target, data, ids, len(ids), 0, 1)
    chunked = validate_in_chunks(step, target, data, ids, 4, 0, 1)
    assert (
        set(whole)
        == set(chunked)
        == {
            "val_loss_predict",
            "val_loss_predict_shuffled",
            "val_loss_predict_notext",
            "val_positive_cosine",
            "val_rankme",
            "val_rankme_centred",
            "val_position_share",
            "val_loss_position_only",
            "val_cosine_quantiles",
        }
    )
    # Captions move an untrained model's loss by ~1e-6 of it (giving the first row of each chunk the chunk's last
    # captions, not the previous image's, moves the shuffled loss by 3e-6 of it); chunking itself by < 1e-7.
    quantiles = whole.pop("val_cosine_quantiles")
    assert len(quantiles) == 2 and all(len(q) == 5 and q == sorted(q) and -1 <= q[0] <= q[-1] <= 1 for q in quantiles)
    # the same histogram in chunks, but for a cosine that rounding moves across a bin edge (0.01)
    np.testing.assert_allclose(chunked.pop("val_cosine_quantiles"), quantiles, atol=0.0101)
    for key, value in whole.items():
        assert chunked[key] == pytest.approx(value, rel=1e-6), key
    assert whole["val_loss_predict_shuffled"] != pytest.approx(whole["val_loss_predict"], rel=1e-6)
    again = validate_in_chunks(step, target, data, ids, len(ids), 0, 1)
    assert again.pop("val_cosine_quantiles") == quantiles and again == whole, "deterministic"
    # the shuffled control counts its words, so its caption K/V projection runs on real words alone, as a step's
    assert shuffled and all(text.words == int(text.lengths.sum()) for text in shuffled)


def test_the_position_only_floor_and_the_centred_rank_see_what_position_explains(
    synth_dir, annotated_cache, vector_store
):
    """A target encoder blind to the pixels (its patch embedding zeroed) gives every image the same features: the
    position-only predictor matches them exactly (loss 0, in chunks and across chunk boundaries) though the rank of
    its features is many. With the pixels, the features vary between images: the position-only loss is that
    variation, and the rank of what varies is many."""
    index = build_index([synth_dir / "images"], annotated_cache, vector_store, [], progress=False)
    cfg = _config(str(synth_dir / "images"), str(annotated_cache), str(vector_store), 32, image_size=32, batch_size=4)
    step, target = _tiny(cfg, EmbeddingStore(vector_store).width)
    data = StepBatches(index, np.arange(len(index)), cfg, (4, 4))
    ids = np.arange(10)
    seeing = validate_in_chunks(step, target, data, ids, 3, 0, 1)
    assert seeing["val_loss_position_only"] > 0.1 and seeing["val_rankme_centred"] > 2
    assert 0.05 < seeing["val_position_share"] < 0.95
    with torch.no_grad():
        target.patch_embed.weight.zero_()
        target.patch_embed.bias.zero_()
    blind = validate_in_chunks(step, target, data, ids, 3, 0, 1)
    assert blind["val_loss_position_only"] == pytest.approx(0.0, abs=1e-4)
    assert blind["val_position_share"] == pytest.approx(1.0, abs=1e-6), "position explains all of it"
    assert blind["val_rankme"] > 2 and blind["val_loss_predict"] > 0.1


def validation_only(images: str, cache: str, store: str, val_images: int, chunk: int) -> None:
    """Run in a subprocess: validate a tiny model on `val_images` images, `chunk` at a time; print the peak RSS."""

    cfg = _config(images, cache, store, 64, image_size=64, batch_size=16, val_images=val_images)
    index = build_index([images], cache, store, [], progress=False, verify_sample=0)
    step, target = _tiny(cfg, EmbeddingStore(store).width)
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    out = validate_in_chunks(step, target, data, np.arange(val_images), chunk, 0, 1)
    print(json.dumps({"peak_mb": peak_rss_mb(), **out}))


def _peak_mb(run, val_images: int, chunk: int) -> float:
    code = (
        "import sys; from tests.test_validation import validation_only; "
        "validation_only(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, (*run, val_images, chunk))],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


@pytest.mark.slow
def test_peak_memory_does_not_depend_on_the_number_of_validation_images(tmp_path):
    run = build_run(tmp_path, captions=4 * 260, segments=4, dim=8, tokens=4, seed=0)
    few, many = _peak_mb(run, 32, 16), _peak_mb(run, 256, 16)
    assert many <= 1.25 * few, (few, many)
    # the same 256 images as one batch, as validation ran before: the measure tells them apart
    assert _peak_mb(run, 256, 256) > 1.25 * few  # 540 and 543 MB in chunks, 1,364 MB as one batch, when written
