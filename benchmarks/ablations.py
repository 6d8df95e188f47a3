"""TC-JEPA vs I-JEPA side by side, the paper's ablations, and the text experiment, on `tcjepa synth` data.

Four experiments (`--experiment`), each a grid of variant × mask setting × seed, every cell a real `tcjepa train`
run in its own process, then `tcjepa eval` on the synth labels:

  ablations   the demo's training configuration (`pipeline.devkit.scenes.SCENE_TRAINING`, patch 16), I-JEPA masks,
              every variant below; `none` and `cross` over --seeds, the others over --ablation-seeds.
  text        issue 20's protocol (docs/experiments.md, section 1): patch 8 on 64 px, 600 steps, the paper's
              `norm` loss, `none` and `cross` under I-JEPA masks and hard masks (context 0.3–0.5), over --seeds.
  factors     issue 30's factor sweep: `none` on free scenes, one change of `FREE_TRAINING` per variant.
  text_v2     protocol v2 (docs/experiments.md, section 5): `text`'s grid on free scenes in the configuration the
              factor sweep found (`TEXT_V2_TRAINING`), run with --seeds 1 2 3.

Variants:

  none        I-JEPA: the predictor reads no text
  cross       TC-JEPA: per-layer cross-attention, N captions, λ and β at their defaults
  no_reg      cross with λ = β = 0 (no sparsity / consistency regularisers)
  n1, n8      cross with N = 1 or 8 captions per image
  sequence    the captions' words appended to the predictor's sequence instead
  int8        cross reading an int8 store of the same captions from the same T5 (`embed --store-dtype int8`)
  pca_half    cross reading a store projected to half the T5's width (`embed --project-dim`)

Probes: linear and k-NN on the image label (the most common colour), dense per patch on the colour × shape class
and on the shape alone, and the multi-label probe (which colour-shape pairs are present, mAP); `--attentive` adds
the attentive probe. Every probe is also run on the report's two floors: a random-init encoder of the same
architecture and raw pixels. Per run: RankMe and the validation loss with true / shuffled / no captions and the
share of positive patch–word cosines (from the run's metrics.jsonl).

The data, the T5 trained on the scene captions and the store are built once in --work; finished runs and their
probe reports are kept and skipped, so an interrupted invocation resumes where it stopped.

Prints three Markdown tables: probes (mean ± standard deviation over seeds, each beside its floors), training
figures, and the paired-by-seed differences cross − none with their standard deviation (bold where |mean| > 2 ×
std); then one final JSON line with every figure. `--readme docs/experiments.md` rewrites them between
`<!-- SECTION:begin -->` and `<!-- SECTION:end -->` in that file (`--section`, default the experiment's: the
markers of `ablations` and `text-experiment` are in docs/experiments.md); never typed by hand.

  python -m benchmarks.ablations --experiment text --work /tmp/text-experiment --seeds 0 1 2 \\
      --readme docs/experiments.md --section text-experiment
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import print_result, tcjepa  # first: sets the offline environment
from embedding_cache.store import EmbeddingStore
from evaluation.summary import floor_figures, recorded_floor_inputs, run_figures
from pipeline.devkit.scenes import (
    LEARNING_LAYOUT,
    LEARNING_TRAINING,
    SCENE_CAPTIONS,
    SCENE_IMAGES,
    SCENE_RECIPE,
    SCENE_TRAINING,
    prepare_scenes,
)
from pipeline.devkit.tiny_models import T5_STEPS

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"conditioning": "none"},
    "cross": {"conditioning": "cross"},
    "no_reg": {"conditioning": "cross", "lambda_sparse": 0.0, "beta_consistency": 0.0},
    "n1": {"conditioning": "cross", "captions_per_image": 1},
    "n8": {"conditioning": "cross", "captions_per_image": 8},
    "sequence": {"conditioning": "sequence"},
    "int8": {"conditioning": "cross"},
    "pca_half": {"conditioning": "cross"},
}
# Variants that read another store of the same captions from the same T5: its codec or projection is the variant
# (`tcjepa embed` flags; {half} is half the T5's width). The others read the float16 store.
STORE_VARIANTS: dict[str, list[str]] = {
    "int8": ["--store-dtype", "int8"],
    "pca_half": ["--project-dim", "{half}"],
}
MASKS: dict[str, dict[str, Any]] = {
    # I-JEPA's: the context block shows most of the image
    "ijepa": {"num_targets": 4, "target_scale": [0.15, 0.2], "context_scale": [0.85, 1.0]},
    # the context shows under half the image (on the 8×8 grid about 10 patches after the targets are cut out)
    "hard": {"num_targets": 4, "target_scale": [0.15, 0.2], "context_scale": [0.3, 0.5]},
}
# docs/experiments.md, section 1: the demo's configuration at patch 8 (a patch sees a quarter of a 16 px cell),
# 600 steps, the paper's loss and regulariser weights, every image keeping its whole context, bf16 autocast.
TEXT_TRAINING: dict[str, Any] = {
    **SCENE_TRAINING,
    "patch_size": 8,
    "steps": 600,
    "loss": "norm",
    "lambda_sparse": 0.1,
    "beta_consistency": 0.5,
    "context_equalise": "pad",
    "bf16": True,
}
PROBES = ("linear", "knn", "dense", "multilabel")
# Issue 30: what makes a JEPA collapse at small scale, one factor at a time. `none` (nothing reads the captions) on
# free scenes, where neither position nor a patch's own pixels answer the probes; patch 8 on 64 px, the tiny ViT,
# 600 steps, the paper's loss, EMA auto (at most 5% of the starting weights left in the target encoder).
FREE_TRAINING: dict[str, Any] = {**LEARNING_TRAINING, "conditioning": "none", "steps": 600, "ema": "auto"}
FACTORS: dict[str, dict[str, Any]] = {
    "base": {},
    "ema_0.996": {"ema": [0.996, 1.0]},
    "ema_0.999": {"ema": [0.999, 1.0]},
    "lr_3e-4": {"lr": 0.0003, "start_lr": 0.00006},
    "lr_3e-3": {"lr": 0.003},
    "wd_low": {"weight_decay": [0.04, 0.04]},
    "loss_smooth_l1": {"loss": "smooth_l1"},
    "loss_mse": {"loss": "mse"},
    "predictor_2": {"predictor_depth": 2},
    "predictor_wide": {"predictor_width": 384, "predictor_depth": 6},
    "context_hard": {"context_scale": [0.3, 0.5]},
    "context_cut": {"context_equalise": "cut"},
    "patch_16": {"patch_size": 16},
    "steps_1200": {"steps": 1200},
    "sigreg": {"sigreg": 0.5},  # LeJEPA's anti-collapse term on the context tokens (not the default)
}
VARIANTS.update({name: {"conditioning": "none", **change} for name, change in FACTORS.items()})
# Protocol v2 (docs/experiments.md, section 5): the configuration the sweep found (`LEARNING_TRAINING`, the demo's:
# `ema_0.996` at 400 steps), with the paper's regulariser weights for `cross`.
TEXT_V2_TRAINING: dict[str, Any] = {
    **LEARNING_TRAINING,
    "conditioning": "none",
    "lambda_sparse": 0.1,
    "beta_consistency": 0.5,
}


@dataclass(frozen=True)
class Experiment:
    training: dict[str, Any]
    variants: tuple[str, ...]
    masks: tuple[str, ...]
    section: str  # the name in the markers of the --readme file (docs/experiments.md)
    what: str  # the tables' first words
    layout: str = "grid"  # `tcjepa synth --layout`
    text: bool = True  # some variant reads captions: build the tiny T5 and the store
    curves: bool = False  # probe every kept checkpoint too (`tcjepa eval --steps all`): learning curves


EXPERIMENTS = {
    "ablations": Experiment(
        SCENE_TRAINING, tuple(VARIANTS), ("ijepa",), "ablations", "the demo's training configuration (patch 16)"
    ),
    "text": Experiment(
        TEXT_TRAINING,
        ("none", "cross"),
        ("ijepa", "hard"),
        "text-experiment",
        "docs/experiments.md's protocol (patch 8 on 64 px, `norm` loss, N=4 `before_mlp`)",
    ),
    "factors": Experiment(
        FREE_TRAINING,
        tuple(FACTORS),
        ("ijepa",),
        "factors",
        "issue 30's factor sweep (`none` on free scenes, patch 8 on 64 px, `norm` loss, EMA auto; one change each)",
        layout=LEARNING_LAYOUT,
        text=False,
        curves=True,
    ),
    "text_v2": Experiment(
        TEXT_V2_TRAINING,
        ("none", "cross"),
        ("ijepa", "hard"),
        "text-experiment-v2",
        "protocol v2 (free scenes, patch 8 on 64 px, `norm` loss, EMA 0.996 → 1, N=4 `before_mlp`)",
        layout=LEARNING_LAYOUT,
    ),
}
DIFFERENCE = ("cross", "none")  # paired by seed: cross − none
PROBE_COLUMNS = [
    ("linear", "linear"),
    ("knn", "k-NN"),
    ("attentive", "attentive"),
    ("dense_accuracy", "dense acc"),
    ("dense_miou", "dense mIoU"),
    ("dense_shape_accuracy", "shape acc"),
    ("dense_shape_miou", "shape mIoU"),
    ("multilabel", "multi-label mAP"),
]
TRAINING_COLUMNS = [
    ("rankme", "RankMe", "{:.1f}"),
    ("rankme_centred", "RankMe centred", "{:.1f}"),
    ("val_true", "val loss", "{:.4f}"),
    ("position_only", "position only", "{:.4f}"),
    ("val_shuffled", "shuffled", "{:.4f}"),
    ("val_notext", "no text", "{:.4f}"),
    ("ratio", "true/shuffled", "{:.3f}"),
    ("positive_cosine", "positive cos", "{:.3f}"),
    ("step_s", "s/step", "{:.2f}"),
]
Group = tuple[str, ...]  # (variant, masks, encoder): the variant first, then what a paired difference holds fixed
ENCODERS = ("target", "context")
ENCODER_NAMES = {"target": "EMA target encoder", "context": "context encoder"}
GROUP_NAMES = ("variant", "masks", "encoder")


# --- statistics over seeds ------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> list[float]:
    """[mean, sample standard deviation (n − 1)]; the deviation is NaN for one value: one seed shows no spread."""
    return [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else math.nan]


def exceeds_spread(mean: float, std: float, factor: float = 2.0) -> bool:
    """The protocol's rule: a gap counts when |mean difference| > factor × its standard deviation over seeds
    (never with one seed, whose deviation is NaN)."""
    return not math.isnan(std) and abs(mean) > factor * std


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """a − b paired by seed, over the seeds both have: per seed, mean, standard deviation, beyond the spread."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("no seed in common: nothing to pair")
    per_seed = {s: a[s] - b[s] for s in seeds}
    mean, std = mean_std(list(per_seed.values()))
    return {"per_seed": per_seed, "mean": mean, "std": std, "exceeds_spread": exceeds_spread(mean, std)}


