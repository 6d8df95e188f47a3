"""TC-JEPA vs I-JEPA side by side, and the paper's ablations, on `tcjepa synth` data.

Variants (the demo's training configuration, `pipeline.devkit.scenes.SCENE_TRAINING`, same steps each):

  none        I-JEPA: the predictor reads no text
  cross       TC-JEPA: per-layer cross-attention, N captions, λ and β at their defaults
  no_reg      cross with λ = β = 0 (no sparsity / consistency regularisers)
  n1          cross with N = 1 caption per image
  sequence    the captions' words appended to the predictor's sequence instead

Each (variant, seed) is a real `tcjepa train` run in its own process, then `tcjepa eval`
(linear, k-NN and dense probes on the synth labels; `--attentive` adds that probe).
The data, the T5 trained on the scene captions and the store are built once in --work,
and finished runs and their probe reports are reused, so an interrupted script resumes.

Prints a Markdown table (mean ± standard deviation over seeds) and one final JSON line
with every figure. `--readme README.md` rewrites the table between the
`<!-- ablations:begin -->` and `<!-- ablations:end -->` markers (`--section NAME`: between
`<!-- NAME:begin -->` and `<!-- NAME:end -->`); it is never typed by hand.

  python -m benchmarks.ablations --work /tmp/ablations --seeds 0 1 2 --readme README.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_result, tcjepa  # first: sets the offline environment
from evaluation.summary import run_figures
from pipeline.devkit.scenes import SCENE_IMAGES, SCENE_RECIPE, SCENE_T5_STEPS, SCENE_TRAINING, prepare_scenes

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {"conditioning": "none"},
    "cross": {"conditioning": "cross"},
    "no_reg": {"conditioning": "cross", "lambda_sparse": 0.0, "beta_consistency": 0.0},
    "n1": {"conditioning": "cross", "captions_per_image": 1},
    "n8": {"conditioning": "cross", "captions_per_image": 8},
    "sequence": {"conditioning": "sequence"},
}
SECTION = "ablations"  # the README's table lives between <!-- ablations:begin --> and <!-- ablations:end -->
COLUMNS = [
    ("linear", "linear"),
    ("knn", "k-NN"),
    ("attentive", "attentive"),
    ("dense_accuracy", "dense acc"),
    ("dense_miou", "dense mIoU"),
    ("val_true", "val loss"),
    ("ratio", "true/shuffled"),
    ("step_s", "s/step"),
]


def run_one(work: Path, variant: str, seed: int, steps: int, attentive: bool) -> dict[str, float]:
    """Train (or reuse) one run and probe it; returns its figures."""
    run = work / "runs" / f"{variant}-s{seed}"
    settings = {**SCENE_TRAINING, **VARIANTS[variant], "steps": steps, "seed": seed}
    config = work / "runs" / f"{variant}-s{seed}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(settings))  # JSON is YAML
    text = [] if variant == "none" else ["--cache", work / "cache", "--store", work / "store", "--recipe", SCENE_RECIPE]
    t0 = time.perf_counter()
    tcjepa("train", work / "data" / "images", *text, "--out", run, "--config", config, "--no-progress")
    print(f"  {variant} seed {seed}: trained in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    names = ["linear", "knn", "dense"] + (["attentive"] if attentive else [])
    report_path = run / "eval" / "ablation.json"
    done = json.loads(report_path.read_text()) if report_path.exists() else None
    if done is None or done["step"] != steps or set(done["probes"]) != set(names):
        tcjepa(
            "eval",
            run,
            work / "data" / "images",
            "--labels",
            work / "data" / "labels.jsonl",
            *[x for name in names for x in ("--probe", name)],
            "--seed",
            seed,
            "--no-progress",
            "--report",
            report_path,
        )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    figures = run_figures(metrics, json.loads(report_path.read_text()))
    return {**figures, "step_s": SCENE_TRAINING["batch_size"] / figures["images_per_s"]}


def summarise(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, list[float]]]:
    """Per variant and figure: [mean, standard deviation over seeds (0 for one seed)]."""
    table = {}
    for variant, runs in results.items():
        table[variant] = {}
        for key in runs[0]:
            values = [r[key] for r in runs]
            table[variant][key] = [statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0]
    return table


def markdown(table: dict[str, dict[str, list[float]]], seeds: dict[str, int], steps: int, t5: dict[str, Any]) -> str:
    cols = [(k, name) for k, name in COLUMNS if any(k in row for row in table.values())]
    lines = [
        f"Measured by `benchmarks/ablations.py` on `tcjepa synth` data ({steps} steps each, the demo's "
        f"training configuration; T5 trained {t5['steps']} steps, probe colour-from-position "
        f"{t5['colour_from_where']:.2f}). "
        "Mean ± standard deviation over seeds; probes on the EMA target encoder.",
        "",
        "| variant | seeds | " + " | ".join(name for _, name in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for variant, row in table.items():
        cells = []
        for key, _ in cols:
            if key not in row:
                cells.append("–")
                continue
            mean, std = row[key]
            fmt = "{:.4f}" if key == "val_true" else "{:.2f}" if key == "step_s" else "{:.3f}"
            cells.append(fmt.format(mean) + (f" ± {fmt.format(std)}" if seeds[variant] > 1 else ""))
        lines.append(f"| {variant} | {seeds[variant]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markers(section: str) -> tuple[str, str]:
    return f"<!-- {section}:begin -->", f"<!-- {section}:end -->"


def write_readme(path: Path, text: str, section: str = SECTION) -> None:
    begin, end = markers(section)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} … {end} markers to write the table between")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--work", type=Path, default=Path("ablations-out"), help="Directory for data, models, store and runs."
    )
    parser.add_argument("--images", type=int, default=SCENE_IMAGES, help="Synthetic scenes.")
    parser.add_argument(
        "--t5-steps",
        type=int,
        default=SCENE_T5_STEPS,
        help="Training steps of the tiny T5 (span corruption and phrase tagging).",
    )
    parser.add_argument("--steps", type=int, default=SCENE_TRAINING["steps"], help="Training steps of every run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="Seeds for `none` and `cross`.")
    parser.add_argument(
        "--ablation-seeds",
        type=int,
        nargs="+",
        default=None,
        help="Seeds for no_reg, n1 and sequence (default: the first of --seeds).",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="Which variants to run."
    )
    parser.add_argument("--attentive", action="store_true", help="Also run the attentive probe (slower).")
    parser.add_argument("--readme", type=Path, default=None, help="Rewrite the table between the markers in this file.")
    parser.add_argument(
        "--section",
        default=SECTION,
        help="Name in the markers <!-- NAME:begin --> / <!-- NAME:end --> (another name keeps a second table, e.g. at "
        "other --steps).",
    )
    args = parser.parse_args()

    work = args.work.resolve()
    stats = prepare_scenes(work, args.images, args.t5_steps, seed=0, timings={})
    ablation_seeds = args.ablation_seeds or args.seeds[:1]
    results: dict[str, list[dict[str, float]]] = {}
    for variant in args.variants:
        seeds = args.seeds if variant in ("none", "cross") else ablation_seeds
        results[variant] = [run_one(work, variant, s, args.steps, args.attentive) for s in seeds]
    table = summarise(results)
    t5 = {
        "steps": stats["t5_training"]["steps"],
        "colour_from_where": stats.get("t5_probe_accuracy", {}).get("colour_from_where", float("nan")),
    }
    text = markdown(table, {v: len(r) for v, r in results.items()}, args.steps, t5)
    print(text)
    if args.readme is not None:
        write_readme(args.readme, text, args.section)
    c, n = table.get("cross"), table.get("none")
    verdict = {}
    if c and n:
        for key in ("linear", "knn", "dense_miou"):
            gap = c[key][0] - n[key][0]
            verdict[f"cross_minus_none_{key}"] = round(gap, 4)
            verdict[f"{key}_gap_exceeds_spread"] = gap > max(c[key][1], n[key][1])
    print_result({"table": table, **verdict, "steps": args.steps, "t5": t5})


if __name__ == "__main__":
    main()
