"""`tcjepa eval`, `export` and `viz` on a real (tiny) trained run, and the probes on data with a known answer."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.export import export_run, load_exported
from evaluation.features import extract_features, load_run, load_trained_encoder, pixel_patches, random_encoder
from evaluation.labels import dense_probe_name, patch_labels, read_labels
from evaluation.logistic import fit_logistic
from evaluation.preprocess import CentreCrop, centre_crop, resize_and_crop
from evaluation.probes import (
    AttentiveProbe,
    Split,
    attentive_probe,
    average_precision,
    dense_probe,
    knn_probe,
    knn_scores,
    linear_probe,
    mean_average_precision,
    mean_iou,
    multilabel_probe,
    random_split,
)
from evaluation.protocol import GRAD_TOLERANCE, L2_GRID, L2_LIMITS
from pipeline.core.errors import UserError
from pipeline.core.sources import list_images
from tests.support.commands import refused, tcjepa
from tests.support.models import another_t5


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
    assert linear_probe(x, y, split).metrics["top1"] == 1.0
    assert knn_probe(x, y, split).metrics["top1"] == 1.0
    noise = np.random.default_rng(1).integers(5, size=len(y))
    assert linear_probe(x, noise, split).metrics["top1"] < 0.45
    assert knn_probe(x, noise, split).metrics["top1"] < 0.45


def test_linear_probe_sweep_picks_by_held_out_accuracy():
    """Few images, 3 weakly informative dimensions among 64: the penalties' held-out accuracies differ, and the
    chosen one is the best and no end of what was tried."""
    rng = np.random.default_rng(0)
    y = rng.integers(3, size=120)
    x = rng.normal(size=(120, 64)).astype(np.float32)
    x[:, :3] += np.eye(3)[y]
    result = linear_probe(x, y, random_split(len(y), 0.25, 0.3, seed=0))
    assert {f"l2={l2:.0e}" for l2 in L2_GRID} <= set(result.validation)
    assert len(set(result.validation.values())) > 1, "every candidate scored the same: the test shows nothing"
    assert result.validation[f"l2={result.chosen['l2']:.0e}"] == max(result.validation.values())
    assert result.chosen["converged"] and not result.chosen["at_edge"]


def test_a_best_penalty_at_an_end_of_the_grid_extends_it_or_says_so():
    """Separable clusters: the weakest penalty wins, so the sweep goes below the grid, down to its limit, and the
    result says the optimum sits at the edge of what it may try. Pure noise: the strongest wins, the grid is
    extended upwards."""
    x, y = _clusters(300, 4, 8, 0.1, seed=3)
    result = linear_probe(x, y, random_split(len(y), 0.25, 0.2, seed=0))
    tried = sorted(float(k.removeprefix("l2=")) for k in result.validation)
    assert tried[0] < min(L2_GRID) or not result.chosen["at_edge"], result.validation
    if result.chosen["at_edge"]:
        assert tried[0] == pytest.approx(L2_LIMITS[0]) or tried[-1] == pytest.approx(L2_LIMITS[1])
    rng = np.random.default_rng(5)
    noise = linear_probe(
        rng.normal(size=(300, 8)).astype(np.float32), rng.integers(4, size=300), random_split(300, 0.25, 0.2, 0)
    )
    tried = sorted(float(k.removeprefix("l2=")) for k in noise.validation)
    assert tried[-1] > max(L2_GRID) or not noise.chosen["at_edge"], noise.validation


@pytest.mark.parametrize("l2", [1e-4, 1e-2, 1.0])
def test_the_logistic_fit_is_scikit_learns_at_the_same_penalty(l2):
    """One fit against scikit-learn's LogisticRegression (L-BFGS, tol 1e-10) with C = 1 / (l2 · n) on the same
    standardised features: the same weights and the same predictions."""
    from sklearn.linear_model import LogisticRegression

    x, y = _clusters(500, 4, 12, 2.0, seed=7)
    ours = fit_logistic(torch.from_numpy(x), torch.from_numpy(y), 4, l2)
    assert ours.converged and ours.gradient <= GRAD_TOLERANCE
    z = (x - x.mean(0)) / x.std(0)
    theirs = LogisticRegression(C=1 / (l2 * len(y)), tol=1e-10, max_iter=10_000).fit(z, y)
    # the same objective at both answers: a convex problem has one minimum, and ours is at it
    zt, yt = torch.from_numpy(z).double(), torch.from_numpy(y)

    def objective(weight: np.ndarray, bias: np.ndarray) -> float:
        w = torch.from_numpy(np.asarray(weight, dtype=np.float64))
        logits = zt @ w.T + torch.from_numpy(np.asarray(bias, dtype=np.float64))
        return float(torch.nn.functional.cross_entropy(logits, yt) + l2 / 2 * w.square().sum())

    ours_objective = objective(ours.weight.numpy(), ours.bias.numpy())
    assert ours_objective - objective(theirs.coef_, theirs.intercept_) <= 1e-6 * max(ours_objective, 1.0)
    probabilities = torch.softmax(ours.logits(torch.from_numpy(x)), 1).numpy()
    # ours stops at a largest gradient entry of 1e-5 (it counts 1e-4, scikit-learn's default tol, as converged); at
    # a weak penalty the objective is flat, so the probabilities agree less closely than the objective does
    np.testing.assert_allclose(probabilities, theirs.predict_proba(z), atol=2e-3)
    assert (probabilities.argmax(1) == theirs.predict(z)).all()
    # scikit-learn's multinomial weights are defined up to a shift shared by the classes, as ours are
    scale = float(np.abs(theirs.coef_).max())
    np.testing.assert_allclose(
        ours.weight.numpy() - ours.weight.numpy().mean(0), theirs.coef_ - theirs.coef_.mean(0), atol=0.01 * scale
    )


def test_the_linear_probe_agrees_with_scikit_learn_on_a_hard_problem():
    """Overlapping classes in 32 dimensions, few images: the probe's test accuracy at its chosen penalty equals
    scikit-learn's at the same penalty within 0.01, and scikit-learn's own best penalty on the same validation split
    scores the same on test within 0.01."""
    from sklearn.linear_model import LogisticRegression

    x, y = _clusters(400, 5, 32, 6.0, seed=11)
    split = random_split(len(y), 0.25, 0.2, seed=0)
    ours = linear_probe(x, y, split)
    trainval = np.concatenate([split.train, split.val])

    def sklearn_test_accuracy(l2: float, rows: np.ndarray) -> tuple[float, float]:
        mean, std = x[rows].mean(0), x[rows].std(0)
        model = LogisticRegression(C=1 / (l2 * len(rows)), tol=1e-8, max_iter=10_000)
        model.fit((x[rows] - mean) / std, y[rows])
        return model.score((x[split.val] - mean) / std, y[split.val]), model.score(
            (x[split.test] - mean) / std, y[split.test]
        )

    at_ours = sklearn_test_accuracy(ours.chosen["l2"], trainval)[1]
    assert abs(ours.metrics["top1"] - at_ours) <= 0.01
    grid = [float(k.removeprefix("l2=")) for k in ours.validation]
    best = max(grid, key=lambda l2: sklearn_test_accuracy(l2, split.train)[0])
    assert abs(ours.metrics["top1"] - sklearn_test_accuracy(best, trainval)[1]) <= 0.01


def test_knn_votes_are_weighted_by_exp_cosine_over_t_as_dino_does():
    """Query (1, 0); bank: one class-0 row at cos 1, two class-1 rows at cos 0.8, one class-0 row at cos -1.

    With k = 3 the far row is not a neighbour. A majority vote would say class 1; DINO's weights say class 0:
    exp(1 / 0.07) = 1.6e6 against 2 exp(0.8 / 0.07) = 1.8e5."""
    bank = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.8, -0.6], [-2.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    scores = knn_scores(bank, labels, torch.tensor([[3.0, 0.0]]), classes=2, k=3, t=0.07)
    expected = torch.tensor([[np.exp(1 / 0.07), 2 * np.exp(0.8 / 0.07)]], dtype=torch.float32)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=0)
    x = np.concatenate([bank.numpy(), [[3.0, 0.0]]]).astype(np.float32)
    y = np.array([0, 1, 1, 0, 0])
    split = Split(np.array([0, 1, 2]), np.array([3]), np.array([4]))
    assert knn_probe(x, y, split, k=3).metrics["top1"] == 1.0
    assert knn_probe(x, y, split, k=3, t=1e6).metrics["top1"] == 0.0  # T → ∞: a plain majority vote, class 1


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


def test_average_precision_by_hand_with_ties():
    """Scores 0.9, 0.8, 0.8, 0.4, 0.4, 0.4, 0.1 with positives at 0.9, one 0.8, one 0.4 and 0.1 (4 positives).
    Thresholds high to low: precision 1/1, 2/3 (the tied 0.8s pass together), 3/6, 4/7, each gaining a quarter of
    the recall: AP = (1 + 2/3 + 1/2 + 4/7) / 4 = 0.68452, as scikit-learn's average_precision_score defines it."""
    scores = np.array([0.9, 0.8, 0.8, 0.4, 0.4, 0.4, 0.1])
    truth = np.array([1, 0, 1, 1, 0, 0, 1], dtype=bool)
    assert average_precision(scores, truth)[0] == pytest.approx((1 + 2 / 3 + 1 / 2 + 4 / 7) / 4)
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(0)
    for _ in range(20):  # ties and all: the reference agrees on random rankings too
        many, hits = rng.integers(0, 5, 40) / 4, rng.random(40) < 0.3
        assert average_precision(many, hits)[0] == pytest.approx(average_precision_score(hits, many))
    # the tie matters: with the positive 0.8 ranked first of its pair, AP would be (1 + 1 + 1/2 + 4/7) / 4
    assert average_precision(scores + [0, 0, 1e-9, 0, 0, 0, 0], truth)[0] == pytest.approx((1 + 1 + 1 / 2 + 4 / 7) / 4)
    columns = np.stack([scores, -scores, scores], axis=1)
    truths = np.stack([scores > 0.5, scores > 0.5, np.zeros(7, dtype=bool)], axis=1)
    ap = average_precision(columns, truths)
    assert ap[0] == 1.0 and ap[1] == pytest.approx((2 * 2 / 6 + 3 / 7) / 3) and np.isnan(ap[2])
    assert mean_average_precision(columns, truths) == (pytest.approx((ap[0] + ap[1]) / 2), 2)