def summarise(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per figure: [mean, standard deviation over the runs (seeds)]; a figure some runs lack is left out."""
    return {k: mean_std([r[k] for r in runs]) for k in runs[0] if all(k in r for r in runs)}


def _above_floors(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> bool | None:
    """Whether both variants' means of `key` lie above the mean of each of its floors (None: `key` has none)."""
    both = a + b
    names = [f for f in both[0]["floors"] if all(key in r["floors"].get(f, {}) for r in both)]
    if not names:
        return None
    top = max(statistics.mean(r["floors"][f][key] for r in both) for f in names)
    return min(statistics.mean(r["figures"][key] for r in side) for side in (a, b)) > top


def differences(runs: dict[Group, dict[int, dict[str, Any]]], keys: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per setting (a group less its variant: the masks, and the encoder probed) with both `DIFFERENCE` variants, per
    figure of `keys` both have: the paired difference cross − none, and whether both variants' means lie above their
    floors' (`above_floors`, figures with floors). Keyed by the setting's parts joined with "/"."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for setting in dict.fromkeys(group[1:] for group in runs):
        a, b = (runs.get((variant, *setting), {}) for variant in DIFFERENCE)
        if not set(a) & set(b):
            continue
        masks = "/".join(setting)
        out[masks] = {}
        for key in keys:
            if not all(key in r["figures"] for r in (*a.values(), *b.values())):
                continue
            diff = paired_difference(
                {s: r["figures"][key] for s, r in a.items()}, {s: r["figures"][key] for s, r in b.items()}
            )
            above = _above_floors(list(a.values()), list(b.values()), key)
            out[masks][key] = diff if above is None else {**diff, "above_floors": above}
    return out


def json_safe(value: Any) -> Any:
    """`value` with NaN (a deviation over one seed) as null, so that the final line is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# --- the runs ---------------------------------------------------------------------------------------------------


def _probes_done(report: dict[str, Any] | None, steps: int, probes: list[str]) -> bool:
    return report is not None and report["step"] == steps and all(p in report["probes"] for p in probes)


def runs_directory(work: Path, experiment: str, settings: dict[str, Any]) -> Path:
    """Where the grid's runs live: named by the experiment and a digest of the settings they share (steps and
    --set overrides included), so that a grid with other settings never resumes these runs; `settings.json` there
    says what they were."""
    text = json.dumps(settings, sort_keys=True)
    folder = work / "runs" / f"{experiment}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "settings.json").write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    return folder


def store_for(work: Path, variant: str) -> Path:
    """The store `variant` reads: the scenes' float16 store, or one embedded from the same cache by the same T5 with
    the variant's codec or projection (a finished embed is a no-op, so this resumes too)."""
    if variant not in STORE_VARIANTS:
        return work / "store"
    store = work / f"store-{variant}"
    half = EmbeddingStore(work / "store").width // 2
    flags = [flag.format(half=half) for flag in STORE_VARIANTS[variant]]
    tcjepa(
        "embed",
        "--cache",
        work / "cache",
        "--store",
        store,
        "--model",
        work / "models" / "t5",
        "--recipe",
        SCENE_RECIPE,
        "--device",
        "cpu",
        "--no-progress",
        *flags,
    )
    return store


def probes_report(run: Path, encoder: str = "target") -> Path:
    return run / "eval" / ("probes.json" if encoder == "target" else f"probes.{encoder}.json")


def floors_source(runs: Path, seed: int, probes: list[str], settings: dict[str, Any]) -> Path | None:
    """A report of this experiment's runs with `seed` and `probes`, of the encoder architecture `settings` give,
    that records its floors' inputs. Such runs share the images and labels, so one measurement of the floors serves
    them all (`tcjepa eval --floors-from` checks that it does)."""
    from evaluation.features import architecture
    from train.config import TrainConfig, apply

    wanted = architecture(apply(TrainConfig(), settings, "ablations"))
    for report in sorted(runs.glob(f"*-s{seed}/eval/probes.json")):
        inputs = recorded_floor_inputs(report)
        if inputs is not None and set(inputs["probes"]) == set(probes) and inputs["architecture"] == wanted:
            return report
    return None


def run_one(
    runs: Path,
    work: Path,
    settings: dict[str, Any],
    variant: str,
    masks: str,
    seed: int,
    probes: list[str],
    floors_from: Path | None = None,
    encoders: tuple[str, ...] = ENCODERS,
    curves: bool = False,
) -> dict[str, dict[str, Any]]:
    """Train (or resume, or reuse) one run in `runs` and probe each of its `encoders` (or reuse their reports);
    returns each encoder's figures and floors. `floors_from`: the report of a run of the same encoder architecture
    and seed, whose floors the probes reuse (the later encoders reuse the first's). `curves`: also every checkpoint
    the run kept (`tcjepa eval --steps all`), each encoder's curve in its record."""
    run = runs / f"{variant}-{masks}-s{seed}"
    timing_path = run / "ablation-timing.json"
    steps = settings["steps"]
    reports = {e: probes_report(run, e) for e in encoders}
    done = {e: json.loads(p.read_text()) if p.exists() else None for e, p in reports.items()}
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    if not all(_probes_done(report, steps, probes) for report in done.values()):
        config = run.with_name(f"{run.name}.yaml")
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({**settings, "seed": seed}))  # JSON is YAML
        reads_text = settings.get("conditioning", "cross") != "none"
        text = ["--cache", work / "cache", "--store", store_for(work, variant)] if reads_text else []
        text += ["--recipe", SCENE_RECIPE] if reads_text else []
        t0 = time.perf_counter()
        tcjepa("train", work / "data" / "images", *text, "--out", run, "--config", config, "--no-progress")
        t1 = time.perf_counter()
        for encoder in encoders:
            if _probes_done(done[encoder], steps, probes):
                continue
            lender = floors_from if encoder == encoders[0] else reports[encoders[0]]
            tcjepa(
                "eval",
                run,
                work / "data" / "images",
                "--labels",
                work / "data" / "labels.jsonl",
                *[x for name in probes for x in ("--probe", name)],
                "--seed",
                seed,
                "--encoder",
                encoder,
                "--no-progress",
                "--report",
                reports[encoder],
                *(["--floors-from", lender] if lender is not None else []),
            )
            done[encoder] = json.loads(reports[encoder].read_text())
        timing = {"train_s": round(t1 - t0, 1), "eval_s": round(time.perf_counter() - t1, 1)}
        timing_path.write_text(json.dumps(timing) + "\n")
        print(
            f"  {variant} / {masks} seed {seed}: trained in {timing['train_s']:.0f} s, "
            f"probed in {timing['eval_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    data = [work / "data" / "images", "--labels", work / "data" / "labels.jsonl"]
    for encoder in encoders if curves else ():
        table = run / "eval" / ("labels.curves.json" if encoder == "target" else f"labels.{encoder}.curves.json")
        if not table.exists():
            tcjepa(
                "eval",
                run,
                *data,
                *[x for name in probes for x in ("--probe", name)],
                *("--seed", seed, "--encoder", encoder, "--steps", "all", "--no-progress"),
                *("--floors-from", reports[encoders[0]]),
            )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in metrics if "val_loss_predict" in m][-1]
    out = {}
    for encoder, report in done.items():
        assert report is not None
        figures = run_figures(metrics, report)
        out[encoder] = {
            "variant": variant,
            "masks": masks,
            "encoder": encoder,
            "seed": seed,
            "figures": {**figures, "step_s": settings["batch_size"] / figures["images_per_s"]},
            "floors": floor_figures(report),
            "val_positive_cosine": val.get("val_positive_cosine"),
            **timing,
        }
        table = run / "eval" / ("labels.curves.json" if encoder == "target" else f"labels.{encoder}.curves.json")
        if curves:
            out[encoder]["curve"] = json.loads(table.read_text())
            out[encoder]["validation_curve"] = [
                {
                    k: m[k]
                    for k in ("step", "val_loss_predict", "val_loss_position_only", "val_rankme_centred")
                    if k in m
                }
                for m in metrics
                if "val_loss_predict" in m
            ]
    return out


