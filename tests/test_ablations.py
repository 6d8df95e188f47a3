"""benchmarks/ablations.py: statistics over seeds, paired differences, the tables, the README rewrite between markers,
and (slow) the whole command at a tiny size."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from benchmarks import ablations
from tests.support.commands import python_module


def test_mean_and_sample_standard_deviation_over_seeds():
    assert ablations.mean_std([0.5, 0.7, 0.6]) == pytest.approx([0.6, 0.1])
    mean, std = ablations.mean_std([0.4])
    assert mean == 0.4 and math.isnan(std), "one seed shows no spread"
    assert ablations.summarise([{"linear": 0.5, "rankme": 3.0}, {"linear": 0.7}]) == {
        "linear": pytest.approx([0.6, math.sqrt(0.02)])
    }


def test_a_gap_counts_only_beyond_twice_its_standard_deviation():
    assert ablations.exceeds_spread(0.05, 0.02) and ablations.exceeds_spread(-0.05, 0.02)
    assert not ablations.exceeds_spread(0.04, 0.02), "exactly 2 std is not beyond"
    assert not ablations.exceeds_spread(0.03, 0.02)
    assert not ablations.exceeds_spread(0.5, math.nan), "one seed: no verdict"
    assert ablations.exceeds_spread(0.01, 0.0) and not ablations.exceeds_spread(0.0, 0.0)


def test_paired_differences_pair_by_seed_and_use_the_spread_of_the_differences():
    # cross beats none by 0.1 on every seed while both vary by 0.1 across seeds: unpaired, the gap would hide in
    # the spread; paired, it is beyond it.
    cross, none = {0: 0.6, 1: 0.7, 2: 0.8, 3: 0.9}, {0: 0.5, 1: 0.6, 2: 0.7}
    diff = ablations.paired_difference(cross, none)
    assert diff["per_seed"] == pytest.approx({0: 0.1, 1: 0.1, 2: 0.1}) and diff["mean"] == pytest.approx(0.1)
    assert diff["std"] == pytest.approx(0.0, abs=1e-12) and diff["exceeds_spread"]
    mixed = ablations.paired_difference({0: 0.6, 1: 0.5, 2: 0.75}, {0: 0.5, 1: 0.6, 2: 0.7})
    assert mixed["mean"] == pytest.approx(0.05 / 3) and not mixed["exceeds_spread"]
    with pytest.raises(ValueError, match="no seed in common"):
        ablations.paired_difference({0: 1.0}, {1: 1.0})


def _run(variant: str, seed: int, linear: float, multilabel: float) -> dict:
    floors = {"baseline": {"linear": 0.3, "multilabel": 0.35}, "pixels": {"linear": 0.6, "multilabel": 0.4}}
    return {
        "variant": variant,
        "seed": seed,
        "figures": {"linear": linear, "multilabel": multilabel, "rankme": 10.0 + seed, "val_true": 0.2},
        "floors": floors,
    }


RUNS = {
    ("none", "hard"): {s: _run("none", s, 0.45 + 0.05 * s, 0.5 + 0.1 * s) for s in (0, 1, 2)},
    ("cross", "hard"): {s: _run("cross", s, 0.44 + 0.06 * s, 0.6 + 0.1 * s) for s in (0, 1, 2)},
    ("cross", "ijepa"): {0: _run("cross", 0, 0.4, 0.5)},
}


def test_differences_cross_minus_none_per_mask_setting_with_the_floors_condition():
    diffs = ablations.differences(RUNS, ["linear", "multilabel", "rankme", "dense_miou"])
    assert list(diffs) == ["hard"], "ijepa has no `none` runs to pair with"
    hard = diffs["hard"]
    assert set(hard) == {"linear", "multilabel", "rankme"}
    assert hard["multilabel"]["mean"] == pytest.approx(0.1) and hard["multilabel"]["exceeds_spread"]
    assert hard["multilabel"]["above_floors"] is True
    # linear: −0.01, 0, +0.01 per seed; both variants' means (0.5) lie under the pixel floor (0.6)
    assert hard["linear"]["mean"] == pytest.approx(0.0, abs=1e-12) and not hard["linear"]["exceeds_spread"]
    assert hard["linear"]["above_floors"] is False
    assert "above_floors" not in hard["rankme"], "RankMe has no floor"


def test_tables_show_every_probe_beside_its_floors_and_bold_the_gaps_beyond_the_spread():
    table = {g: ablations.summarise([r["figures"] for r in runs.values()]) for g, runs in RUNS.items()}
    floors = {
        g: {f: ablations.summarise([r["floors"][f] for r in runs.values()]) for f in ("baseline", "pixels")}
        for g, runs in RUNS.items()
    }
    diffs = ablations.differences(RUNS, ["linear", "multilabel", "rankme"])
    text = ablations.markdown(table, floors, diffs, {g: len(r) for g, r in RUNS.items()}, "Caption.")
    lines = text.splitlines()
    assert lines[0] == "Caption."
    assert "| variant | masks | seeds | linear | multi-label mAP |" in lines
    assert "| none | hard | 3 | 0.500 ± 0.050 (0.300, 0.600) | 0.600 ± 0.100 (0.350, 0.400) |" in lines
    assert "| cross | ijepa | 1 | 0.400 (0.300, 0.600) | 0.500 (0.350, 0.400) |" in lines, "one seed: no ± column"
    assert "| variant | masks | seeds | RankMe | val loss |" in lines
    assert "| none | hard | 3 | 11.0 ± 1.0 | 0.2000 ± 0.0000 |" in lines
    assert "| masks | seeds | linear | multi-label mAP | RankMe |" in lines
    assert "| hard | 3 | +0.000 ± 0.010 † | **+0.100 ± 0.000** | +0.000 ± 0.000 |" in lines


def test_readme_table_is_written_between_the_markers_only(tmp_path):
    text = "| a | table |"
    readme = tmp_path / "README.md"
    begin, end = ablations.markers("ablations")
    other_begin, other_end = ablations.markers("short")
    readme.write_text(f"intro\n{begin}\nold table\n{end}\nmiddle\n{other_begin}\nold\n{other_end}\noutro\n")
    ablations.write_readme(readme, text, "ablations")
    assert readme.read_text() == f"intro\n{begin}\n{text}\n{end}\nmiddle\n{other_begin}\nold\n{other_end}\noutro\n"
    ablations.write_readme(readme, "short table", "short")
    assert (
        readme.read_text() == f"intro\n{begin}\n{text}\n{end}\nmiddle\n{other_begin}\nshort table\n{other_end}\noutro\n"
    )
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        ablations.write_readme(readme, text, "ablations")


def test_the_final_line_is_strict_json_with_null_for_one_seeds_spread():
    line = json.dumps(ablations.json_safe({"a": [0.5, math.nan], "b": {"c": (math.nan,)}}), allow_nan=False)
    assert json.loads(line) == {"a": [0.5, None], "b": {"c": [None]}}


TINY = [
    "--images",
    "24",
    "--t5-steps",
    "10",
    "--steps",
    "4",
    "--seeds",
    "0",
    *("--set", "depth=1", "--set", "width=96", "--set", "predictor_depth=1", "--set", "predictor_width=96"),
    *("--set", "batch_size=8", "--set", "image_size=32"),
    *("--set", "val_images=8", "--set", "log_every=2", "--set", "val_every=4", "--set", "checkpoint_every=4"),
    *("--set", "num_workers=0", "--set", "warmup_steps=2"),
]


def _ablations(*args) -> subprocess.CompletedProcess:
    return python_module("benchmarks.ablations", *args, timeout=3600)


@pytest.mark.slow
def test_text_experiment_runs_end_to_end_writes_the_readme_tables_and_resumes(tmp_path):
    """Both variants under the hard masks (the experiment's other mask setting runs the same code), one seed, a few
    steps of a tiny model, both encoders probed: every figure of the protocol lands in the tables and the JSON line;
    a second invocation trains and probes nothing again."""
    readme = tmp_path / "README.md"
    begin, end = ablations.markers("text-experiment")
    readme.write_text(f"# title\n{begin}\n{end}\n")
    work = tmp_path / "work"
    first = _ablations("--experiment", "text", "--work", work, *TINY, "--masks", "hard", "--readme", readme)
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["experiment"] == "text" and result["steps"] == 4 and result["captions"] == "partial"
    groups = [f"{v}/hard/{e}" for v in ("none", "cross") for e in ("target", "context")]
    assert list(result["table"]) == groups and len(result["runs"]) == 4
    probes = {
        "linear",
        "knn",
        "dense_accuracy",
        "dense_miou",
        "dense_shape_accuracy",
        "dense_shape_miou",
        "multilabel",
    }
    for group in groups:
        row = result["table"][group]
        assert probes | {"rankme", "val_true", "val_shuffled", "val_notext", "ratio", "step_s"} <= set(row)
        assert ("positive_cosine" in row) == group.startswith("cross")
        assert all(std is None for _, std in row.values()), "one seed: no spread"
        assert set(result["floors"][group]) == {"baseline", "pixels", "patch_pixels"}
        assert all(probes <= set(floor) for floor in result["floors"][group].values())
    for run in result["runs"]:
        assert (run["val_positive_cosine"] is None) == (run["variant"] == "none")
        assert run["train_s"] > 0 and run["eval_s"] > 0
    for target, context in zip(result["runs"][::2], result["runs"][1::2]):
        assert (target["encoder"], context["encoder"]) == ("target", "context") and target["seed"] == context["seed"]
    reports = {
        f"{p.parent.parent.name}/{p.name}": json.loads(p.read_text()) for p in work.glob("runs/*/*/eval/probes*.json")
    }
    assert len(reports) == 4 and {r["encoder"] for r in reports.values()} == {"target", "context"}
    lenders = sorted(name for name, report in reports.items() if "floors_from" not in report)
    assert lenders == ["none-hard-s0/probes.json"], "the floors are measured once per seed, then reused"
    assert all(r["baseline"] == reports["none-hard-s0/probes.json"]["baseline"] for r in reports.values())
    assert set(result["differences"]) == {"hard/target", "hard/context"}
    for diff in result["differences"].values():
        assert probes | {"rankme"} == set(diff) and all(d["std"] is None for d in diff.values())
        assert not any(d["exceeds_spread"] for d in diff.values())
    assert result["beyond_spread"] == []
    text = readme.read_text()
    assert text.startswith(f"# title\n{begin}\nMeasured by `benchmarks/ablations.py --experiment text`")
    assert "; changed by --set: `depth=1`, `width=96`, `predictor_depth=1`," in text, "the caption names every --set"
    assert "| variant | masks | encoder | seeds | linear | k-NN | dense acc | dense mIoU | shape acc |" in text
    assert "| cross | hard | context | 1 | " in text and "| hard/target | 1 | " in text and text.endswith(f"{end}\n")
    assert "Probes on the EMA target encoder and the context encoder." in text
    assert text.split(begin)[1].split(end)[0].strip() in first.stdout, "the README holds the printed tables"

    again = _ablations("--experiment", "text", "--work", work, *TINY, "--masks", "hard")
    assert json.loads(again.stdout.strip().splitlines()[-1]) == result
    assert "trained in" not in again.stderr, "finished runs were trained or probed again"


def test_protocol_v2_runs_the_factor_sweeps_chosen_configuration_with_text_on_free_scenes():
    """docs/experiments.md's protocol v2 amendment: `ema_0.996` at 400 steps, both variants, both mask settings, the
    paper's regulariser weights; captions read from free scenes."""
    v2 = ablations.EXPERIMENTS["text_v2"]
    assert v2.layout == "free" and v2.text and v2.section == "text-experiment-v2"
    assert set(v2.variants) == {"none", "cross"} and set(v2.masks) == {"ijepa", "hard"}
    chosen = {**ablations.FREE_TRAINING, **ablations.FACTORS["ema_0.996"], "steps": 400}
    assert {k: v2.training[k] for k in chosen} == chosen
    assert (v2.training["lambda_sparse"], v2.training["beta_consistency"]) == (0.1, 0.5)