def _tag_scenes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tags [n, 12] of 4 colours × 3 shapes, 1–3 objects per scene; features that say which pairs are present;
    features that say only which colours and which shapes are: no binding)."""
    rng = np.random.default_rng(seed)
    tags = np.zeros((n, 12), dtype=bool)
    for row in range(n):
        tags[row, rng.choice(12, int(rng.integers(1, 4)), replace=False)] = True
    pairs = tags.reshape(n, 4, 3)
    bound = tags + 0.1 * rng.normal(size=(n, 12))
    bag = np.concatenate([pairs.any(2), pairs.any(1)], axis=1) + 0.1 * rng.normal(size=(n, 7))
    return tags, bound.astype(np.float32), bag.astype(np.float32)


def test_multilabel_probe_reads_present_pairs_and_needs_binding():
    tags, bound, bag = _tag_scenes(400, seed=0)
    split = random_split(len(tags), 0.25, 0.2, seed=0)
    result = multilabel_probe(bound, tags, split)
    assert result.metrics["map"] > 0.99 and result.split["labels"] == 12 and result.split["scored_labels"] == 12
    assert {f"l2={l2:.0e}" for l2 in L2_GRID} <= set(result.validation) and result.chosen["converged"]
    noise = np.random.default_rng(1).normal(size=bound.shape).astype(np.float32)
    prevalence = tags[split.test].mean()  # a ranking that knows nothing scores about the share of positives
    assert multilabel_probe(noise, tags, split).metrics["map"] < prevalence + 0.15
    # colours and shapes without their binding leave pairs ambiguous in scenes with several objects
    unbound = multilabel_probe(bag, tags, split).metrics["map"]
    assert prevalence + 0.15 < unbound < result.metrics["map"] - 0.1


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
    assert {"lr=0.001", "lr=0.003", "lr=0.01"} <= set(result.validation) and not result.chosen["at_edge"]


@pytest.mark.parametrize(("dim", "heads"), [(16, 4), (192, 8), (3, 3)])
def test_attentive_probe_attends_as_multihead_attention_does_in_values_and_gradients(dim, heads):
    """The probe computes its one query's attention query first, with the token LayerNorm's scale and shift folded
    in; `nn.LayerNorm` then `nn.MultiheadAttention` (its own parameters) are the reference."""
    torch.manual_seed(0)
    probe = AttentiveProbe(dim, heads, classes=5)
    with torch.no_grad():  # biases and the norm's affine away from their init, so that their terms are tested too
        probe.attn.in_proj_bias.normal_()
        probe.attn.out_proj.bias.normal_()
        probe.norm_tokens.weight.normal_()
        probe.norm_tokens.bias.normal_()
    tokens = 3 + 2 * torch.randn(6, 11, dim)
    kv = probe.norm_tokens(tokens)
    query = probe.query.expand(len(kv), -1, -1)
    fast, reference = probe.attend(tokens), probe.attn(query, kv, kv, need_weights=False)[0]
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    params = [probe.query, probe.attn.in_proj_weight, probe.attn.in_proj_bias, probe.attn.out_proj.weight]
    params += [probe.norm_tokens.weight, probe.norm_tokens.bias]
    upstream = torch.randn_like(reference)
    for got, want in zip(
        torch.autograd.grad((fast * upstream).sum(), params, allow_unused=True),
        torch.autograd.grad((reference * upstream).sum(), params),
    ):
        torch.testing.assert_close(torch.zeros_like(want) if got is None else got, want, rtol=1e-4, atol=1e-5)


# --- labels ------------------------------------------------------------------------------


def test_centre_crop_is_the_fields_resize_then_crop():
    """224 from 256, and the rounding torchvision's Resize(int) + CenterCrop use, on a wide and a tall image."""
    assert centre_crop((500, 375), 224) == CentreCrop(341, 256, 58, 16, 224)
    assert centre_crop((375, 500), 224) == CentreCrop(256, 341, 16, 58, 224)
    transforms = pytest.importorskip("torchvision.transforms")
    from PIL import Image

    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (37, 90, 3), dtype=np.uint8))
    theirs = transforms.Compose(
        [transforms.Resize(73, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(64)]
    )(im)
    np.testing.assert_array_equal(resize_and_crop(im, 64), np.asarray(theirs))


def test_patch_labels_follow_the_patch_grid_of_the_centre_crop():
    cells = np.array([[1, 2], [3, 4]])  # 2×2 cells of 16 px: a 32 px image
    # 32 px at size 32: resized to 36, cropped at 2; patch centres 4, 12, 20, 28 land on 5.3, 12.4, 19.6, 26.7
    assert patch_labels(cells, 16, (32, 32), 32, (4, 4)).reshape(4, 4).tolist() == [
        [1, 1, 2, 2],
        [1, 1, 2, 2],
        [3, 3, 4, 4],
        [3, 3, 4, 4],
    ]
    assert patch_labels(cells, 16, (32, 32), 32, (1, 1)).tolist() == [4]  # the centre (16, 16) lies in the last cell
    # A 64×32 image whose map covers only its left half: resized to 72×36 and cropped at x = 20, the crop's columns
    # land on x = 21.3, 28.4, 35.6, 42.7 of the original: two in the right-hand cell, two off the map.
    assert patch_labels(cells, 16, (64, 32), 32, (2, 4)).reshape(2, 4).tolist() == [[2, 2, -1, -1], [4, 4, -1, -1]]


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


def test_labels_carry_named_cell_maps_and_tags(tmp_path, synth_dir):
    refs = list_images([synth_dir / "images"])
    lines = [
        {
            "image": "images/000001.png",
            "label": "a",
            "cells": [[1, 2]],
            "cell_size": 16,
            "cell_maps": {"shape": [[0, 3]]},
            "tags": ["red circle", "blue cross"],
        },
        {"image": "images/000002.png", "label": "b", "cell_size": 8, "cell_maps": {"size": [[2]], "shape": [[1]]}},
        {"image": "images/000003.png", "label": "b", "tags": []},
    ]
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    labels = read_labels(tmp_path / "labels.jsonl", refs, image_root=synth_dir)
    assert labels.map_names == ["cells", "shape", "size"]
    assert [dense_probe_name(m) for m in labels.map_names] == ["dense", "dense_shape", "dense_size"]
    assert labels.cell_maps["cells"][1] is None and labels.cell_maps["shape"][1].tolist() == [[1]]
    assert labels.cell_maps["size"][0] is None and labels.cell_size == [16, 8, 0]
    assert labels.tag_names == ["blue cross", "red circle"]
    assert labels.tags.tolist() == [[True, True], [False, False], [False, False]]
    assert labels.tagged.tolist() == [True, False, True] and labels.has_tags
    line = '{"image": "images/000001.png", "label": 1, '
    for bad, message in [
        (line + '"cell_maps": [[1]], "cell_size": 16}', "cell_maps must be an object"),
        (line + '"cell_maps": {"Shape": [[1]]}, "cell_size": 16}', "cell_maps name 'Shape'"),
        (line + '"cell_maps": {"cells": [[1]]}, "cell_size": 16}', "cell_maps name 'cells'"),
        (line + '"cell_maps": {"shape": [1, 2]}, "cell_size": 16}', "cell_maps.shape must be"),
        (line + '"cell_maps": {"shape": [[1]]}}', "cell_size"),
        (line + '"tags": "red"}', "tags must be a list"),
        (line + '"tags": [true]}', "tags must be a list"),
    ]:
        (tmp_path / "bad.jsonl").write_text(bad + "\n")
        with pytest.raises(Exception, match=message):
            read_labels(tmp_path / "bad.jsonl", refs, image_root=synth_dir)


def test_only_a_report_that_records_its_floor_inputs_can_lend_its_floors(tmp_path):
    from evaluation.summary import recorded_floor_inputs

    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "old.json").write_text(json.dumps({"probes": {}}))
    (tmp_path / "new.json").write_text(json.dumps({"probes": {}, "floor_inputs": {"seed": 0}}))
    assert [recorded_floor_inputs(tmp_path / f"{n}.json") for n in ("absent", "junk", "list", "old")] == [None] * 4
    assert recorded_floor_inputs(tmp_path / "new.json") == {"seed": 0}
    with pytest.raises(ValueError, match="unknown feature set 'floor'"):
        extract_features(tmp_path, [], sets=("encoder", "floor"))