# --- the tables ---------------------------------------------------------------------------------------------------


def _fmt(value: float, fmt: str = "{:.3f}") -> str:
    return "n/a" if math.isnan(value) else fmt.format(value)


def _cell(stat: list[float], fmt: str = "{:.3f}") -> str:
    mean, std = stat
    return _fmt(mean, fmt) + ("" if math.isnan(std) else f" ± {_fmt(std, fmt)}")


def _group_key(group: Group) -> str:
    return "/".join(group)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the column names, the rule, a line per row of cells."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _probe_cell(stat: list[float] | None, floors: dict[str, dict[str, list[float]]], key: str) -> str:
    """mean ± std over seeds, then the floors' means in brackets (random-init encoder, pixels)."""
    if stat is None:
        return "–"
    beside = [_fmt(floor[key][0]) for floor in floors.values() if key in floor]
    return _cell(stat) + (f" ({', '.join(beside)})" if beside else "")


def _difference_cell(d: dict[str, Any] | None) -> str:
    """+mean ± std of the paired differences, bold beyond the spread, † when a variant is not above its floors."""
    if d is None:
        return "–"
    mean = round(d["mean"], 3) + 0.0  # no "-0.000"
    text = f"{mean:+.3f}" + ("" if math.isnan(d["std"]) else f" ± {d['std']:.3f}")
    text = f"**{text}**" if d["exceeds_spread"] else text
    return text + (" †" if d.get("above_floors") is False else "")


