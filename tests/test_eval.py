"""`tcjepa eval`, `export` and `viz` on a real (tiny) trained run, and the probes on data with a known answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.export import load_exported
from evaluation.features import extract_features, load_trained_encoder
from evaluation.labels import patch_labels, read_labels
from evaluation.probes import attentive_probe, dense_probe, knn_probe, linear_probe, mean_iou, random_split
from pipeline.core.sources import list_images
from tests.conftest import tcjepa


@pytest.fixture(scope="module")
def cross_run(reference_run) -> Path:
    """The session's trained `cross` run (12 steps); evaluation adds its features and reports to it."""
    return reference_run


# --- probes on data whose answer is known ---------------------------------------------------


def _clusters(n: int, classes: int, dim: int, spread: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 3
    y = rng.integers(classes, size=n)
    return (centres[y] + spread * rng.normal(size=(n, dim))).astype(np.float32), y


def test_random_split_is_disjoint_complete_and_seeded():
    a = random_split(100, 0.2, 0.25, seed=1)
    assert sorted(np.concatenate([a.train, a.val, a.test]).tolist()) == list(range(100))
    assert (len(a.test), len(a.val), len(a.train)) == (20, 20, 60)
    assert np.array_equal(a.test, random_split(100, 0.2, 0.25, seed=1).test)
    assert not np.array_equal(a.test, random_split(100, 0.2, 0.25, seed=2).test)
    with pytest.raises(ValueError):
        random_split(3, 0.4, 0.5, seed=0)


def test_linear_and_knn_probes_read_separable_classes_and_not_random_labels():
    x, y = _clusters(400, 5, 16, 0.5, seed=0)
    split = random_split(len(y), 0.25, 0.2, seed=0)
    assert linear_probe(x, y, split, seed=0).metrics["top1"] == 1.0
    assert knn_probe(x, y, split).metrics["top1"] == 1.0
    noise = np.random.default_rng(1).integers(5, size=len(y))
    assert linear_probe(x, noise, split, seed=0).metrics["top1"] < 0.45
    assert knn_probe(x, noise, split).metrics["top1"] < 0.45


def test_linear_probe_picks_c_on_validation_and_reports_the_sweep():
    x, y = _clusters(200, 3, 8, 2.0, seed=3)
    result = linear_probe(x, y, random_split(len(y), 0.25, 0.25, seed=0), seed=0)
    assert set(result.validation) == {"C=0.001", "C=0.01", "C=0.1", "C=1", "C=10"}
    assert result.validation[f"C={result.chosen['C']:g}"] == max(result.validation.values())


def test_mean_iou_by_hand():
    truth = np.array([0, 0, 1, 1, 2])
    pred = np.array([0, 1, 1, 1, 0])
    # class 0: inter 1, union 3; class 1: inter 2, union 3; class 2: inter 0, union 1
    assert mean_iou(pred, truth, 3) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)


def test_dense_probe_reads_per_patch_classes_and_skips_unlabelled_patches():
    rng = np.random.default_rng(0)
    m, length, dim, classes = 60, 9, 12, 4
    centres = rng.normal(size=(classes, dim)) * 3
    labels = rng.integers(classes, size=(m, length))
    patches = (centres[labels] + 0.3 * rng.normal(size=(m, length, dim))).astype(np.float16)
    labels[:, 0] = -1  # unlabelled
    split = random_split(m, 0.25, 0.2, seed=0)
    result = dense_probe(patches, labels, split, seed=0)
    assert result.metrics["patch_accuracy"] == 1.0 and result.metrics["miou"] == 1.0
    assert result.split["test_patches"] == len(split.test) * (length - 1)
    shuffled = rng.permutation(labels.reshape(-1)).reshape(m, length)
    assert dense_probe(patches, shuffled, split, seed=0).metrics["patch_accuracy"] < 0.6


def test_attentive_probe_finds_the_one_token_that_matters():
    """The class is written in one random token among noise: pooling blurs it, attention can pick it."""
    rng = np.random.default_rng(0)
    n, length, dim, classes = 480, 8, 16, 3
    patches = rng.normal(size=(n, length, dim)).astype(np.float32)
    y = rng.integers(classes, size=n)
    where = rng.integers(length, size=n)
    patches[np.arange(n), where, :classes] += 6 * np.eye(classes)[y]
    patches[np.arange(n), where, -1] = 8.0  # a marker the query can attend to
    split = random_split(n, 0.25, 0.2, seed=0)
    result = attentive_probe(patches, y, split, seed=0, device=torch.device("cpu"))
    assert result.metrics["top1"] >= 0.9
    assert set(result.validation) == {"lr=0.001", "lr=0.003", "lr=0.01"}


# --- labels ------------------------------------------------------------------------------