# --- the commands on a trained run -------------------------------------------------------


def _eval(*args, timeout: float = 600) -> object:
    return tcjepa("eval", *args, "--num-workers", "0", "--no-progress", timeout=timeout)


@pytest.mark.slow
def test_eval_reports_every_probe_with_its_floors_and_caches_features(cross_run, synth_dir):
    # every probe on three feature sets: the attentive probe's 3 x 300 steps dominate on a busy CPU
    done = _eval(cross_run, synth_dir / "images", "--labels", synth_dir / "labels.jsonl", timeout=2400)
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("step 12 | linear top1") and "dense patch_accuracy" in line and "attentive top1" in line
    assert "| dense_shape patch_accuracy" in line and "| multilabel map" in line
    assert "(baseline " in line and ", pixels " in line
    report = json.loads((cross_run / "eval" / "labels.json").read_text())
    assert report["step"] == 12 and report["labelled"] == 40 and report["undecodable"] == 0
    assert sum(report["split"].values()) == 40 and report["split_source"] == "random"
    assert report["protocol"]["knn"] == {"k": 20, "T": 0.07, "vote": "sum of exp(cos / T) over the k nearest"}
    # 64 px scenes for a 64 px model: the whole image, so that each patch sees its labelled cell
    assert report["protocol"]["preprocessing"]["geometry"] == "whole"
    assert "the model's size" in report["protocol"]["preprocessing"]["chosen_by"]
    assert report["encoder"] == "target" and report["floor_seed"] != report["run_seed"] == 0
    assert report["baseline"]["seed"] == report["floor_seed"] == report["floor_inputs"]["floor_seed"]
    for part in (report, report["baseline"], report["pixels"], report["patch_pixels"]):
        assert set(part["probes"]) == {"linear", "knn", "dense", "dense_shape", "multilabel", "attentive"}
        for result in part["probes"].values():
            assert all(0 <= v <= 1 for v in result["metrics"].values())
            if "l2" in result["chosen"]:  # an optimum at an end is one past which the sweep could not go
                tried = sorted(float(k.removeprefix("l2=")) for k in result["validation"])
                assert result["chosen"]["converged"], result
                assert not result["chosen"]["at_edge"] or tried[0] <= 1e-9 or tried[-1] >= 1e2, result
        # a dense probe per per-cell map (the 41-class cell map, the 6-class shape map), a multi-label one on the tags
        assert part["probes"]["dense_shape"]["probe"] == "dense_shape"
        assert set(part["probes"]["dense_shape"]["metrics"]) == {"patch_accuracy", "miou"}
        multilabel = part["probes"]["multilabel"]["split"]
        assert multilabel["labels"] <= 40 and multilabel["scored_labels"] > 0
    # every patch of the 8×8 grid is labelled in both maps
    assert report["probes"]["dense_shape"]["split"]["test_patches"] == report["split"]["test"] * 64
    (cached,) = sorted((cross_run / "features").iterdir())
    names = sorted(["encoder", "patch_pixels", "pixels", f"baseline-seed{report['floor_seed']}"])
    assert sorted(p.name for p in cached.iterdir()) == names
    assert all((cached / name / "patches.npy").exists() for name in names)
    stamp = (cached / "encoder" / "pooled.npy").stat().st_mtime_ns
    again = _eval(cross_run, synth_dir / "images", "--labels", synth_dir / "labels.jsonl", "--probe", "linear")
    assert (cached / "encoder" / "pooled.npy").stat().st_mtime_ns == stamp, "features were extracted again"
    assert again.stdout.strip().splitlines()[-1].split(" | ")[1] == line.split(" | ")[1]


