"""The `tcjepa` command line: a thin typer app; each command imports its stage lazily.

Bad input raises `UserError`, which `main` prints as one line (exit status 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from evaluation.protocol import HELP as EVAL_PROTOCOL
from pipeline.core.errors import STOPPED_STATUS, DataProblem, Stopped, UserError, os_error_line

app = typer.Typer(
    name="tcjepa",
    help="TC-JEPA: caption images (vLLM), embed captions (T5 → Zarr), pretrain image encoders on them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Inspect a caption cache.", no_args_is_help=True)
store_app = typer.Typer(help="Inspect an embedding store.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
app.add_typer(store_app, name="store")


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
    t5_corpus: Annotated[
        Path | None,
        typer.Option(help="captions.jsonl to train the tiny T5 on (span corruption); without it the T5 stays random."),
    ] = None,
    t5_steps: Annotated[int, typer.Option(help="Training steps for the tiny T5 (with --t5-corpus).")] = 800,
    t5_phrase_tags: Annotated[
        bool,
        typer.Option(
            help="Also train the T5 to tag each token of an object's phrase in fresh `tcjepa synth` captions with the "
            "object's cell and class, so its vectors bind attributes to positions as a pretrained T5's do; off: span "
            "corruption alone, which binds weakly."
        ),
    ] = True,
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
    captions: Annotated[
        str,
        typer.Option(
            help="full: every caption names every object and its cell; partial: each names 1-3 objects, some by shape "
            "or colour alone, some at a loose position (what the demo and the ablations use)."
        ),
    ] = "full",
    layout: Annotated[
        str,
        typer.Option(
            help="grid: one shape per cell of a --grid on grey; free: 3-6 overlapping shapes anywhere on textured "
            "backgrounds, so that neither position nor a patch's own pixels tell what a patch belongs to."
        ),
    ] = "grid",
) -> None:
    """Draw synthetic scenes of shapes with 8 captions each that say what is where."""
    from pipeline.devkit.dataset import generate

    generate(out, n_images, image_size=image_size, grid=grid, seed=seed, captions=captions, layout=layout)
    typer.echo(f"wrote {n_images} images, captions.jsonl and labels.jsonl to {out}")


def parse_engine_args(pairs: list[str]) -> dict[str, object]:
    from pipeline.core.keyvalues import parse_key_values

    return parse_key_values(pairs, "--vllm-arg", "tensor_parallel_size=2")


def check_executor(name: str) -> str:
    if name not in ("local", "ray"):
        raise UserError(f"--executor {name!r}: choose local or ray")
    return name


@app.command()
def caption(
    cache: Annotated[
        str,
        typer.Option(
            help="Caption cache (created if missing): a directory, or an s3:// URL that several hosts may write at "
            "once."
        ),
    ],
    images: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Image folders (recursive), Parquet files, HF datasets directories, tar shards, image files, or "
            "hf:PATH_OR_ID[split] (whatever datasets.load_dataset opens)."
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Vision-language chat model: a local directory or a hub id.")
    ] = None,
    captions_per_image: Annotated[
        int, typer.Option(help="N captions per image, spread over the prompts (K prompts × n samples).")
    ] = 8,
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="Prompt templates: .json/.yaml list of strings or {id, text}, or one per line (default: dense, "
            "spatial, objects, setting)."
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(help="Name of this recipe in the cache (what `embed` and `train` --recipe select it by)."),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Base seed; each (image, prompt) gets a seed derived from it and the image hash.")
    ] = 0,
    shard: Annotated[
        str, typer.Option(help="Caption only images whose hash falls in shard i of n (one process per GPU).")
    ] = "0/1",
    backend: Annotated[
        str, typer.Option(help="vllm (default) or hf (transformers generate, for models vLLM lacks).")
    ] = "vllm",
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option(help="Engine option key=value passed to vllm.LLM (repeatable), e.g. tensor_parallel_size=2."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Max new tokens per caption.")] = 160,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 0.8,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold.")] = 0.95,
    max_pixels: Annotated[
        int, typer.Option(help="Images larger than this many pixels are downscaled before the engine.")
    ] = 1024 * 1024,
    chunk_images: Annotated[
        int, typer.Option(help="Images per engine call; each finished chunk is committed to the cache.")
    ] = 256,
    decode_workers: Annotated[
        int | None,
        typer.Option(
            help="Processes decoding the next chunk while the engine works (0: one thread; default: up to 8 with a "
            "GPU, a thread on CPU)."
        ),
    ] = None,
    image_column: Annotated[
        str | None, typer.Option(help="Image column of Parquet / datasets inputs (default: image, img, jpg, png).")
    ] = None,
    device: Annotated[str, typer.Option(help="Device of the hf backend: auto, cpu, cuda.")] = "auto",
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow the model's own Python code to run (off unless asked for).")
    ] = False,
    dry_run: Annotated[bool, typer.Option(help="Only count the images that would be captioned.")] = False,
    annotations: Annotated[
        bool,
        typer.Option(
            "--annotations",
            help="Instead of captioning with a model, import the captions IMAGES hold: one JSONL "
            "({'image', 'captions'}) or COCO captions file, or WebDataset tar shards (a sample's .txt: a caption per "
            "line; .json: caption or captions) and folders of them, or tables with --caption-column.",
        ),
    ] = False,
    image_root: Annotated[
        Path | None,
        typer.Option(help="With --annotations: where the file's image paths point (default: its directory)."),
    ] = None,
    caption_column: Annotated[
        str | None,
        typer.Option(help="With --annotations: the caption column of Parquet / datasets inputs (a string or a list)."),
    ] = None,
    split: Annotated[
        str, typer.Option(help="Split of hf:PATH_OR_ID inputs (datasets.load_dataset) that do not name one.")
    ] = "train",
    mirror: Annotated[
        Path | None,
        typer.Option(help="Local mirror directory of an s3:// --cache (default: ~/.cache/tcjepa/mirror)."),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            help="local (this process) or ray (Ray tasks read and decode, one engine actor per GPU captions and "
            "commits)."
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(help="With --executor ray: the cluster to join (default: RAY_ADDRESS, else a local instance)."),
    ] = None,
    ray_actors: Annotated[
        int | None,
        typer.Option(
            help="With --executor ray: engine actors (default: one per GPU, or per tensor_parallel_size GPUs; else 1)."
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
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
        if report.captions_added + report.captions_already_cached == 0:
            shown = " ".join(map(str, images[:3]))
            raise UserError(f"--annotations {shown}: no usable caption (skipped: {dict(report.skipped)})")
        return
    if not images or model is None:
        raise UserError("captioning needs IMAGES and --model (or --annotations FILE to import captions)")
    from captioning.engines import SamplingConfig
    from captioning.job import run_caption
    from captioning.work import CaptionConfig
    from pipeline.core.images import ImagePolicy

    cfg = CaptionConfig(
        inputs=images,
        cache=cache,
        model=model,
        captions_per_image=captions_per_image,
        prompts_file=prompts,
        recipe_name=recipe,
        seed=seed,
        shard=shard,
        backend=backend,
        engine_args=parse_engine_args(vllm_arg or []),
        sampling=SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p),
        image_policy=ImagePolicy(max_pixels=max_pixels),
        image_column=image_column,
        split=split,
        chunk_images=chunk_images,
        decode_workers=decode_workers,
        device=device,
        trust_remote_code=trust_remote_code,
        dry_run=dry_run,
        mirror=mirror,
        executor=check_executor(executor),
        ray_address=ray_address,
        ray_actors=ray_actors,
        progress=progress,
    )
    typer.echo(run_caption(cfg).summary(dry_run))


@cache_app.command("info")
def cache_info(
    cache: Annotated[
        str, typer.Argument(help="Caption cache: a directory, or an fsspec URL (s3://...: mirrored locally first).")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    mirror: Annotated[
        Path | None, typer.Option(help="Local mirror directory of a URL (default: ~/.cache/tcjepa/mirror).")
    ] = None,
) -> None:
    """Images, captions, recipes (hash, name, counts), shards and failures of a cache."""
    from dataclasses import asdict

    from captioning.cache import CaptionCache
    from captioning.remote_cache import local_cache

    info = CaptionCache(local_cache(cache, mirror)).info()
    if as_json:
        typer.echo(json.dumps(asdict(info)))
        return
    typer.echo(
        f"{cache}: {info.images} images, {info.captions} captions, {info.shards} shards, {info.failures} failures"
    )
    for r in info.recipes:
        typer.echo(
            f"  recipe {r['hash'][:12]}  {r['kind']:<12} {r['name'] or '-':<24} {r['images']:>9} images "
            f"{r['captions']:>10} captions"
        )


@cache_app.command("compact")
def cache_compact(
    cache: Annotated[str, typer.Argument(help="Caption cache: a directory, or an s3:// URL.")],
    target_mb: Annotated[
        float, typer.Option(help="Merge consecutive shards smaller than this into shards of about this size (MiB).")
    ] = 256.0,
    mirror: Annotated[
        Path | None, typer.Option(help="Local mirror directory of an s3:// cache (default: ~/.cache/tcjepa/mirror).")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Merge small shards into few large ones; readers see every row once throughout, and a kill is safe (rerun)."""
    from captioning.compact import compact_cache

    typer.echo(compact_cache(cache, target_mb, mirror, progress).summary())


