"""`tcjepa demo` end to end, shrunk: every stage runs for real (vLLM included), then a rerun resumes."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import tcjepa


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_runs_every_stage_and_summarises_both_runs(tmp_path):
    out = tmp_path / "demo"
    args = ("demo", "--out", out, "--n-images", 100, "--t5-steps", 10, "--train-steps", 4)
    done = tcjepa(*args, timeout=900)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in summary["results"]] == ["none", "cross"]
    assert set(summary["recipes"]) == {"tiny-vlm", "synthetic-scenes"}
    for row in summary["results"]:
        assert 0 <= row["linear"] <= 1 and 0 <= row["dense_miou"] <= 1 and row["images_per_s"] > 0
    none, cross = summary["results"]
    assert none["val_true"] == none["val_shuffled"] == none["val_notext"]  # `none` cannot read captions
    assert cross["val_true"] != cross["val_notext"]
    table = (out / "summary.md").read_text()
    assert table.startswith("| mode | linear |") and "| none |" in table and "| cross |" in table
    assert [r["mode"] for r in summary["floors"]] == ["floor: random init", "floor: pixels"]
    assert "| floor: random init | " in table and "| floor: pixels | " in table
    reports = {
        mode: json.loads((out / "runs" / mode / "eval" / "labels.json").read_text()) for mode in ("none", "cross")
    }
    assert reports["cross"]["floors_from"] == str(out / "runs" / "none" / "eval" / "labels.json")
    assert reports["cross"]["baseline"] == reports["none"]["baseline"], "cross measured the floors again"
    for plot in summary["plots"]:
        assert open(plot, "rb").read(4) == b"\x89PNG"
    for mode in ("none", "cross"):
        assert json.loads((out / "runs" / mode / "eval" / "labels.json").read_text())["step"] == 4

    again = tcjepa(*args, timeout=900)  # every stage finds its output and skips or resumes
    assert "captioned 0 images" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["results"] == summary["results"]


def test_demo_refuses_an_out_dir_made_with_other_sizes(tmp_path, synth_dir):
    out = tmp_path / "demo"
    shutil.copytree(synth_dir, out / "data")  # 40 scenes
    done = tcjepa("demo", "--out", out, "--n-images", 50, check=False)
    assert done.returncode == 2 and "holds a demo of 40 scenes, not 50" in done.stderr