@pytest.mark.parametrize("geometry", ["crop", "whole"])
def test_cached_features_are_the_encoder_the_random_baseline_and_the_patches_pixels(cross_run, synth_dir, geometry):
    from PIL import Image

    from train.data import normalise

    refs = list_images([synth_dir / "images"])[:6]
    extract = dict(with_patches=True, device="cpu", num_workers=0, progress=False, geometry=geometry)
    sets = extract_features(cross_run, refs, floor_seed=5, **extract)
    images = [Image.open(r.path).convert("RGB") for r in refs]
    if geometry == "crop":
        placed = np.stack([resize_and_crop(im, 64) for im in images])
    else:  # 64 px scenes at the model's 64 px: the image itself
        placed = np.stack([np.asarray(im) for im in images])
    x = normalise(torch.from_numpy(placed.transpose(0, 3, 1, 2).copy()))
    with torch.no_grad():
        tokens = {
            "encoder": load_trained_encoder(cross_run).encoder(x),
            "baseline": random_encoder(load_run(cross_run), seed=5)(x),
            "pixels": pixel_patches(x, 8),
            "patch_pixels": x.unfold(2, 8, 8).unfold(3, 8, 8).permute(0, 2, 3, 1, 4, 5).reshape(6, 64, 192),
        }
    context = extract_features(cross_run, refs, floor_seed=5, sets=("encoder",), encoder="context", **extract)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.from_numpy(context["encoder"].pooled), load_trained_encoder(cross_run, "context").encoder(x).mean(1)
        )
    assert not np.allclose(context["encoder"].pooled, sets["encoder"].pooled, atol=1e-4)
    for name, expected in tokens.items():
        pooled = expected.flatten(1) if name == "pixels" else expected.mean(1)
        np.testing.assert_allclose(sets[name].pooled, pooled.numpy(), rtol=1e-5, atol=1e-5)
        patches = np.asarray(sets[name].patches, dtype=np.float32)
        np.testing.assert_allclose(patches, expected.numpy(), atol=2e-3, rtol=2e-3)
        assert sets[name].sizes.tolist() == [[64, 64]] * 6
    assert tokens["pixels"].shape == (6, 64, 3)
    assert not np.allclose(sets["baseline"].pooled, sets["encoder"].pooled, atol=1e-3)
    other = extract_features(cross_run, refs, floor_seed=6, sets=("baseline",), **extract)["baseline"]
    assert not np.allclose(other.pooled, sets["baseline"].pooled), "the baseline encoder ignores its seed"


