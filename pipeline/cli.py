"""The `tcjepa` command line: a thin typer app; each command imports its stage lazily.

Bad input raises `UserError`, which `main` prints as one line (exit status 2). docs/cli.md is the reference of every
command and option; the help texts here are the short form.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar, cast

import typer

from evaluation.protocol import HELP as EVAL_PROTOCOL
from pipeline.cli_cache_store import cache_app, store_app
from pipeline.cli_options import Executor, Mirror, Progress, RayActors, RayAddress
from pipeline.core import logs
from pipeline.core.errors import STOPPED_STATUS, DataProblem, Stopped, UserError, os_error_line
from pipeline.devkit.scenes import LEARNING_TRAINING, SCENE_IMAGES
from pipeline.devkit.tiny_models import T5_STEPS

app = typer.Typer(
    name="tcjepa",
    help="TC-JEPA: caption images (vLLM), embed captions (T5 → Zarr), pretrain image encoders on them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(cache_app, name="cache")
app.add_typer(store_app, name="store")


def check_executor(name: str) -> str:
    if name not in ("local", "ray"):
        raise UserError(f"--executor {name!r}: choose local or ray")
    return name


T = TypeVar("T")


def from_params(cls: Callable[..., T], params: dict[str, Any], **others: Any) -> T:
    """`cls(...)` with the command's parameters (click's `ctx.params`) that are its fields, by name, and `others`;
    a repeatable option not given (an empty tuple there) is left to the field's default."""
    fields = inspect.signature(cls).parameters
    return cls(**{**{k: v for k, v in params.items() if k in fields and v != ()}, **others})


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tcjepa {version('tcjepa')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Options before the command."""


@app.command("tiny-models")
def tiny_models(
    out: Annotated[Path, typer.Option(help="Directory to write `t5/` and `vlm/` into.")],
    t5_corpus: Annotated[Path | None, typer.Option(help="captions.jsonl to train the T5 on (else: random).")] = None,
    t5_steps: Annotated[int, typer.Option(help="Training steps for the tiny T5 (with --t5-corpus).")] = T5_STEPS,
    t5_phrase_tags: Annotated[bool, typer.Option(help="Also train the T5 to tag phrases by cell and class.")] = True,
    seed: Annotated[int, typer.Option(help="Seed for weights and training; same arguments give identical files.")] = 0,
) -> None:
    """Build a tiny T5 encoder and a tiny Qwen2-VL (with tokenizers) for tests, the demo and benchmarks."""
    from pipeline.devkit.tiny_models import build_tiny_models

    stats = build_tiny_models(out, t5_corpus=t5_corpus, t5_steps=t5_steps, seed=seed, t5_phrase_tags=t5_phrase_tags)
    typer.echo(json.dumps(stats))


@app.command()
def synth(
    out: Annotated[Path, typer.Option(help="Directory for images/, captions.jsonl, labels.jsonl, classes.json.")],
    n_images: Annotated[int, typer.Option(help="Number of scenes.")],
    image_size: Annotated[int, typer.Option(help="Image side in pixels (a multiple of --grid).")] = 64,
    grid: Annotated[int, typer.Option(help="Cells per side; each cell is empty or holds one shape.")] = 4,
    seed: Annotated[int, typer.Option(help="Image i depends only on (seed, i).")] = 0,
    captions: Annotated[str, typer.Option(help="full: captions name all objects and cells; partial: 1-3.")] = "full",
    layout: Annotated[str, typer.Option(help="grid: one shape per cell; free: overlapping shapes, textures.")] = "grid",
) -> None:
    """Draw synthetic scenes of shapes with 8 captions each that say what is where."""
    from pipeline.devkit.dataset import generate

    generate(out, n_images, image_size=image_size, grid=grid, seed=seed, captions=captions, layout=layout)
    typer.echo(f"wrote {n_images} images, captions.jsonl and labels.jsonl to {out}")


@app.command()
def caption(
    ctx: typer.Context,
    cache: Annotated[str, typer.Option(help="Caption cache (created if missing): a directory, s3:// or az://.")],
    images: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Image folders (recursive), Parquet files, HF datasets dirs, tar shards, image files, or "
            "hf:PATH_OR_ID[split]."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Vision-language chat model: a local directory or hub id.")] = None,
    captions_per_image: Annotated[int, typer.Option(help="N captions per image, K prompts × n samples.")] = 8,
    prompts: Annotated[Path | None, typer.Option(help="Prompt templates (.json/.yaml list, or one per line).")] = None,
    recipe: Annotated[str | None, typer.Option(help="Name of this recipe in the cache (for --recipe later).")] = None,
    seed: Annotated[int, typer.Option(help="Base seed of each (image, prompt)'s sampling seed.")] = 0,
    shard: Annotated[str, typer.Option(help="Caption only images whose hash falls in shard i of n.")] = "0/1",
    backend: Annotated[str, typer.Option(help="vllm or hf (transformers generate, for models vLLM lacks).")] = "vllm",
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option(help="Engine option key=value passed to vllm.LLM (repeatable), e.g. tensor_parallel_size=2."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Max new tokens per caption.")] = 160,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.8,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold.")] = 0.95,
    max_pixels: Annotated[int, typer.Option(help="Larger images are downscaled to this many pixels.")] = 1024 * 1024,
    chunk_images: Annotated[int, typer.Option(help="Images per engine call; each chunk is committed.")] = 256,
    decode_workers: Annotated[
        int | None, typer.Option(help="Processes decoding the next chunk (0: a thread; default: by device).")
    ] = None,
    image_column: Annotated[str | None, typer.Option(help="Image column of Parquet / datasets inputs.")] = None,
    device: Annotated[str, typer.Option(help="Device of the hf backend: auto, cpu, cuda.")] = "auto",
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model's own Python code to run.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Only count the images that would be captioned.")] = False,
    annotations: Annotated[
        bool,
        typer.Option(
            "--annotations",
            help="Instead of captioning, import the captions IMAGES hold: a JSONL or COCO file, tar shards, or "
            "tables with --caption-column.",
        ),
    ] = False,
    image_root: Annotated[Path | None, typer.Option(help="With --annotations: where image paths point.")] = None,
    caption_column: Annotated[str | None, typer.Option(help="With --annotations: the tables' caption column.")] = None,
    split: Annotated[str, typer.Option(help="Split of hf:PATH_OR_ID inputs that do not name one.")] = "train",
    mirror: Mirror = None,
    executor: Executor = "local",
    ray_address: RayAddress = None,
    ray_actors: RayActors = None,
    progress: Progress = True,
) -> None:
    """Write N captions per image with a VLM into the caption cache, or import existing captions."""
    if annotations:
        from captioning.annotations import import_captions
        from captioning.remote_cache import open_cache_for_writing

        if not images:
            raise UserError("--annotations needs what to import: a JSONL / COCO file, tar shards or tables")
        report = import_captions(
            open_cache_for_writing(cache, mirror), images, image_root, recipe, caption_column, image_column, split
        )
        typer.echo(report.summary())
        report.check_usable(images)
        return
    if not images or model is None:
        raise UserError("captioning needs IMAGES and --model (or --annotations FILE to import captions)")
    from captioning.engines import SamplingConfig
    from captioning.job import run_caption
    from captioning.vllm_engine import give_this_process_to_the_engine
    from captioning.work import CaptionConfig
    from pipeline.core.images import ImagePolicy
    from pipeline.core.keyvalues import parse_key_values

    cfg = from_params(
        CaptionConfig,
        ctx.params,
        inputs=images,
        prompts_file=prompts,
        recipe_name=recipe,
        engine_args=parse_key_values(vllm_arg or [], "--vllm-arg", "tensor_parallel_size=2"),
        sampling=SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p),
        image_policy=ImagePolicy(max_pixels=max_pixels),
        executor=check_executor(executor),
    )
    give_this_process_to_the_engine()
    typer.echo(run_caption(cfg).summary(dry_run))


@app.command()
def embed(
    ctx: typer.Context,
    cache: Annotated[str, typer.Option(help="Caption cache to read: a directory or an fsspec URL (mirrored locally).")],
    store: Annotated[
        str, typer.Option(help="Embedding store to add to (created if missing): a directory, s3:// or az://.")
    ],
    model: Annotated[str, typer.Option(help="T5 encoder: a local directory or a hub id (T5EncoderModel + tokenizer).")],
    recipe: Annotated[list[str] | None, typer.Option(help="Caption recipe(s) to encode: hash prefix or name.")] = None,
    token_budget: Annotated[int, typer.Option(help="Max padded tokens per encoder batch.")] = 16384,
    max_length: Annotated[int, typer.Option(help="Longer captions are truncated (the trainer reads max_words).")] = 128,
    eos: Annotated[bool, typer.Option(help="Keep T5's end-of-sequence token as the last token.")] = True,
    dtype: Annotated[str, typer.Option(help="Compute dtype: bfloat16 or float32 (never float16).")] = "bfloat16",
    store_dtype: Annotated[str, typer.Option(help="Vectors stored as float16, or int8 (~half the bytes).")] = "float16",
    project_dim: Annotated[int | None, typer.Option(help="Store a fixed PCA of the vectors to this width.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    window: Annotated[
        int, typer.Option(help="Captions sorted by length together; written back in image order.")
    ] = 8192,
    segment_mb: Annotated[float, typer.Option(help="Publish a segment every this many MiB of tokens.")] = 4096.0,
    chunk_tokens: Annotated[int | None, typer.Option(help="Rows per inner zarr chunk (default: ~16 MiB).")] = None,
    shard_chunks: Annotated[int | None, typer.Option(help="Inner chunks per shard file (default: ~1 GiB).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only count the captions, tokens and bytes to be added.")] = False,
    progress: Progress = True,
    mirror: Mirror = None,
    executor: Executor = "local",
    ray_address: RayAddress = None,
    ray_actors: RayActors = None,
) -> None:
    """Encode every caption not yet in the store with T5 and append them as a new segment."""
    from embedding_cache.job import run_embed
    from embedding_cache.work import EmbedConfig

    cfg = from_params(
        EmbedConfig, ctx.params, recipes=recipe or [], compute_dtype=dtype, executor=check_executor(executor)
    )
    typer.echo(run_embed(cfg).summary(dry_run))


def config_option(key: str, *names: str, argument: bool = False) -> Any:
    """A `train` option (or argument) that sets config key `key`: its help and default come from the config's field;
    a true/false key is a --key/--no-key switch."""
    from train.config import TrainConfig, field_help

    default = getattr(TrainConfig(), key)
    if isinstance(default, bool) and not names:
        names = (f"--{key.replace('_', '-')}/--no-{key.replace('_', '-')}",)
    text = f"{field_help(key)} (config key {key}; default: {default})"
    return typer.Argument(help=text) if argument else typer.Option(*names, help=text)


# The `train` parameters that are not config keys, and those named otherwise than their key; every other parameter
# is the config key of its name (tests/test_cli.py holds the command to this).
NOT_CONFIG = ("out", "config", "set_", "resume", "progress", "help_config")
CONFIG_KEYS = {"recipe": "recipes", "compile_": "compile"}


def config_flags(params: dict[str, Any]) -> dict[str, Any]:
    """The config keys that `train`'s parameters `params` (click's, by name) set: those given on the command line."""
    return {CONFIG_KEYS.get(k, k): v for k, v in params.items() if k not in NOT_CONFIG and v not in (None, ())}


def _help_config(value: bool) -> None:
    if value:
        from train.config import describe_keys

        typer.echo(describe_keys())
        raise typer.Exit()


@app.command()
def train(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(help="Run directory (config, index, checkpoints, metrics); resumes from it.")],
    images: Annotated[list[str] | None, config_option("images", argument=True)] = None,
    cache: Annotated[str | None, config_option("cache")] = None,
    store: Annotated[str | None, config_option("store")] = None,
    recipe: Annotated[list[str] | None, config_option("recipes", "--recipe")] = None,
    config: Annotated[Path | None, typer.Option(help="YAML file of config keys; flags and --set override it.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Set any config key: key=value (repeatable).")] = None,
    model: Annotated[str | None, config_option("model")] = None,
    patch_size: Annotated[int | None, config_option("patch_size")] = None,
    image_size: Annotated[int | None, config_option("image_size")] = None,
    batch_size: Annotated[int | None, config_option("batch_size")] = None,
    steps: Annotated[int | None, config_option("steps")] = None,
    conditioning: Annotated[str | None, config_option("conditioning")] = None,
    pool: Annotated[str | None, config_option("pool")] = None,
    captions_per_image: Annotated[int | None, config_option("captions_per_image")] = None,
    lambda_sparse: Annotated[float | None, config_option("lambda_sparse")] = None,
    beta_consistency: Annotated[float | None, config_option("beta_consistency")] = None,
    lr: Annotated[float | None, config_option("lr")] = None,
    min_coverage: Annotated[float | None, config_option("min_coverage")] = None,
    seed: Annotated[int | None, config_option("seed")] = None,
    device: Annotated[str | None, config_option("device")] = None,
    num_workers: Annotated[int | None, config_option("num_workers")] = None,
    decode: Annotated[str | None, config_option("decode")] = None,
    device_resize: Annotated[str | None, config_option("device_resize")] = None,
    verify_images: Annotated[bool | None, config_option("verify_images")] = None,
    image_column: Annotated[str | None, config_option("image_column")] = None,
    split: Annotated[str | None, config_option("split")] = None,
    compile_: Annotated[bool | None, config_option("compile")] = None,
    accum_steps: Annotated[int | None, config_option("accum_steps")] = None,
    partitions: Annotated[int | None, config_option("partitions")] = None,
    checkpoint_activations: Annotated[bool | None, config_option("checkpoint_activations")] = None,
    attention: Annotated[str | None, config_option("attention")] = None,
    fsdp: Annotated[bool | None, config_option("fsdp")] = None,
    shard_within_node: Annotated[bool | None, config_option("shard_within_node")] = None,
    init: Annotated[str | None, config_option("init")] = None,
    log: Annotated[list[str] | None, config_option("log")] = None,
    resume: Annotated[bool, typer.Option(help="Require a checkpoint in --out to continue from.")] = False,
    progress: Progress = True,
    help_config: Annotated[
        bool,
        typer.Option(
            "--help-config",
            callback=_help_config,
            is_eager=True,
            help="List every config key with its meaning and default, then exit.",
        ),
    ] = False,
) -> None:
    """Pretrain an image encoder with TC-JEPA (or I-JEPA with --conditioning none); run under torchrun for many GPUs."""
    from train.config import resolve

    cfg = resolve(out, config, config_flags(ctx.params), set_)
    if not cfg.images:
        raise UserError("no images: pass IMAGES (or `images:` in --config)")
    from train.checkpoint import has_checkpoint

    if resume and not has_checkpoint(out):
        raise UserError(f"--resume: {out} holds no checkpoint to continue from")
    from train.loop import run_training

    metrics = run_training(cfg, out, progress=progress)
    last = [m for m in metrics if "val_loss_predict" in m]
    if last:
        typer.echo(json.dumps({"run": str(out), **last[-1]}))


@app.command(
    "eval",
    help=f"Probe a run's frozen features (linear, k-NN, dense per-patch, attentive) and their floors. {EVAL_PROTOCOL}",
    short_help="Probe a run's frozen features (linear, k-NN, dense, attentive) beside a random encoder's and pixels'.",
)
def eval_(
    ctx: typer.Context,
    run: Annotated[Path, typer.Argument(help="Run directory of `tcjepa train` (its EMA target encoder is probed).")],
    images: Annotated[
        list[Path] | None,
        typer.Argument(help="Image sources of the labelled images, with --labels (not with --train)."),
    ] = None,
    labels: Annotated[
        Path | None, typer.Option(help='JSONL lines {"image": ..., "label": ...} (+ "cells", "tags", "split").')
    ] = None,
    train: Annotated[Path | None, typer.Option(help="Class folders of the training images: DIR/train/<class>.")] = None,
    val: Annotated[Path | None, typer.Option(help="Class folders of the images the probes are scored on.")] = None,
    probe: Annotated[
        list[str] | None, typer.Option(help="linear, knn, dense, multilabel or attentive (repeatable; default: all).")
    ] = None,
    image_root: Annotated[Path | None, typer.Option(help="Folder the labels' image paths are relative to.")] = None,
    test_fraction: Annotated[float, typer.Option(help="Share of labelled images held out for test.")] = 0.2,
    val_fraction: Annotated[float, typer.Option(help="Share of training images held out to tune the probes.")] = 0.2,
    seed: Annotated[int, typer.Option(help="Seed of the split and the probes (and of the random floor's seed).")] = 0,
    floor_seed: Annotated[
        int | None, typer.Option(help="Seed of the random-init floor (default: drawn from --seed; not the run's).")
    ] = None,
    encoder: Annotated[str, typer.Option(help="The run's encoder to probe: target (EMA) or context.")] = "target",
    eval_resize: Annotated[
        str, typer.Option(help="auto, crop (shorter side, centre crop) or whole (the whole image resized).")
    ] = "auto",
    steps: Annotated[
        str | None,
        typer.Option(help="Probe the kept checkpoints: steps separated by commas, or all (learning curves)."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    batch_size: Annotated[int, typer.Option(help="Images per feature-extraction batch.")] = 64,
    num_workers: Annotated[int, typer.Option(help="DataLoader worker processes decoding images.")] = 2,
    report: Annotated[Path | None, typer.Option(help="Where to write the JSON report (default RUN/eval/).")] = None,
    progress: Progress = True,
    floors_from: Annotated[
        Path | None, typer.Option(help="An earlier report whose floors to reuse (refused if measured otherwise).")
    ] = None,
) -> None:
    from evaluation.evaluate import PROBES, EvalConfig, evaluate, evaluate_steps, one_line, steps_to_probe

    probes = tuple(probe) if probe else None
    cfg = from_params(EvalConfig, ctx.params, probes=probes or PROBES)
    if steps is not None:
        for result in evaluate_steps(cfg, steps_to_probe(run, steps), default_probes=probes is None):
            typer.echo(one_line(result))
        typer.echo(f"reports and learning curves: {Path(result['report']).parent}", err=True)
        return
    result = evaluate(cfg, default_probes=probes is None)
    typer.echo(one_line(result))
    typer.echo(f"report: {result['report']}", err=True)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Run directory of `tcjepa train`.")],
    out: Annotated[Path, typer.Option(help="Directory for model.safetensors and config.json.")],
    format: Annotated[str, typer.Option(help="timm (timm's names and config.json) or hf (IJepaModel).")] = "timm",
    encoder: Annotated[str, typer.Option(help="target (the EMA target encoder, as eval) or context.")] = "target",
) -> None:
    """Export the run's encoder as safetensors for timm (class-token-free, average-pooled ViT) or Hugging Face
    transformers (IJepaModel); files are world-readable."""
    from evaluation.export import export_run

    config = export_run(run, out, fmt=format, encoder=encoder)
    typer.echo(json.dumps({"out": str(out), "format": format, "weights": config["weights"], "step": config["step"]}))


@app.command()
def viz(
    run: Annotated[Path, typer.Argument(help="Run directory of a `--conditioning cross` training run.")],
    image: Annotated[Path, typer.Option(help="Image file to look at.")],
    captions: Annotated[list[str], typer.Option(help="A caption of the image (repeatable).")],
    text_model: Annotated[Path, typer.Option(help="The T5 directory `tcjepa embed` made the run's store with.")],
    out: Annotated[Path, typer.Option(help="PNG to write.")],
    top: Annotated[int, typer.Option(help="How many words to draw heat maps for (highest peak cosine first).")] = 8,
) -> None:
    """Draw patch–word cosine heat maps and per-patch prediction error with the captions, their words shuffled, and no
    text."""
    from evaluation.viz import render

    typer.echo(json.dumps(render(run, image, captions, text_model, out, top=top)))


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Directory for the demo's data, models and results.")] = Path("demo-out"),
    n_images: Annotated[int, typer.Option(help="Synthetic scenes to generate.")] = SCENE_IMAGES,
    t5_steps: Annotated[int, typer.Option(help="Training steps for the tiny T5.")] = T5_STEPS,
    train_steps: Annotated[
        int, typer.Option(help="Training steps of each of the two runs (none, cross).")
    ] = LEARNING_TRAINING["steps"],
    seed: Annotated[int, typer.Option(help="Seed for data, models, training and probes.")] = 0,
) -> None:
    """Run the whole pipeline on built-in synthetic data on the CPU: caption, embed, train none and cross, eval,
    compare (resumes if run again)."""
    from pipeline.demo import run_demo

    summary = run_demo(out, n_images=n_images, t5_steps=t5_steps, train_steps=train_steps, seed=seed)
    typer.echo(json.dumps(summary))


def main() -> None:
    """Console-script entry point: bad usage, `UserError` and I/O failures become one `error:` line (exit 2),
    `DataProblem` one `problem:` line (exit 1), `Stopped` (a preempted run, its checkpoint written) one `stopped:`
    line (exit 75)."""
    # click's UsageError, as the click that typer ships defines it (BadParameter's base)
    usage_error = cast(type[Exception], typer.BadParameter.__base__)
    try:
        logs.configure()  # the stages' messages: bare lines on stderr
        code = app(prog_name="tcjepa", standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except usage_error as exc:  # a missing or unknown option: one line, and where the help is
        ctx = getattr(exc, "ctx", None)
        message = cast(Any, exc).format_message()
        typer.echo(f"error: {message} (see `{ctx.command_path if ctx else 'tcjepa'} --help`)", err=True)
        sys.exit(2)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except DataProblem as exc:
        typer.echo(f"problem: {exc}", err=True)
        sys.exit(1)
    except Stopped as exc:
        typer.echo(f"stopped: {exc}", err=True)
        sys.exit(STOPPED_STATUS)
    except OSError as exc:
        if exc.errno is None:
            raise
        typer.echo(f"error: {os_error_line(exc)}", err=True)
        sys.exit(2)
