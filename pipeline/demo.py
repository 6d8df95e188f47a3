"""`tcjepa demo`: the whole pipeline on built-in synthetic data, on a laptop CPU, with no arguments.

synth → tiny-models → import the scenes' true captions → embed → caption (the tiny
random VLM through vLLM, to show the real path runs; its captions are junk by
construction and stay in their own recipe, which is not embedded) → train `none`
and `cross` (same seed, same steps) → eval both → a summary table and plots. Each step is a real command
run in this process and is skipped (or resumed) when its output is already there.

The training configuration is sized for ~10 minutes on 2 cores and printed at the
start; it departs from the paper's on purpose (see `DEMO_TRAIN`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

DEMO_IMAGES = 600
DEMO_T5_STEPS = 600  # phrase tagging right on 0.996 of phrase tokens, probe colour-from-position 1.0 (README)
DEMO_VLM_IMAGES = 32
SCENE_RECIPE = "synthetic-scenes"
# A tiny ViT on 64 px scenes, one 16 px patch per grid cell; N=4 captions per image and the
# cheaper pooling (before_mlp) keep `cross` at about 2.5x the step time of `none`.
DEMO_TRAIN: dict[str, Any] = {
    "model": "vit_tiny", "depth": 6, "patch_size": 16, "image_size": 64, "predictor_width": 192, "predictor_depth": 4,
    "captions_per_image": 4, "pool": "before_mlp", "text_lr_scale": 10.0, "ema": [0.999, 1.0], "min_context": 2,
    "batch_size": 64, "steps": 300, "warmup_steps": 20, "lr": 0.001, "val_images": 64, "num_workers": 1,
    "log_every": 25, "val_every": 50, "checkpoint_every": 100,
}
MODES = ("none", "cross")


def _step(name: str) -> float:
    print(f"[demo] {name}", flush=True)
    return time.perf_counter()


def prepare_scenes(out: Path, n_images: int, t5_steps: int, seed: int, timings: dict[str, float]) -> dict[str, Any]:
    """synth, tiny models, the scenes' captions imported and embedded; returns the tiny models' stats.

    Also the data of `benchmarks/ablations.py`.
    """
    from captioning.annotations import import_annotations
    from captioning.cache import CaptionCache
    from embedding_cache.job import EmbedConfig, run_embed
    from pipeline.synth import generate
    from pipeline.tiny_models import build_tiny_models

    data = out / "data"
    t = _step(f"synth: {n_images} scenes with 8 captions each -> {data}")
    if not (data / "classes.json").exists():
        generate(data, n_images, seed=seed)
    have = sum(1 for _ in (data / "images").glob("*.png"))
    if have != n_images:
        raise UserError(f"{out} holds a demo of {have} scenes, not {n_images}; use another --out or --n-images {have}")
    timings["synth_s"] = time.perf_counter() - t

    models = out / "models"
    t = _step(f"tiny-models: T5 trained {t5_steps} steps on the scene captions, random tiny Qwen2-VL -> {models}")
    stats_file = models / "stats.json"
    if not stats_file.exists():
        stats = build_tiny_models(models, t5_corpus=data / "captions.jsonl", t5_steps=t5_steps, seed=seed)
        stats_file.write_text(json.dumps(stats))
    timings["tiny_models_s"] = time.perf_counter() - t
    stats = json.loads(stats_file.read_text())
    if t5_steps and not stats["t5_training"].get("phrase_tags"):
        raise UserError(f"{models} holds a T5 trained without phrase tags (an older tcjepa); use another --out")
    if stats["t5_training"]["steps"] != t5_steps:
        raise UserError(f"{models} holds a T5 trained {stats['t5_training']['steps']} steps, not {t5_steps}; "
                        f"use another --out or --t5-steps {stats['t5_training']['steps']}")

    t = _step("caption: import the scene captions (what the scene graph says) into the cache")
    cache = CaptionCache.open_or_create(out / "cache")
    print(f"[demo]   {import_annotations(cache, data / 'captions.jsonl', name=SCENE_RECIPE).summary()}")
    timings["caption_import_s"] = time.perf_counter() - t

    t = _step("embed: T5 token embeddings of the scene captions -> Zarr store")
    report = run_embed(EmbedConfig(cache=out / "cache", store=out / "store", model=str(models / "t5"), recipes=[SCENE_RECIPE],
                                   device="cpu", progress=False))
    print(f"[demo]   {report.summary(dry_run=False)}")
    timings["embed_s"] = time.perf_counter() - t
    return stats


def caption_with_vlm(out: Path, timings: dict[str, float]) -> None:
    """The tiny random Qwen2-VL through vLLM on a few images: the real captioning path, junk text in its own recipe."""
    from captioning.engines import SamplingConfig
    from captioning.job import CaptionConfig, run_caption

    t = _step(f"caption: the tiny random Qwen2-VL through vLLM on {DEMO_VLM_IMAGES} images (junk text by construction; its own recipe)")
    images = sorted((out / "data" / "images").glob("*.png"))[:DEMO_VLM_IMAGES]
    vlm = run_caption(CaptionConfig(inputs=images, cache=out / "cache", model=str(out / "models" / "vlm"), recipe_name="tiny-vlm",
                                    engine_args={"max_model_len": 1024}, sampling=SamplingConfig(max_tokens=16), chunk_images=32))
    print(f"[demo]   {vlm.summary(dry_run=False)}")
    timings["caption_vlm_s"] = time.perf_counter() - t


def _train_and_eval(out: Path, mode: str, steps: int, seed: int, timings: dict[str, float]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from train.config import TrainConfig, apply
    from train.evaluate import EvalConfig, evaluate
    from train.loop import train

    data, run = out / "data", out / "runs" / mode
    settings = {**DEMO_TRAIN, "conditioning": mode, "images": [str(data / "images")], "seed": seed, "steps": steps}
    if mode != "none":
        settings.update(cache=str(out / "cache"), store=str(out / "store"), recipes=[SCENE_RECIPE])
    t = _step(f"train {mode}: {steps} steps -> {run}")
    metrics = train(apply(TrainConfig(), settings, "demo"), run, progress=True)
    timings[f"train_{mode}_s"] = time.perf_counter() - t
    t = _step(f"eval {mode}: linear, k-NN, dense and attentive probes on the scene labels")
    done = run / "eval" / "labels.json"
    last = [m["step"] for m in metrics if "val_loss_predict" in m][-1:]
    report = json.loads(done.read_text()) if done.exists() else None
    if report is None or [report["step"]] != last:
        report = evaluate(EvalConfig(run=run, images=[data / "images"], labels=data / "labels.jsonl", seed=seed, progress=False))
    timings[f"eval_{mode}_s"] = time.perf_counter() - t
    return metrics, report


def run_figures(metrics: list[dict[str, Any]], report: dict[str, Any]) -> dict[str, float]:
    """One run's figures: its probes (from the eval report) and its last validation and mean speed (from its metrics)."""
    val = [m for m in metrics if "val_loss_predict" in m][-1]
    logged = [m["images_per_s"] for m in metrics if "images_per_s" in m]
    speed = logged[1:] or logged  # the first interval includes start-up
    probes = {name: result["metrics"] for name, result in report["probes"].items()}
    figures = {"linear": probes["linear"]["top1"], "knn": probes["knn"]["top1"],
               "dense_accuracy": probes["dense"]["patch_accuracy"], "dense_miou": probes["dense"]["miou"]}
    if "attentive" in probes:
        figures["attentive"] = probes["attentive"]["top1"]
    return {**figures, "val_true": val["val_loss_predict"], "val_shuffled": val["val_loss_predict_shuffled"],
            "val_notext": val["val_loss_predict_notext"], "ratio": val["val_loss_predict"] / val["val_loss_predict_shuffled"],
            "images_per_s": sum(speed) / len(speed)}


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    cols = [("mode", "mode", "{}"), ("linear", "linear", "{:.3f}"), ("knn", "k-NN", "{:.3f}"),
            ("attentive", "attentive", "{:.3f}"), ("dense_accuracy", "dense acc", "{:.3f}"), ("dense_miou", "dense mIoU", "{:.3f}"),
            ("val_true", "val loss", "{:.4f}"), ("val_shuffled", "shuffled", "{:.4f}"), ("val_notext", "no text", "{:.4f}"),
            ("ratio", "true/shuffled", "{:.3f}"), ("images_per_s", "images/s", "{:.0f}")]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt.format(r[key]) for key, _, fmt in cols) + " |" for r in rows]
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
            ax.plot(steps, [m["val_loss_predict_shuffled"] for m in val], color=colour, ls="--", label=f"{mode}: shuffled")
            ax.plot(steps, [m["val_loss_predict_notext"] for m in val], color=colour, ls=":", label=f"{mode}: no text")
    ax.set_xlabel("step")
    ax.set_ylabel("validation prediction loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(out: Path, n_images: int = DEMO_IMAGES, t5_steps: int = DEMO_T5_STEPS, train_steps: int = DEMO_TRAIN["steps"],
             seed: int = 0) -> dict[str, Any]:
    from captioning.cache import CaptionCache
    from embedding_cache.store import EmbeddingStore

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] training configuration (sized for a 2-core CPU, not the paper's): {json.dumps(DEMO_TRAIN)}", flush=True)
    timings: dict[str, float] = {}
    model_stats = prepare_scenes(out, n_images, t5_steps, seed, timings)
    caption_with_vlm(out, timings)
    results = {mode: _train_and_eval(out, mode, train_steps, seed, timings) for mode in MODES}
    rows = [{"mode": mode, **run_figures(*results[mode])} for mode in MODES]
    plot_comparison({mode: r[0] for mode, r in results.items()}, out / "comparison.png")
    summary_table = table(rows)
    (out / "summary.md").write_text(summary_table + "\n")
    print(summary_table, flush=True)
    info = CaptionCache.open_or_create(out / "cache").info()
    summary = {
        "images": info.images,
        "recipes": {r["name"]: r["captions"] for r in info.recipes},
        "captions": info.captions,
        "store": EmbeddingStore(out / "store").stats(),
        "t5_probe_accuracy": model_stats.get("t5_probe_accuracy"),
        "train_config": {**DEMO_TRAIN, "steps": train_steps},
        "results": rows,
        "plots": [str(out / "comparison.png"), *(str(out / "runs" / m / "curves.png") for m in MODES)],
        **{k: round(v, 1) for k, v in timings.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