def test_the_random_floor_is_never_the_runs_starting_weights(cross_run):
    """The trainer seeds torch with the run's seed and builds the encoder first: with the run's seed the floor would
    be the run's θ₀ bit for bit (the check has teeth). The floor's own seed, drawn from the evaluation's seed, is not
    the run's, and its weights share nothing with θ₀; an explicit --floor-seed equal to the run's is refused."""
    from evaluation.evaluate import EvalConfig, resolved_floor_seed
    from evaluation.features import floor_seed
    from train.config import ModelConfig
    from train.jepa import build_models

    trained = load_run(cross_run)
    torch.manual_seed(trained.config.seed)
    theta0 = build_models(ModelConfig.of(trained.config), text_dim=16)[0].encoder.state_dict()
    same = random_encoder(trained, trained.config.seed).state_dict()
    assert all(torch.equal(same[k], theta0[k]) for k in theta0)
    for seed in (0, 1, 2):
        drawn = floor_seed(seed, trained.config.seed)
        assert drawn != trained.config.seed and drawn not in (0, 1, 2)
        floor = random_encoder(trained, drawn).state_dict()
        weights = [k for k in theta0 if theta0[k].ndim > 1]
        assert not any(torch.equal(floor[k], theta0[k]) for k in weights)
    assert floor_seed(0, 5) == floor_seed(0, 6), "runs of a sweep share one floor"
    assert floor_seed(0, 5) != floor_seed(1, 5)
    with pytest.raises(UserError, match="--floor-seed 0 is the run's own seed"):
        resolved_floor_seed(EvalConfig(run=cross_run, floor_seed=0), 0)
    assert resolved_floor_seed(EvalConfig(run=cross_run, floor_seed=7), 0) == 7


@pytest.mark.slow
def test_eval_over_the_kept_checkpoints_draws_learning_curves_against_floors_measured_once(cross_run, synth_dir):
    """`--steps all` on the context encoder: one report per kept step (8 and 12 of the reference run), the floors
    measured with the first and lent to the next, and the curves (PNG and its table) beside them."""
    labels = ("--labels", synth_dir / "labels.jsonl", "--probe", "linear", "--probe", "knn")
    done = _eval(cross_run, synth_dir / "images", *labels, "--steps", "all", "--encoder", "context")
    lines = done.stdout.strip().splitlines()
    assert [line.split(" | ")[0] for line in lines[-2:]] == ["step 8", "step 12"]
    first, second = (
        json.loads((cross_run / "eval" / f"labels.step-{s:08d}.context.json").read_text()) for s in (8, 12)
    )
    assert first["encoder"] == second["encoder"] == "context" and (first["step"], second["step"]) == (8, 12)
    assert "floors_from" not in first and second["floors_from"].endswith("labels.step-00000008.context.json")
    assert second["baseline"] == first["baseline"] and second["patch_pixels"] == first["patch_pixels"]
    assert first["probes"]["linear"] != second["probes"]["linear"], "the two steps' encoders are not the same"
    table = json.loads((cross_run / "eval" / "labels.context.curves.json").read_text())
    assert table["steps"] == [8, 12] and table["encoder"] == "context"
    assert table["probes"]["linear"] == [
        first["probes"]["linear"]["metrics"]["top1"],
        second["probes"]["linear"]["metrics"]["top1"],
    ]
    assert set(table["floors"]) == {"baseline", "pixels", "patch_pixels"}
    assert (cross_run / "eval" / "labels.context.curves.png").stat().st_size > 1000
    no_step = refused("eval", cross_run, synth_dir / "images", *labels, "--steps", "5,8")
    assert "--steps 5,8: the run kept encoders of steps 8, 12 only" in no_step.stderr
    assert (
        "--eval-resize bent: choose auto, crop, whole"
        in refused("eval", cross_run, synth_dir / "images", *labels, "--eval-resize", "bent").stderr
    )


