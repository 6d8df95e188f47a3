"""`tcjepa demo` end to end, shrunk: every stage runs for real (vLLM included), then a rerun resumes."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.demo import margins_table
from tests.support.commands import tcjepa


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_runs_every_stage_and_summarises_both_runs(tmp_path):
    out = tmp_path / "demo"
    args = ("demo", "--out", out, "--n-images", 24, "--t5-steps", 10, "--train-steps", 2)
    done = tcjepa(*args, timeout=900)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    runs = [(r["mode"], r["encoder"]) for r in summary["results"]]
    assert runs == [("none", "target"), ("none", "context"), ("cross", "target"), ("cross", "context")]
    assert set(summary["recipes"]) == {"tiny-vlm", "synthetic-scenes"}
    for row in summary["results"]:
        assert 0 <= row["linear"] <= 1 and 0 <= row["dense_miou"] <= 1 and row["images_per_s"] > 0
    none, _, cross, cross_context = summary["results"]
    assert none["val_true"] == none["val_shuffled"] == none["val_notext"]  # `none` cannot read captions
    assert cross["val_true"] != cross["val_notext"] and cross["ratio"] == cross["val_true"] / cross["val_shuffled"]
    # continuous figures: on 5 test images a top-1 accuracy often ties by chance
    figures = ("dense_miou", "dense_shape_miou", "multilabel")
    assert [cross_context[k] for k in figures] != [cross[k] for k in figures], "the context encoder's are the target's"
    assert summary["train_config"]["val_images"] == 6, "a quarter of 24 scenes held out, not the default 64"
    table = (out / "summary.md").read_text()
    assert table.startswith("| mode | encoder | linear |") and "| none | target |" in table
    assert "| cross | context |" in table and "| true/shuffled |" in table.splitlines()[0] + "|"
    assert summary["train_config"]["patch_size"] == 8 and summary["train_config"]["ema"] == [0.996, 1.0]
    assert json.loads((out / "data" / "classes.json").read_text())["layout"] == "free", "the scenes that learn"
    margins = table.split("\n\n")[1].splitlines()
    assert margins[0].startswith("| mode | encoder | shape mIoU − random init |") and len(margins) == 2 + 4
    floors = ["floor: random init", "floor: patch colours", "floor: patch pixels"]
    assert [r["mode"] for r in summary["floors"]] == floors
    assert all(f"| {floor} | " in table for floor in floors)
    evals = out / "runs"
    reports = {
        (mode, encoder): json.loads((evals / mode / "eval" / name).read_text())
        for mode in ("none", "cross")
        for encoder, name in (("target", "labels.json"), ("context", "labels.context.json"))
    }
    assert reports["cross", "target"]["floors_from"] == str(evals / "none" / "eval" / "labels.json")
    assert reports["none", "context"]["floors_from"] == str(evals / "none" / "eval" / "labels.json")
    assert reports["cross", "target"]["baseline"] == reports["none", "target"]["baseline"], "floors measured again"
    assert reports["none", "target"]["floor_seed"] != reports["none", "target"]["run_seed"]
    for plot in summary["plots"]:
        assert open(plot, "rb").read(4) == b"\x89PNG"
    for (_, encoder), report in reports.items():
        assert report["step"] == 2 and report["encoder"] == encoder

    again = tcjepa(*args, timeout=900)  # every stage finds its output and skips or resumes
    assert "captioned 0 images" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["results"] == summary["results"]


def test_demo_refuses_an_out_dir_made_with_other_sizes(tmp_path, synth_dir):
    out = tmp_path / "demo"
    shutil.copytree(synth_dir, out / "data")  # 40 scenes
    done = tcjepa("demo", "--out", out, "--n-images", 50, check=False)
    assert done.returncode == 2 and "holds a demo of 40 scenes, not 50" in done.stderr


def test_the_margins_are_each_encoder_minus_each_floor_beside_true_over_shuffled():
    rows = [
        {"mode": "none", "encoder": "target", "dense_shape_miou": 0.25, "multilabel": 0.30},
        {"mode": "cross", "encoder": "context", "dense_shape_miou": 0.20, "multilabel": 0.31, "ratio": 0.9871},
    ]
    floors = [
        {"mode": "floor: random init", "dense_shape_miou": 0.21, "multilabel": 0.26},
        {"mode": "floor: patch colours", "multilabel": 0.25},  # a floor without the dense probe
    ]
    lines = margins_table(rows, floors).splitlines()
    assert lines[0] == (
        "| mode | encoder | shape mIoU − random init | shape mIoU − patch colours | multi-label mAP − random init "
        "| multi-label mAP − patch colours | true/shuffled |"
    )
    assert lines[2] == "| none | target | +0.040 | – | +0.040 | +0.050 | – |"
    assert lines[3] == "| cross | context | -0.010 | – | +0.050 | +0.060 | 0.987 |"