@cache_app.command("verify")
def cache_verify(
    cache: Annotated[
        str,
        typer.Argument(help="Caption cache: a directory, or an fsspec URL (s3://...: mirrored locally, then checked)."),
    ],
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Check manifests, per-shard sha256, schema, recipes and caption-key uniqueness; exit 1 with the first problem."""
    from captioning.verify import verify_cache

    typer.echo(verify_cache(cache, progress=progress).summary())


@store_app.command("info")
def store_info(
    store: Annotated[Path, typer.Argument(help="Embedding store directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a line.")] = False,
) -> None:
    """Encoder recipe, codec, projection, bytes per token, segments, captions and tokens of an embedding store."""
    from embedding_cache.store import EmbeddingStore

    s = EmbeddingStore(store)
    projection = s.encoder.get("projection")
    info: dict[str, Any] = {
        "encoder_hash": s.encoder_hash,
        "encoder": s.encoder,
        "version": s.version,
        "d_model": s.width,
        "codec": s.codec,
        "projection": None
        if projection is None
        else {k: projection[k] for k in ("dim", "source_width", "explained_variance")},
        "bytes_per_token": s.bytes_per_token,
        **s.stats(),
        "bytes_on_disk": sum(p.stat().st_size for p in store.rglob("*") if p.is_file()),
    }
    if as_json:
        typer.echo(json.dumps(info))
        return
    pca = (
        f" (PCA {projection['source_width']} -> {projection['dim']}, {100 * projection['explained_variance']:.1f}% of "
        "the variance)"
        if projection
        else ""
    )
    typer.echo(
        f"{info['segments']} segments, {info['captions']} captions, {info['tokens']} tokens; {s.codec}, width "
        f"{s.width}{pca}, {s.bytes_per_token} bytes per token; {info['bytes_on_disk'] / 2**20:.2f} MiB on disk; "
        f"encoder {s.encoder_hash[:12]} ({s.encoder.get('model', s.encoder.get('kind'))}, max length "
        f"{s.encoder.get('max_length')})"
    )


@store_app.command("verify")
def store_verify(
    store: Annotated[
        str,
        typer.Argument(
            help="Embedding store: a directory, or an fsspec URL (s3://...: mirrored locally, then checked)."
        ),
    ],
    deep: Annotated[
        bool,
        typer.Option(help="Also re-encode a sample of captions with the recorded encoder and compare (needs --cache)."),
    ] = False,
    cache: Annotated[
        Path | None, typer.Option(help="--deep: the caption cache the store was embedded from (for the texts).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="--deep: the T5 encoder (checked against the store's recipe); default: the recorded hub id."),
    ] = None,
    sample: Annotated[int, typer.Option(help="--deep: captions to re-encode.")] = 64,
    seed: Annotated[int, typer.Option(help="--deep: seed of the sample.")] = 0,
    device: Annotated[str, typer.Option(help="--deep: device for the encoder (auto, cpu, cuda, cuda:N).")] = "auto",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Check segments, offsets, recorded sha256, finiteness and key uniqueness; exit 1 with the first problem."""
    from embedding_cache.verify import verify_store

    report = verify_store(
        store, deep=deep, cache=cache, model=model, sample=sample, seed=seed, device=device, progress=progress
    )
    typer.echo(report.summary())


@app.command()
def embed(
    cache: Annotated[
        str,
        typer.Option(
            help="Caption cache to read captions from: a directory or an fsspec URL (s3://..., mirrored locally)."
        ),
    ],
    store: Annotated[
        str,
        typer.Option(
            help="Zarr v3 embedding store to append to (created if missing): a directory, or an s3:// URL that several "
            "hosts may write at once."
        ),
    ],
    model: Annotated[str, typer.Option(help="T5 encoder: a local directory or a hub id (T5EncoderModel + tokenizer).")],
    recipe: Annotated[
        list[str] | None,
        typer.Option(
            help="Caption recipe(s) to encode, by hash prefix or name (repeatable); required when the cache holds "
            "several."
        ),
    ] = None,
    token_budget: Annotated[
        int, typer.Option(help="Max padded tokens (batch size × longest caption) per encoder batch.")
    ] = 16384,
    max_length: Annotated[
        int,
        typer.Option(
            help="Captions longer than this many tokens are truncated (counted and reported); the trainer reads at "
            "most max_words (128) of them."
        ),
    ] = 128,
    eos: Annotated[bool, typer.Option(help="Keep T5's end-of-sequence token as the last token.")] = True,
    dtype: Annotated[
        str, typer.Option(help="Compute dtype: bfloat16 or float32 (never float16: T5 overflows).")
    ] = "bfloat16",
    store_dtype: Annotated[
        str,
        typer.Option(
            help="How the store keeps vectors: float16, or int8 (per-token absmax + a float32 scale per token; "
            "~half the bytes). A store keeps one."
        ),
    ] = "float16",
    project_dim: Annotated[
        int | None,
        typer.Option(
            help="Store a fixed PCA of the vectors to this width, fitted on a sample of the captions when the store "
            "is made (the trainer's text width becomes it)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N.")] = "auto",
    window: Annotated[
        int, typer.Option(help="Captions sorted by length together; they are written back in image order.")
    ] = 8192,
    segment_mb: Annotated[
        float, typer.Option(help="Publish a segment every this many MiB of tokens (bounds the work a kill loses).")
    ] = 4096.0,
    chunk_tokens: Annotated[
        int | None, typer.Option(help="Rows per inner zarr chunk of `tokens` (default: ~16 MiB).")
    ] = None,
    shard_chunks: Annotated[
        int | None, typer.Option(help="Inner chunks per shard file (default: ~1 GiB shards).")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(help="Only count the captions and tokens that would be added, and the bytes of each codec."),
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar with tokens/s.")] = True,
    mirror: Annotated[
        Path | None,
        typer.Option(help="Local mirror directory of an s3:// --cache or --store (default: ~/.cache/tcjepa/mirror)."),
    ] = None,
    executor: Annotated[
        str,
        typer.Option(
            help="local (this process) or ray (a Ray Data actor pool, one T5 per GPU; each batch of --window captions "
            "is one segment)."
        ),
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option(help="With --executor ray: the cluster to join (default: RAY_ADDRESS, else a local instance)."),
    ] = None,
    ray_actors: Annotated[
        int | None,
        typer.Option(help="With --executor ray: T5 actors (default: one per GPU in the cluster, else 1)."),
    ] = None,
) -> None:
    """Encode every caption not yet in the store with T5 and append them as a new segment."""
    from embedding_cache.job import run_embed
    from embedding_cache.work import EmbedConfig

    cfg = EmbedConfig(
        cache=cache,
        store=store,
        mirror=mirror,
        model=model,
        recipes=recipe or [],
        token_budget=token_budget,
        max_length=max_length,
        eos=eos,
        compute_dtype=dtype,
        store_dtype=store_dtype,
        project_dim=project_dim,
        device=device,
        window=window,
        segment_mb=segment_mb,
        chunk_tokens=chunk_tokens,
        shard_chunks=shard_chunks,
        dry_run=dry_run,
        progress=progress,
        executor=check_executor(executor),
        ray_address=ray_address,
        ray_actors=ray_actors,
    )
    report = run_embed(cfg)
    typer.echo(report.summary(dry_run))


def config_option(key: str, *names: str) -> Any:
    """A `train` flag that sets config key `key`: its help and default come from the config's field."""
    from train.config import TrainConfig, field_help

    return typer.Option(*names, help=f"{field_help(key)} (config key {key}; default: {getattr(TrainConfig(), key)})")


def _help_config(value: bool) -> None:
    if value:
        from dataclasses import fields

        from train.config import TrainConfig

        for f in fields(TrainConfig):
            default = f.default_factory() if callable(f.default_factory) else f.default
            typer.echo(f"{f.name:<20} {f.metadata['help']} (default: {default!r})")
        raise typer.Exit()


@app.command()
def train(
    out: Annotated[
        Path,
        typer.Option(
            help="Run directory: config.yaml, index.parquet, checkpoint.pt, metrics.jsonl, curves.png. Resumes if it "
            "holds a checkpoint."
        ),
    ],
    images: Annotated[
        list[str] | None,
        typer.Argument(
            help="Image sources, as for `tcjepa caption` (the same ones the cache was made from); tar shards may be "
            "fsspec URLs (s3://bucket/shard.tar, or a prefix holding .tar shards), fetched per node into the mirror."
        ),
    ] = None,
    cache: Annotated[
        str | None,
        typer.Option(
            help="Caption cache: a directory or an fsspec URL such as s3://bucket/cache (mirrored locally; not needed "
            "with --conditioning none)."
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="Embedding store made by `tcjepa embed` from the cache: a directory or an fsspec URL (mirrored "
            "locally)."
        ),
    ] = None,
    recipe: Annotated[
        list[str] | None,
        typer.Option(
            help="Caption recipe(s) to train on, by name or hash prefix (repeatable); required when the cache holds "
            "several."
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML file of config keys (see --help-config); flags and --set override it.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override any config key: key=value (repeatable), e.g. --set ema=[0.996,1.0]."),
    ] = None,
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
    verify_images: Annotated[bool | None, config_option("verify_images", "--verify-images/--no-verify-images")] = None,
    image_column: Annotated[str | None, config_option("image_column")] = None,
    split: Annotated[str | None, config_option("split")] = None,
    compile_: Annotated[bool | None, config_option("compile", "--compile/--no-compile")] = None,
    accum_steps: Annotated[int | None, config_option("accum_steps")] = None,
    partitions: Annotated[int | None, config_option("partitions")] = None,
    checkpoint_activations: Annotated[
        bool | None, config_option("checkpoint_activations", "--checkpoint-activations/--no-checkpoint-activations")
    ] = None,
    fsdp: Annotated[bool | None, config_option("fsdp", "--fsdp/--no-fsdp")] = None,
    shard_within_node: Annotated[
        bool | None, config_option("shard_within_node", "--shard-within-node/--no-shard-within-node")
    ] = None,
    init: Annotated[str | None, config_option("init")] = None,
    log: Annotated[list[str] | None, config_option("log")] = None,
    resume: Annotated[
        bool, typer.Option(help="Require a checkpoint in --out to continue from (resuming is automatic anyway).")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
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
    from train.config import TrainConfig, apply, load_yaml, parse_set, saved_config

    saved = out / "config.yaml"
    cfg = TrainConfig()
    if saved.exists() and config is None:
        cfg = apply(cfg, saved_config(load_yaml(saved)), str(saved))
    if config is not None:
        cfg = apply(cfg, load_yaml(config), str(config))
    flags = {
        "images": list(images) if images else None,
        "cache": cache,
        "store": store,
        "recipes": recipe,
        "model": model,
        "patch_size": patch_size,
        "image_size": image_size,
        "batch_size": batch_size,
        "steps": steps,
        "conditioning": conditioning,
        "pool": pool,
        "captions_per_image": captions_per_image,
        "lambda_sparse": lambda_sparse,
        "beta_consistency": beta_consistency,
        "lr": lr,
        "min_coverage": min_coverage,
        "seed": seed,
        "device": device,
        "num_workers": num_workers,
        "decode": decode,
        "verify_images": verify_images,
        "image_column": image_column,
        "split": split,
        "compile": compile_,
        "accum_steps": accum_steps,
        "partitions": partitions,
        "checkpoint_activations": checkpoint_activations,
        "fsdp": fsdp,
        "shard_within_node": shard_within_node,
        "init": init,
        "log": log,
    }
    cfg = apply(cfg, {k: v for k, v in flags.items() if v is not None}, "command line")
    cfg = apply(cfg, parse_set(set_ or []), "--set")
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
    run: Annotated[
        Path, typer.Argument(help="Run directory of `tcjepa train` (its checkpoint's EMA target encoder is probed).")
    ],
    images: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Image sources holding the labelled images (folders, tar shards, Parquet, HF datasets), with "
            "--labels; not needed with --train/--val."
        ),
    ] = None,
    labels: Annotated[
        Path | None,
        typer.Option(
            help='JSONL lines {"image": ..., "label": ...}; optional "cells" and named "cell_maps" + "cell_size" '
            '(dense probes), "tags" (multilabel probe) and "split" (train/val/test).'
        ),
    ] = None,
    train: Annotated[
        Path | None,
        typer.Option(
            help="Class folders of the training images, ImageNet layout (DIR/train/<class>/<image>; class = folder "
            "name); with --val, replaces IMAGES and --labels."
        ),
    ] = None,
    val: Annotated[
        Path | None,
        typer.Option(help="Class folders of the images the probes are scored on (DIR/val/<class>/<image>)."),
    ] = None,
    probe: Annotated[
        list[str] | None,
        typer.Option(
            help="linear, knn, dense (one per per-cell map), multilabel or attentive (repeatable). Default: all that "
            "the labels allow."
        ),
    ] = None,
    image_root: Annotated[
        Path | None,
        typer.Option(help="Folder the labels' image paths are relative to (default: the labels file's folder)."),
    ] = None,
    test_fraction: Annotated[
        float, typer.Option(help="Share of labelled images held out for test (without a split in the labels).")
    ] = 0.2,
    val_fraction: Annotated[
        float,
        typer.Option(
            help="Share of the training images held out to pick each probe's hyper-parameters (with --train too)."
        ),
    ] = 0.2,
    seed: Annotated[
        int, typer.Option(help="Seed of the split and the probes; the random floor's seed is drawn from it.")
    ] = 0,
    floor_seed: Annotated[
        int | None,
        typer.Option(
            help="Generator seed of the random-init floor (default: drawn from --seed, apart from any run's; the "
            "run's own seed is refused: that encoder is the run's starting weights)."
        ),
    ] = None,
    encoder: Annotated[
        str, typer.Option(help="The run's encoder to probe: target (its EMA target encoder) or context.")
    ] = "target",
    eval_resize: Annotated[
        str,
        typer.Option(
            help="auto, crop or whole: resize the shorter side and centre-crop (photographs), or resize the whole "
            "image (scenes); auto takes whole when every image is square and at the model's size or its label "
            "cells fit the patch grid."
        ),
    ] = "auto",
    steps: Annotated[
        str | None,
        typer.Option(
            help="Probe the checkpoints the run kept: steps separated by commas, or `all`; one report per step, the "
            "floors measured once, and learning curves against them (RUN/eval/NAME.curves.png)."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto, cpu, cuda or cuda:N, for feature extraction and every probe.")
    ] = "auto",
    batch_size: Annotated[int, typer.Option(help="Images per feature-extraction batch.")] = 64,
    num_workers: Annotated[int, typer.Option(help="DataLoader worker processes decoding images.")] = 2,
    report: Annotated[
        Path | None,
        typer.Option(help="Where to write the JSON report (default RUN/eval/<labels name, or DIR's name>.json)."),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar while extracting features.")] = True,
    floors_from: Annotated[
        Path | None,
        typer.Option(
            help="An earlier report (another run of the same architecture, evaluated on the same images, labels, "
            "probes and seed) whose floors this report reuses instead of measuring them again; refused if they "
            "were measured otherwise."
        ),
    ] = None,
) -> None:
    from evaluation.evaluate import PROBES, EvalConfig, evaluate, evaluate_steps, one_line, steps_to_probe

    probes = tuple(probe) if probe else None
    cfg = EvalConfig(
        run=run,
        images=images,
        labels=labels,
        train=train,
        val=val,
        image_root=image_root,
        test_fraction=test_fraction,
        val_fraction=val_fraction,
        seed=seed,
        device=device,
        batch_size=batch_size,
        num_workers=num_workers,
        report=report,
        progress=progress,
        probes=probes or PROBES,
        floors_from=floors_from,
        encoder=encoder,
        eval_resize=eval_resize,
        floor_seed=floor_seed,
    )
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
    format: Annotated[
        str,
        typer.Option(
            help="timm: timm's names and config.json (architecture, model_args, pretrained_cfg); hf: a folder "
            "transformers.IJepaModel.from_pretrained loads."
        ),
    ] = "timm",
    encoder: Annotated[
        str, typer.Option(help="target (the EMA target encoder, which eval probes) or context.")
    ] = "target",
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
    text_model: Annotated[
        Path,
        typer.Option(help="The T5 directory given to `tcjepa embed` for the run's store (checked against its recipe)."),
    ],
    out: Annotated[Path, typer.Option(help="PNG to write.")],
    top: Annotated[
        int, typer.Option(help="How many words to draw heat maps for (highest peak patch–word cosine first).")
    ] = 8,
) -> None:
    """Draw patch–word cosine heat maps and per-patch prediction error with the captions, their words shuffled, and no
    text."""
    from evaluation.viz import render

    typer.echo(json.dumps(render(run, image, captions, text_model, out, top=top)))


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Directory for the demo's data, models, cache, store and summary.")] = Path(
        "demo-out"
    ),
    n_images: Annotated[int, typer.Option(help="Synthetic scenes to generate.")] = 600,
    t5_steps: Annotated[
        int, typer.Option(help="Training steps for the tiny T5 (span corruption and phrase tagging).")
    ] = 600,
    train_steps: Annotated[int, typer.Option(help="Training steps of each of the two runs (none, cross).")] = 300,
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