def test_the_curves_hold_every_figure_of_every_probe_at_every_step_beside_the_lenders_floors(tmp_path):
    """Dense probes give two figures per per-cell map: five figures in all here, drawn in two rows of panels."""
    from evaluation.curves import plot_learning_curves

    def probes(step: int) -> dict:
        dense = {"metrics": {"patch_accuracy": 0.5 + step / 100, "miou": 0.2 + step / 100}}
        return {"linear": {"metrics": {"top1": step / 100}}, "dense": dense, "dense_shape": dense}

    floors = {floor: {"probes": probes(0)} for floor in ("baseline", "pixels", "patch_pixels")}
    reports = [{"step": 8, "encoder": "context", "probes": probes(8), **floors}, {"step": 12, "probes": probes(12)}]
    png = plot_learning_curves(reports, tmp_path / "labels.context.json")
    table = json.loads((tmp_path / "labels.context.curves.json").read_text())
    assert png == tmp_path / "labels.context.curves.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert struct.unpack(">II", png.read_bytes()[16:24]) == (4 * 320, 2 * 240), "4 panels a row, 2 rows, at 80 dpi"
    assert table["steps"] == [8, 12] and table["encoder"] == "context"
    assert table["probes"] == {
        "dense_accuracy": [0.58, 0.62],
        "dense_miou": [0.28, 0.32],
        "dense_shape_accuracy": [0.58, 0.62],
        "dense_shape_miou": [0.28, 0.32],
        "linear": [0.08, 0.12],
    }
    assert table["floors"]["pixels"]["dense_shape_miou"] == 0.2 and set(table["floors"]) == set(floors)


def _imagenet_layout(root: Path, synth_dir: Path) -> Path:
    """The synth scenes as DIR/train/<colour>/<name>.JPEG (the first 30) and DIR/val/<colour>/ (the last 10),
    one more image outside any class folder, and one val class train lacks."""
    from PIL import Image

    rows = [json.loads(x) for x in (synth_dir / "labels.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        part = "train" if i < 30 else "val"
        folder = root / part / row["label"]
        folder.mkdir(parents=True, exist_ok=True)
        Image.open(synth_dir / row["image"]).convert("RGB").save(folder / f"{Path(row['image']).stem}.JPEG")
    Image.open(synth_dir / rows[0]["image"]).convert("RGB").save(root / "train" / "stray.JPEG")
    (root / "val" / "unseen").mkdir()
    Image.open(synth_dir / rows[1]["image"]).convert("RGB").save(root / "val" / "unseen" / "x.JPEG")
    return root


def test_eval_reads_class_folders_and_reports_both_floors(tmp_path, cross_run, synth_dir):
    data = _imagenet_layout(tmp_path / "imagenet", synth_dir)
    train_classes = sorted(p.name for p in (data / "train").iterdir() if p.is_dir())
    val_images = [p for c in train_classes if (data / "val" / c).is_dir() for p in (data / "val" / c).iterdir()]
    done = _eval(cross_run, "--train", data / "train", "--val", data / "val", "--probe", "linear", "--probe", "knn")
    assert "eval: 2 images outside a --train class folder; left out" in done.stderr
    report = json.loads((cross_run / "eval" / "imagenet.json").read_text())
    assert report["split_source"] == "folders" and report["labels"] is None
    assert report["classes"] == len(train_classes) and report["unmatched_labels"] == 2
    assert report["split"]["test"] == len(val_images) and report["split"]["train"] + report["split"]["val"] == 30
    assert report["split"]["val"] == 6  # --val-fraction 0.2 of the 30 --train images picks the hyper-parameters
    for part in (report, report["baseline"], report["pixels"]):
        assert set(part["probes"]) == {"linear", "knn"}
    assert "randomly initialised" in report["baseline"]["what"] and "pixels" in report["pixels"]["what"]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("step 12 | linear top1") and "(baseline " in line
    assert line.endswith(f"test {len(val_images)}")
    dense = refused("eval", cross_run, "--train", data / "train", "--val", data / "val", "--probe", "dense")
    assert dense.returncode == 2 and "class folders have none" in dense.stderr


def test_eval_leaves_out_an_undecodable_labelled_image(tmp_path, cross_run, synth_dir):
    images = tmp_path / "images"
    shutil.copytree(synth_dir / "images", images)
    (images / "000005.png").write_bytes(b"not a png")
    shutil.copy(synth_dir / "labels.jsonl", tmp_path / "labels.jsonl")
    _eval(
        cross_run,
        images,
        "--labels",
        tmp_path / "labels.jsonl",
        "--probe",
        "linear",
        "--probe",
        "knn",
        "--report",
        tmp_path / "report.json",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["undecodable"] == 1 and sum(report["split"].values()) == 39


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda run, d, t: _evaluate(t, [d / "images"], d / "labels.jsonl"), "no checkpoint.pt"),
        (lambda run, d, t: _evaluate(run, [d / "images"], t / "none.jsonl"), "no such file"),
        (lambda run, d, t: _evaluate(run, [d / "images"], d / "labels.jsonl", probes=("svm",)), "unknown probe"),
        (lambda run, d, t: _evaluate(run, [t], d / "labels.jsonl"), "no images"),
        (lambda run, d, t: _evaluate(run), "give IMAGES and --labels"),
        (lambda run, d, t: _evaluate(run, train=d / "images"), "--train and --val go together"),
        (
            lambda run, d, t: _evaluate(run, [d / "images"], d / "labels.jsonl", train=d, val=d),
            "replace IMAGES and --labels",
        ),
        (lambda run, d, t: _evaluate(run, train=d / "images", val=d / "images"), "no image sits in a class"),
        (lambda run, d, t: _evaluate(run, train=t / "none", val=d / "images"), "not a folder"),
        (lambda run, d, t: export_run(t, t / "x"), "no checkpoint.pt"),
        (lambda run, d, t: export_run(run, t / "x", fmt="onnx"), "--format onnx"),
        (lambda run, d, t: export_run(run, t / "x", encoder="ema"), "--encoder ema"),
    ],
)
def test_bad_eval_and_export_input_is_refused_before_any_work(tmp_path, cross_run, synth_dir, call, message):
    """Refused in process (the CLI adds nothing but the exit; the test below checks that once per command)."""
    from pipeline.core.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        call(cross_run, synth_dir, tmp_path)
    assert not (tmp_path / "x").exists()


