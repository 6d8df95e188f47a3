"""`tcjepa demo`: the whole pipeline on built-in synthetic data, on a laptop CPU, with no arguments.

synth → tiny-models → import the scenes' true captions → embed → caption (the tiny
random VLM through vLLM, to show the real path runs; its captions are junk by
construction and stay in their own recipe, which is not embedded) → train `none`
and `cross` (same seed, same steps) → eval both encoders of both (the EMA target and
the context encoder) → a summary table with the floors (a random-init encoder seeded
apart from the runs, and raw pixels) and true/shuffled, and plots. Each step is a real
command, run in this process (the VLM's captioning in a process of its own), and is
skipped (or resumed) when its output is already there.

The training configuration is the one that learns on these scenes (`LEARNING_TRAINING`, docs/experiments.md
section 5), printed at the start; it is sized for a 2-core CPU and departs from the paper's on purpose.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from evaluation.summary import floor_figures, recorded_floor_inputs, run_figures
from pipeline.core.errors import UserError
from pipeline.devkit.scenes import (
    LEARNING_LAYOUT,
    LEARNING_TRAINING,
    SCENE_IMAGES,
    SCENE_RECIPE,
    announce,
    prepare_scenes,
)
from pipeline.devkit.tiny_models import T5_STEPS

DEMO_VLM_IMAGES = 32
MODES = ("none", "cross")  # `cross` reuses the floors that `none`'s evaluation measured
ENCODERS = ("target", "context")
FLOOR_NAMES = {"baseline": "random init", "pixels": "patch colours", "patch_pixels": "patch pixels"}


def caption_with_vlm(out: Path, timings: dict[str, float]) -> None:
    """The tiny random Qwen2-VL through vLLM on a few images: the real captioning path, junk text in its own recipe.
    It runs as `tcjepa caption` in a process of its own, whose engine core then runs in that process (9 s to start
    rather than 35 s, `benchmarks/caption.py`); in this process vLLM would set up torch.distributed before the
    training."""
    t = announce(
        f"caption: the tiny random Qwen2-VL through vLLM on {DEMO_VLM_IMAGES} images (junk text by construction; its "
        "own recipe)"
    )
    images = sorted((out / "data" / "images").glob("*.png"))[:DEMO_VLM_IMAGES]
    command = [sys.executable, "-m", "pipeline", "caption", *map(str, images), "--cache", str(out / "cache")]
    command += ["--model", str(out / "models" / "vlm"), "--recipe", "tiny-vlm", "--vllm-arg", "max_model_len=1024"]
    command += ["--max-tokens", "16", "--chunk-images", "32", "--no-progress"]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its messages reach stderr as they come
    if done.returncode != 0:
        raise UserError(f"the demo's `tcjepa caption` exited with status {done.returncode}: see its message above")
    print(f"[demo]   {done.stdout.strip().splitlines()[-1]}")
    timings["caption_vlm_s"] = time.perf_counter() - t


def training_settings(n_images: int, steps: int) -> dict[str, Any]:
    """`LEARNING_TRAINING` for `n_images` scenes and `steps` steps: 64 images held out for validation, or a quarter of
    them when there are fewer than 256 (a shrunk demo keeps three quarters to train on)."""
    return {**LEARNING_TRAINING, "steps": steps, "val_images": min(LEARNING_TRAINING["val_images"], n_images // 4)}


def _train_and_eval(
    out: Path,
    mode: str,
    training: dict[str, Any],
    seed: int,
    timings: dict[str, float],
    floors_from: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Train one mode and probe both its encoders; `floors_from`: the other mode's report, whose floors (same
    encoder architecture, images and seed) are reused, as the context encoder's report reuses the target's."""
    from evaluation.evaluate import PROBES, EvalConfig, evaluate
    from train.config import TrainConfig, apply
    from train.loop import run_training

    data, run = out / "data", out / "runs" / mode
    steps = training["steps"]
    settings = {**training, "conditioning": mode, "images": [str(data / "images")], "seed": seed}
    if mode != "none":
        settings.update(cache=str(out / "cache"), store=str(out / "store"), recipes=[SCENE_RECIPE])
    t = announce(f"train {mode}: {steps} steps -> {run}")
    metrics = run_training(apply(TrainConfig(), settings, "demo"), run, progress=True)
    timings[f"train_{mode}_s"] = time.perf_counter() - t
    t = announce(f"eval {mode}: linear, k-NN, dense and attentive probes of both encoders on the scene labels")
    last = [m["step"] for m in metrics if "val_loss_predict" in m][-1:]
    reports: dict[str, dict[str, Any]] = {}
    for encoder in ENCODERS:
        done = run / "eval" / ("labels.json" if encoder == "target" else f"labels.{encoder}.json")
        report = json.loads(done.read_text()) if done.exists() else None
        if report is None or [report["step"]] != last:
            lender = floors_from if encoder == ENCODERS[0] else Path(reports[ENCODERS[0]]["report"])
            # the attentive probe (the costliest) on the target encoder, the one the paper evaluates
            probes = PROBES if encoder == ENCODERS[0] else tuple(p for p in PROBES if p != "attentive")
            report = evaluate(
                EvalConfig(
                    run=run,
                    images=[data / "images"],
                    labels=data / "labels.jsonl",
                    seed=seed,
                    progress=False,
                    floors_from=lender,
                    encoder=encoder,
                    probes=probes,
                ),
                default_probes=True,
            )
        report["report"] = str(done)
        reports[encoder] = report
    timings[f"eval_{mode}_s"] = time.perf_counter() - t
    return metrics, reports


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table: one row per mode, then one per floor (its probes only)."""
    cols = [
        ("mode", "mode", "{}"),
        ("encoder", "encoder", "{}"),
        ("linear", "linear", "{:.3f}"),
        ("knn", "k-NN", "{:.3f}"),
        ("attentive", "attentive", "{:.3f}"),
        ("dense_accuracy", "dense acc", "{:.3f}"),
        ("dense_miou", "dense mIoU", "{:.3f}"),
        ("dense_shape_accuracy", "shape acc", "{:.3f}"),
        ("dense_shape_miou", "shape mIoU", "{:.3f}"),
        ("multilabel", "multi-label mAP", "{:.3f}"),
        ("val_true", "val loss", "{:.4f}"),
        ("val_shuffled", "shuffled", "{:.4f}"),
        ("val_notext", "no text", "{:.4f}"),
        ("ratio", "true/shuffled", "{:.3f}"),
        ("images_per_s", "images/s", "{:.0f}"),
    ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt.format(r[key]) if key in r else "–" for key, _, fmt in cols) + " |" for r in rows]
    return "\n".join(lines)


# the probes that neither position nor a patch's own pixels answer
MARGIN_PROBES = {"dense_shape_miou": "shape mIoU", "multilabel": "multi-label mAP"}


def margins_table(rows: list[dict[str, Any]], floors: list[dict[str, Any]]) -> str:
    """Each run's encoders minus each floor on the probes that position and a patch's own pixels do not answer
    (positive: the encoder learnt something the floor lacks), beside true/shuffled (below 1: the predictor reads
    what the captions say)."""
    heads = [f"{name} − {floor['mode'].removeprefix('floor: ')}" for name in MARGIN_PROBES.values() for floor in floors]
    lines = ["| mode | encoder | " + " | ".join(heads) + " | true/shuffled |", "|" + "---|" * (len(heads) + 3)]
    for row in rows:
        cells = [
            f"{row[key] - floor[key]:+.3f}" if key in row and key in floor else "–"
            for key in MARGIN_PROBES
            for floor in floors
        ]
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "–"
        lines.append(f"| {row['mode']} | {row['encoder']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot_comparison(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Validation prediction loss of each run with true, shuffled and no captions, on one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (mode, metrics), colour in zip(runs.items(), ("tab:grey", "tab:blue")):
        val = [m for m in metrics if "val_loss_predict" in m]
        steps = [m["step"] for m in val]
        ax.plot(steps, [m["val_loss_predict"] for m in val], color=colour, label=f"{mode}: true captions")
        if mode != "none":
            ax.plot(
                steps, [m["val_loss_predict_shuffled"] for m in val], color=colour, ls="--", label=f"{mode}: shuffled"
            )
            ax.plot(steps, [m["val_loss_predict_notext"] for m in val], color=colour, ls=":", label=f"{mode}: no text")
    ax.set_xlabel("step")
    ax.set_ylabel("validation prediction loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    out: Path,
    n_images: int = SCENE_IMAGES,
    t5_steps: int = T5_STEPS,
    train_steps: int = LEARNING_TRAINING["steps"],
    seed: int = 0,
) -> dict[str, Any]:
    from captioning.cache import CaptionCache
    from embedding_cache.store import EmbeddingStore

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    training = training_settings(n_images, train_steps)
    announce(f"training configuration (sized for a 2-core CPU, not the paper's): {json.dumps(training)}")
    timings: dict[str, float] = {}
    model_stats = prepare_scenes(out, n_images, t5_steps, seed, timings, layout=LEARNING_LAYOUT)
    caption_with_vlm(out, timings)
    results: dict[str, tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]] = {}
    for mode in MODES:
        lender = out / "runs" / MODES[0] / "eval" / "labels.json"
        reuse = mode != MODES[0] and recorded_floor_inputs(lender) is not None
        results[mode] = _train_and_eval(out, mode, training, seed, timings, lender if reuse else None)
    rows = [
        {"mode": mode, "encoder": encoder, **run_figures(results[mode][0], results[mode][1][encoder])}
        for mode in MODES
        for encoder in ENCODERS
    ]
    floors = [
        {"mode": f"floor: {FLOOR_NAMES[f]}", **figures}
        for f, figures in floor_figures(results[MODES[0]][1][ENCODERS[0]]).items()
    ]
    plot_comparison({mode: r[0] for mode, r in results.items()}, out / "comparison.png")
    summary_table = table(rows + floors) + "\n\n" + margins_table(rows, floors)
    (out / "summary.md").write_text(summary_table + "\n")
    print(summary_table, flush=True)
    info = CaptionCache.open_or_create(out / "cache").info()
    summary = {
        "images": info.images,
        "recipes": {r["name"]: r["captions"] for r in info.recipes},
        "captions": info.captions,
        "store": EmbeddingStore(out / "store").stats(),
        "t5_probe_accuracy": model_stats.get("t5_probe_accuracy"),
        "train_config": training,
        "results": rows,
        "floors": floors,
        "plots": [str(out / "comparison.png"), *(str(out / "runs" / m / "curves.png") for m in MODES)],
        **{k: round(v, 1) for k, v in timings.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