def test_patch_labels_follow_the_patch_grid():
    cells = np.array([[1, 2], [3, 4]])  # 2×2 cells of 16 px: a 32 px image
    assert patch_labels(cells, 16, (32, 32), (4, 4)).reshape(4, 4).tolist() == [
        [1, 1, 2, 2],
        [1, 1, 2, 2],
        [3, 3, 4, 4],
        [3, 3, 4, 4],
    ]
    assert patch_labels(cells, 16, (32, 32), (1, 1)).tolist() == [4]  # the centre pixel (16, 16) lies in the last cell
    # A 64×32 image whose map covers only its left half: the right half is unlabelled.
    assert patch_labels(cells, 16, (64, 32), (2, 4)).reshape(2, 4).tolist() == [[1, 2, -1, -1], [3, 4, -1, -1]]


def test_labels_match_by_path_or_source_id_and_refuse_bad_lines(tmp_path, synth_dir):
    refs = list_images([synth_dir / "images"])
    lines = [
        {"image": "images/000001.png", "label": "a"},
        {"image": "000002.png", "label": 7},
        {"image": "images/nowhere.png", "label": "b"},
    ]
    (tmp_path / "labels.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    labels = read_labels(tmp_path / "labels.jsonl", refs, image_root=synth_dir)
    assert [refs[i].source_id for i in labels.image_index] == ["000001.png", "000002.png"]
    assert labels.classes == ["7", "a"] and labels.label.tolist() == [1, 0] and labels.unmatched == 1
    for bad, message in [
        ('{"image": "images/000001.png"}', "expected"),
        ("{not json", "not JSON"),
        ('{"image": "images/000001.png", "label": 1, "cells": [[1, 2], [3]], "cell_size": 16}', "cells"),
        ('{"image": "images/000001.png", "label": 1, "cells": [[1]], "cell_size": 0}', "cell_size"),
        ('{"image": "images/000001.png", "label": 1, "split": "holdout"}', "split"),
    ]:
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(Exception, match=message):
            read_labels(tmp_path / "bad.jsonl", refs, image_root=synth_dir)
    (tmp_path / "bad.jsonl").write_bytes(b'{"image": "images/000001.png", "label": "\xff"}\n')
    with pytest.raises(Exception, match="not UTF-8"):
        read_labels(tmp_path / "bad.jsonl", refs, image_root=synth_dir)


# --- the commands on a trained run -------------------------------------------------------


def test_eval_reports_every_probe_and_caches_features(cross_run, synth_dir):
    done = tcjepa(
        "eval",
        cross_run,
        synth_dir / "images",
        "--labels",
        synth_dir / "labels.jsonl",
        "--workers",
        "0",
        "--no-progress",
    )
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("step 12 | linear top1") and "dense patch_accuracy" in line and "attentive top1" in line
    report = json.loads((cross_run / "eval" / "labels.json").read_text())
    assert report["step"] == 12 and report["labelled"] == 40 and report["undecodable"] == 0
    assert sum(report["split"].values()) == 40 and report["split_source"] == "random"
    assert set(report["probes"]) == {"linear", "knn", "dense", "attentive"}
    for result in report["probes"].values():
        assert all(0 <= v <= 1 for v in result["metrics"].values())
    cached = sorted((cross_run / "features").iterdir())
    assert len(cached) == 1 and (cached[0] / "patches.npy").exists()
    stamp = (cached[0] / "pooled.npy").stat().st_mtime_ns
    again = tcjepa(
        "eval",
        cross_run,
        synth_dir / "images",
        "--labels",
        synth_dir / "labels.jsonl",
        "--probe",
        "linear",
        "--workers",
        "0",
        "--no-progress",
    )
    assert (cached[0] / "pooled.npy").stat().st_mtime_ns == stamp, "features were extracted again"
    assert again.stdout.strip().splitlines()[-1].split(" | ")[1] == line.split(" | ")[1]


def test_cached_features_equal_the_target_encoder_on_the_resized_images(cross_run, synth_dir):
    from PIL import Image

    from train.data import normalise

    refs = list_images([synth_dir / "images"])[:6]
    features = extract_features(cross_run, refs, with_patches=True, device="cpu", workers=0, progress=False)
    encoder = load_trained_encoder(cross_run).encoder
    pixels = np.stack(
        [np.asarray(Image.open(r.path).convert("RGB").resize((64, 64), Image.Resampling.BICUBIC)) for r in refs]
    )
    with torch.no_grad():
        tokens = encoder(normalise(torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy())))
    np.testing.assert_allclose(features.pooled, tokens.mean(1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(features.patches, dtype=np.float32), tokens.numpy(), atol=2e-3, rtol=2e-3)
    assert features.sizes.tolist() == [[64, 64]] * 6


def test_eval_leaves_out_an_undecodable_labelled_image(tmp_path, cross_run, synth_dir):
    images = tmp_path / "images"
    shutil.copytree(synth_dir / "images", images)
    (images / "000005.png").write_bytes(b"not a png")
    shutil.copy(synth_dir / "labels.jsonl", tmp_path / "labels.jsonl")
    tcjepa(
        "eval",
        cross_run,
        images,
        "--labels",
        tmp_path / "labels.jsonl",
        "--probe",
        "linear",
        "--probe",
        "knn",
        "--workers",
        "0",
        "--no-progress",
        "--report",
        tmp_path / "report.json",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["undecodable"] == 1 and sum(report["split"].values()) == 39


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda run, d, t: ["eval", t, d / "images", "--labels", d / "labels.jsonl"], "no checkpoint.pt"),
        (lambda run, d, t: ["eval", run, d / "images", "--labels", t / "none.jsonl"], "no such file"),
        (
            lambda run, d, t: ["eval", run, d / "images", "--labels", d / "labels.jsonl", "--probe", "svm"],
            "unknown probe",
        ),
        (lambda run, d, t: ["eval", run, t, "--labels", d / "labels.jsonl"], "no images"),
        (lambda run, d, t: ["export", t, "--out", t / "x"], "no checkpoint.pt"),
    ],
)
def test_bad_eval_and_export_input_gets_one_line_and_exit_2(tmp_path, cross_run, synth_dir, make_args, message):
    done = tcjepa(*make_args(cross_run, synth_dir, tmp_path), check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_dense_probe_without_cell_maps_is_refused_and_dropped_by_default(tmp_path, cross_run, synth_dir):
    rows = [json.loads(x) for x in (synth_dir / "labels.jsonl").read_text().splitlines()]
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({"image": r["image"], "label": r["label"]}) + "\n" for r in rows)
    )
    refused = tcjepa(
        "eval",
        cross_run,
        synth_dir / "images",
        "--labels",
        tmp_path / "plain.jsonl",
        "--image-root",
        synth_dir,
        "--probe",
        "dense",
        check=False,
    )
    assert refused.returncode == 2 and "per-cell labels" in refused.stderr
    tcjepa(
        "eval",
        cross_run,
        synth_dir / "images",
        "--labels",
        tmp_path / "plain.jsonl",
        "--image-root",
        synth_dir,
        "--probe",
        "linear",
        "--workers",
        "0",
        "--no-progress",
        "--report",
        tmp_path / "r.json",
    )
    assert set(json.loads((tmp_path / "r.json").read_text())["probes"]) == {"linear"}