def test_a_refused_eval_or_export_is_one_line_and_exit_2(tmp_path, synth_dir):
    for args in (
        ["eval", tmp_path, synth_dir / "images", "--labels", synth_dir / "labels.jsonl"],
        ["export", tmp_path, "--out", tmp_path / "x"],
    ):
        done = tcjepa(*args, check=False)
        assert done.returncode == 2 and "no checkpoint.pt" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def _evaluate(run: Path, images: list[Path] | None = None, labels: Path | None = None, **settings) -> None:
    from evaluation.evaluate import EvalConfig, evaluate

    evaluate(EvalConfig(run=run, images=images, labels=labels, num_workers=0, progress=False, **settings))


def test_dense_probe_without_cell_maps_is_refused_and_dropped_by_default(tmp_path, cross_run, synth_dir):
    rows = [json.loads(x) for x in (synth_dir / "labels.jsonl").read_text().splitlines()]
    (tmp_path / "plain.jsonl").write_text(
        "".join(json.dumps({"image": r["image"], "label": r["label"]}) + "\n" for r in rows)
    )
    plain = [synth_dir / "images", "--labels", tmp_path / "plain.jsonl", "--image-root", synth_dir]
    refusal = refused("eval", cross_run, *plain, "--probe", "dense")
    assert refusal.returncode == 2 and "per-cell labels" in refusal.stderr
    refusal = refused("eval", cross_run, *plain, "--probe", "multilabel")
    assert refusal.returncode == 2 and '"tags"' in refusal.stderr
    _eval(cross_run, *plain, "--probe", "linear", "--report", tmp_path / "r.json")
    assert set(json.loads((tmp_path / "r.json").read_text())["probes"]) == {"linear"}


def test_floors_are_reused_from_a_report_measured_alike_and_refused_from_any_other(tmp_path, cross_run, synth_dir):
    """`--floors-from`: another run of the same architecture, evaluated alike, takes the floors of the lender's
    report without extracting or probing them; a report measured otherwise is refused before any work."""
    from evaluation.evaluate import EvalConfig, evaluate
    from pipeline.core.errors import UserError

    data = [synth_dir / "images", "--labels", synth_dir / "labels.jsonl", "--probe", "linear", "--probe", "knn"]
    _eval(cross_run, *data, "--report", tmp_path / "lender.json")
    borrower = tmp_path / "borrower"
    shutil.copytree(cross_run, borrower, ignore=shutil.ignore_patterns("features", "eval"))
    _eval(borrower, *data, "--report", tmp_path / "borrower.json", "--floors-from", tmp_path / "lender.json")
    lender, report = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("lender", "borrower"))
    assert report["floors_from"] == str(tmp_path / "lender.json") and "floors_from" not in lender
    assert report["floor_inputs"] == lender["floor_inputs"]
    assert report["baseline"] == lender["baseline"] and report["pixels"] == lender["pixels"]
    assert report["probes"] == lender["probes"], "the same weights, probed again: the same figures"
    (cached,) = (borrower / "features").iterdir()
    assert [p.name for p in cached.iterdir()] == ["encoder"], "the floors' features were extracted"

    def borrow(**changes) -> None:
        base = dict(run=borrower, images=[synth_dir / "images"], labels=synth_dir / "labels.jsonl", num_workers=0)
        cfg = EvalConfig(**{**base, "probes": ("linear", "knn"), "progress": False, **changes})
        evaluate(cfg)

    for changes, why in [
        ({"seed": 1}, "with other floor_seed, seed;"),
        ({"floor_seed": 9}, "with other floor_seed;"),
        ({"eval_resize": "crop"}, "with other images, geometry;"),
        ({"probes": ("linear", "multilabel")}, "with other probes;"),
        ({"test_fraction": 0.3}, "with other split;"),
        ({"labels": tmp_path / "fewer.jsonl", "image_root": synth_dir}, "with other images, labels;"),
    ]:
        rows = (synth_dir / "labels.jsonl").read_text().splitlines()
        (tmp_path / "fewer.jsonl").write_text("\n".join(rows[:-1]) + "\n")
        with pytest.raises(UserError, match=f"--floors-from .*lender.json: its floors were measured {why}"):
            borrow(floors_from=tmp_path / "lender.json", **changes)
    fewer = evaluate(
        EvalConfig(
            run=borrower,
            images=[synth_dir / "images"],
            labels=synth_dir / "labels.jsonl",
            num_workers=0,
            probes=("linear",),
            progress=False,
            floors_from=tmp_path / "lender.json",
            report=tmp_path / "fewer-probes.json",
        )
    )
    assert set(fewer["baseline"]["probes"]) == {"linear"}, "a subset of the lender's probes borrows just those floors"
    assert fewer["baseline"]["probes"]["linear"] == lender["baseline"]["probes"]["linear"]
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable eval report"):
        borrow(floors_from=tmp_path / "junk.json")
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in lender.items() if k != "floor_inputs"}))
    with pytest.raises(UserError, match="not a report of `tcjepa eval` with its floors and their inputs"):
        borrow(floors_from=tmp_path / "old.json")