def markdown(
    table: dict[Group, dict[str, list[float]]],
    floors: dict[Group, dict[str, dict[str, list[float]]]],
    diffs: dict[str, dict[str, dict[str, Any]]],
    seeds: dict[Group, int],
    caption: str,
) -> str:
    """The three tables: probes beside their floors, training figures, paired differences cross − none."""
    probe_cols = [(k, name) for k, name in PROBE_COLUMNS if any(k in row for row in table.values())]
    train_cols = [c for c in TRAINING_COLUMNS if any(c[0] in row for row in table.values())]
    lead = [*GROUP_NAMES[: len(next(iter(table)))], "seeds"]
    lines = [
        caption,
        "",
        "Probes: mean ± standard deviation over seeds; in brackets the same probe's floors, (random-init encoder "
        "seeded apart from the run, mean colour of each patch, each patch's full pixels), means over the same seeds.",
        "",
        *_table(
            lead + [name for _, name in probe_cols],
            [
                [*g, str(seeds[g])] + [_probe_cell(row.get(k), floors[g], k) for k, _ in probe_cols]
                for g, row in table.items()
            ],
        ),
        "",
        "Training (last validation; true/shuffled < 1: the predictor uses the text; positive cos: share of positive "
        "patch–word cosines, mean over predictor layers):",
        "",
        *_table(
            lead + [c[1] for c in train_cols],
            [
                [*g, str(seeds[g])] + [_cell(row[k], fmt) if k in row else "–" for k, _, fmt in train_cols]
                for g, row in table.items()
            ],
        ),
    ]
    if diffs:
        diff_cols = [(k, n) for k, n in [*PROBE_COLUMNS, ("rankme", "RankMe")] if any(k in d for d in diffs.values())]
        lines += [
            "",
            f"{DIFFERENCE[0]} − {DIFFERENCE[1]}, paired by seed: mean ± standard deviation of the per-seed "
            "differences; **bold**: |mean| > 2 × std (beyond the seed spread); †: a variant's mean is not above "
            "both floors.",
            "",
            *_table(
                [" / ".join(lead[1:-1]), "seeds"] + [name for _, name in diff_cols],
                [
                    [masks, str(len(next(iter(row.values()))["per_seed"]))]
                    + [_difference_cell(row.get(k)) for k, _ in diff_cols]
                    for masks, row in diffs.items()
                    if row
                ],
            ),
        ]
    return "\n".join(lines)


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def write_readme(path: Path, text: str, section: str) -> None:
    begin, end = markers(section)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} … {end} markers to write the table between")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def _settings(base: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`base` with each KEY=VALUE of `overrides` (VALUE read as JSON, else kept as text)."""
    out = dict(base)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", choices=list(EXPERIMENTS), default="ablations", help="Which grid to run.")
    parser.add_argument(
        "--work", type=Path, default=Path("ablations-out"), help="Directory for data, models, store and runs."
    )
    parser.add_argument("--images", type=int, default=SCENE_IMAGES, help="Synthetic scenes.")
    parser.add_argument("--captions", choices=["full", "partial"], default=SCENE_CAPTIONS, help="synth's captions.")
    parser.add_argument(
        "--t5-steps",
        type=int,
        default=T5_STEPS,
        help="Training steps of the tiny T5 (span corruption and phrase tagging).",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="Training steps of every run (default: the experiment's)."
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Seeds for `none` and `cross`.")
    parser.add_argument(
        "--ablation-seeds",
        type=int,
        nargs="+",
        default=None,
        help="Seeds for the other variants (default: the first of --seeds).",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=list(VARIANTS),
        help="Which variants (default: the experiment's).",
    )
    parser.add_argument(
        "--masks", nargs="+", default=None, choices=list(MASKS), help="Which mask settings (default: the experiment's)."
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a training setting of every run (repeatable; e.g. a tiny model for a smoke test).",
    )
    parser.add_argument("--attentive", action="store_true", help="Also run the attentive probe (slower).")
    parser.add_argument(
        "--encoders",
        nargs="+",
        default=list(ENCODERS),
        choices=list(ENCODERS),
        help="Which of each run's encoders to probe (default both: the EMA target and the context encoder).",
    )
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="Rewrite the tables between the markers in this file (docs/experiments.md holds the experiments').",
    )
    parser.add_argument(
        "--section",
        default=None,
        help="Name in the markers <!-- NAME:begin --> / <!-- NAME:end --> (default: the experiment's; another name "
        "keeps a second table, e.g. at other --steps).",
    )
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    experiment = EXPERIMENTS[args.experiment]
    settings = _settings(experiment.training, args.overrides)
    if args.steps is not None:
        settings["steps"] = args.steps
    work = args.work.resolve()
    stats = prepare_scenes(
        work,
        args.images,
        args.t5_steps,
        seed=0,
        timings={},
        captions=args.captions,
        layout=experiment.layout,
        text=experiment.text,
    )
    probes = [*PROBES, *(["attentive"] if args.attentive else [])]
    folder = runs_directory(work, args.experiment, settings)
    runs: dict[Group, dict[int, dict[str, Any]]] = {}
    for masks in args.masks or experiment.masks:
        for variant in args.variants or experiment.variants:
            seeds = args.seeds if variant in DIFFERENCE else args.ablation_seeds or args.seeds[:1]
            run_settings = {**settings, **VARIANTS[variant], **MASKS[masks]}
            encoders = tuple(args.encoders)
            by_seed = {
                s: run_one(
                    folder,
                    work,
                    run_settings,
                    variant,
                    masks,
                    s,
                    probes,
                    floors_source(folder, s, probes, run_settings),
                    encoders,
                    experiment.curves,
                )
                for s in seeds
            }
            for encoder in encoders:
                runs[(variant, masks, encoder)] = {s: records[encoder] for s, records in by_seed.items()}
    table = {g: summarise([r["figures"] for r in by_seed.values()]) for g, by_seed in runs.items()}
    floors = {
        g: {f: summarise([r["floors"][f] for r in by_seed.values()]) for f in by_seed[min(by_seed)]["floors"]}
        for g, by_seed in runs.items()
    }
    diffs = differences(runs, [k for k, _ in PROBE_COLUMNS] + ["rankme"])
    t5 = {
        "steps": stats["t5_training"]["steps"] if stats else 0,
        "colour_from_where": stats.get("t5_probe_accuracy", {}).get("colour_from_where", math.nan),
    }
    changed = ", ".join(f"`{item}`" for item in args.overrides)
    text_encoder = (
        f"; T5 trained {t5['steps']} steps, probe colour-from-position {_fmt(t5['colour_from_where'], '{:.2f}')}"
        if experiment.text
        else ""
    )
    caption = (
        f"Measured by `benchmarks/ablations.py --experiment {args.experiment}` on `tcjepa synth` data ({args.images} "
        f"{experiment.layout} scenes, {args.captions} captions; {settings['steps']} steps each, {experiment.what}"
        f"{'; changed by --set: ' + changed if changed else ''}{text_encoder}). "
        f"Probes on the {' and the '.join(ENCODER_NAMES[e] for e in args.encoders)}."
    )
    text = markdown(table, floors, diffs, {g: len(r) for g, r in runs.items()}, caption)
    print(text)
    if args.readme is not None:
        write_readme(args.readme, text, args.section or experiment.section)
    beyond = [
        f"{masks} {key}"
        for masks, row in diffs.items()
        for key, d in row.items()
        if d["exceeds_spread"] and d.get("above_floors", True)
    ]
    print_result(
        json_safe(
            {
                "experiment": args.experiment,
                "steps": settings["steps"],
                "images": args.images,
                "captions": args.captions,
                "t5": t5,
                "settings": settings,
                "runs_directory": str(folder),
                "table": {_group_key(g): row for g, row in table.items()},
                "floors": {_group_key(g): row for g, row in floors.items()},
                "differences": diffs,
                "beyond_spread": beyond,
                "runs": [r for by_seed in runs.values() for r in by_seed.values()],
            }
        )
    )


if __name__ == "__main__":
    main()