def test_labels_file_split_is_used(tmp_path, cross_run, synth_dir):
    rows = [json.loads(x) for x in (synth_dir / "labels.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["split"] = "test" if i < 10 else "train"
    (tmp_path / "split.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tcjepa(
        "eval",
        cross_run,
        synth_dir / "images",
        "--labels",
        tmp_path / "split.jsonl",
        "--image-root",
        synth_dir,
        "--probe",
        "knn",
        "--workers",
        "0",
        "--no-progress",
        "--report",
        tmp_path / "r.json",
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["split_source"] == "labels file" and report["split"]["test"] == 10
    assert report["split"]["train"] + report["split"]["val"] == 30


def test_export_loads_into_timm_and_back_into_ours_with_equal_features(tmp_path, cross_run):
    import timm  # a dev dependency
    from safetensors.torch import load_file

    done = tcjepa("export", cross_run, "--out", tmp_path / "export")
    assert json.loads(done.stdout)["step"] == 12
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    theirs = timm.models.vision_transformer.VisionTransformer(**config["timm"]).eval()
    theirs.load_state_dict(load_file(str(tmp_path / "export" / "model.safetensors")))
    ours = load_trained_encoder(cross_run).encoder
    again = load_exported(tmp_path / "export")
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        tokens = ours(x)
        torch.testing.assert_close(theirs.forward_features(x), tokens)
        torch.testing.assert_close(theirs(x), tokens.mean(1))
        torch.testing.assert_close(again(x), tokens)


def test_viz_draws_word_maps_and_error_maps(tmp_path, cross_run, synth_dir, tiny_models):
    captions = json.loads((synth_dir / "captions.jsonl").read_text().splitlines()[0])["captions"][:2]
    done = tcjepa(
        "viz",
        cross_run,
        "--image",
        synth_dir / "images" / "000000.png",
        "--captions",
        captions[0],
        "--captions",
        captions[1],
        "--text-model",
        tiny_models / "t5",
        "--out",
        tmp_path / "viz.png",
        "--top",
        "4",
    )
    result = json.loads(done.stdout)
    assert (tmp_path / "viz.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(result["mean_error"]) == {"captions", "words shuffled", "no text"}
    assert len(result["top_words"]) == 4
    words = {w for c in captions for w in c.lower().replace(",", " ").replace(".", " ").replace(";", " ").split()}
    assert all(w["word"] in words for w in result["top_words"])


def test_viz_refuses_a_text_model_other_than_the_stores(tmp_path, cross_run, synth_dir):
    tcjepa("tiny-models", "--out", tmp_path / "other", "--seed", "1")
    done = tcjepa(
        "viz",
        cross_run,
        "--image",
        synth_dir / "images" / "000000.png",
        "--captions",
        "a red circle",
        "--text-model",
        tmp_path / "other" / "t5",
        "--out",
        tmp_path / "viz.png",
        check=False,
    )
    assert done.returncode == 2 and "not the encoder that made" in done.stderr