def test_labels_file_split_is_used(tmp_path, cross_run, synth_dir):
    rows = [json.loads(x) for x in (synth_dir / "labels.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["split"] = "test" if i < 10 else "train"
    (tmp_path / "split.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = ["--labels", tmp_path / "split.jsonl", "--image-root", synth_dir]
    _eval(cross_run, synth_dir / "images", *labels, "--probe", "knn", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["split_source"] == "labels file" and report["split"]["test"] == 10
    assert report["split"]["train"] + report["split"]["val"] == 30


# --- export --------------------------------------------------------------------------------


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()}


def _normalised_crops(synth_dir: Path, n: int) -> torch.Tensor:
    from PIL import Image

    from train.data import normalise

    refs = list_images([synth_dir / "images"])[:n]
    crops = np.stack([resize_and_crop(Image.open(r.path).convert("RGB"), 64) for r in refs])
    return normalise(torch.from_numpy(crops.transpose(0, 3, 1, 2).copy()))


def _timm_model(directory: Path) -> torch.nn.Module:
    import timm  # a dev dependency

    cfg = json.loads((directory / "config.json").read_text())
    overlay = {"file": str(directory / "model.safetensors")}
    return timm.create_model(cfg["architecture"], pretrained=True, pretrained_cfg_overlay=overlay, **cfg["model_args"])


def test_export_loads_into_timm_by_name_with_no_missing_or_unexpected_keys(tmp_path, cross_run, synth_dir):
    import timm
    from safetensors.torch import load_file

    done = tcjepa("export", cross_run, "--out", tmp_path / "export")
    assert json.loads(done.stdout)["step"] == 12 and json.loads(done.stdout)["weights"] == "target"
    assert _modes(tmp_path / "export") == {"config.json": 0o644, "model.safetensors": 0o644}
    theirs = _timm_model(tmp_path / "export").eval()  # timm loads strictly: a missing or extra key raises
    saved = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(saved) == set(theirs.state_dict())
    by_folder = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()
    data_cfg = timm.data.resolve_data_config({}, model=by_folder)
    assert data_cfg["crop_pct"] == 0.875 and data_cfg["input_size"] == (3, 64, 64)
    ours = load_trained_encoder(cross_run).encoder
    again = load_exported(tmp_path / "export")
    x = _normalised_crops(synth_dir, 3)
    with torch.no_grad():
        tokens = ours(x)
        torch.testing.assert_close(theirs.forward_features(x), tokens)
        torch.testing.assert_close(theirs(x), tokens.mean(1))
        torch.testing.assert_close(by_folder.forward_features(x), tokens)
        torch.testing.assert_close(again(x), tokens)


def test_export_hf_loads_into_transformers_ijepa_and_agrees_with_timm(tmp_path, cross_run, synth_dir):
    from transformers import IJepaModel

    tcjepa("export", cross_run, "--out", tmp_path / "timm")
    done = tcjepa("export", cross_run, "--out", tmp_path / "hf", "--format", "hf")
    assert json.loads(done.stdout)["format"] == "hf"
    assert _modes(tmp_path / "hf") == {"config.json": 0o644, "model.safetensors": 0o644, "tcjepa.json": 0o644}
    hf, info = IJepaModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    x = _normalised_crops(synth_dir, 4)
    with torch.no_grad():
        theirs = hf.eval()(pixel_values=x).last_hidden_state
        timm_tokens = _timm_model(tmp_path / "timm").eval().forward_features(x)
    cosine = torch.nn.functional.cosine_similarity(theirs, timm_tokens, dim=-1)
    assert theirs.shape == timm_tokens.shape == (4, 64, 192)
    assert cosine.min() >= 0.9999, cosine.min()
    with pytest.raises(Exception, match="IJepaModel"):
        load_exported(tmp_path / "hf")


def test_export_context_encoder_is_the_checkpoints_context_encoder(tmp_path, cross_run):
    from safetensors.torch import load_file

    tcjepa("export", cross_run, "--out", tmp_path / "target")
    tcjepa("export", cross_run, "--out", tmp_path / "context", "--encoder", "context")
    target = load_file(str(tmp_path / "target" / "model.safetensors"))
    context = load_file(str(tmp_path / "context" / "model.safetensors"))
    assert json.loads((tmp_path / "context" / "config.json").read_text())["weights"] == "context"
    assert set(target) == set(context)
    assert any(not torch.equal(target[k], context[k]) for k in target if k != "pos_embed")
    state = torch.load(cross_run / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    torch.testing.assert_close(context["blocks.0.attn.qkv.weight"], state["encoder.blocks.0.attn.qkv.weight"])
    torch.testing.assert_close(context["norm.weight"], state["encoder.norm.weight"])


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


def test_viz_refuses_a_text_model_other_than_the_stores(tmp_path, cross_run, synth_dir, tiny_models):
    done = tcjepa(
        "viz",
        cross_run,
        "--image",
        synth_dir / "images" / "000000.png",
        "--captions",
        "a red circle",
        "--text-model",
        another_t5(tiny_models, tmp_path / "other"),
        "--out",
        tmp_path / "viz.png",
        check=False,
    )
    assert done.returncode == 2 and "not the encoder that made" in done.stderr


def test_the_penalty_sweep_goes_past_a_winning_end_down_to_no_penalty_and_up_to_its_limit():
    """The sweep's logic alone, with fits that only carry their penalty: when weaker always scores better it goes a
    decade at a time past the grid, past the lower limit to no penalty at all (the end of the range: not an edge);
    when stronger always scores better it stops at the upper limit and says the optimum is at that edge; an optimum
    inside the grid is found without extending it."""
    from evaluation.logistic import LogisticFit, Standardise, sweep_l2

    def fake(l2: float, start: LogisticFit | None) -> LogisticFit:
        return LogisticFit(
            torch.zeros(1, 1), torch.zeros(1), Standardise(torch.zeros(1), torch.ones(1)), l2, 1, 0.0, 0.0
        )

    weaker = sweep_l2(fake, lambda f: (-f.l2, 0.0))
    assert weaker.chosen.l2 == 0.0 and not weaker.at_edge and weaker.converged
    assert min(float(k.removeprefix("l2=")) for k in weaker.scores if k != "l2=0e+00") == pytest.approx(L2_LIMITS[0])
    stronger = sweep_l2(fake, lambda f: (f.l2, 0.0))
    assert stronger.chosen.l2 == pytest.approx(L2_LIMITS[1]) and stronger.at_edge
    inside = sweep_l2(fake, lambda f: (-abs(math.log10(f.l2) + 3) if f.l2 else -99.0, 0.0))
    assert inside.chosen.l2 == pytest.approx(1e-3) and not inside.at_edge
    assert set(inside.scores) == {f"l2={l2:.0e}" for l2 in L2_GRID}, "an inside optimum extends nothing"
