"""`tcjepa cache ...` and `tcjepa store ...`: inspect, compact, verify and collect the garbage of caption caches and
embedding stores; each command imports its stage lazily."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pipeline.cli_options import CacheDir, Mirror, Progress

cache_app = typer.Typer(
    help="Inspect, compact, verify and collect the garbage of a caption cache.", no_args_is_help=True
)
store_app = typer.Typer(help="Inspect, verify and collect the garbage of an embedding store.", no_args_is_help=True)
RemoteUrl = Annotated[str, typer.Argument(help="A cache or store on object storage (s3://...).")]
Grace = Annotated[str, typer.Option(help="Spare uploads younger than this (24h, 90m, 30s); a live writer is safe.")]
Delete = Annotated[bool, typer.Option(help="Delete what was found (default: only report it).")]


@cache_app.command("info")
def cache_info(
    cache: CacheDir,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    mirror: Mirror = None,
) -> None:
    """Images, captions, recipes (hash, name, counts), shards and failures of a cache."""
    from dataclasses import asdict

    from captioning.cache import CaptionCache
    from captioning.remote_cache import local_cache

    info = CaptionCache(local_cache(cache, mirror)).info()
    typer.echo(json.dumps(asdict(info)) if as_json else info.summary(cache))


@cache_app.command("compact")
def cache_compact(
    cache: CacheDir,
    target_mb: Annotated[float, typer.Option(help="Merge small shards into shards of about this many MiB.")] = 256.0,
    mirror: Mirror = None,
    progress: Progress = True,
) -> None:
    """Merge small shards into few large ones; readers see every row once throughout, and a kill is safe (rerun)."""
    from captioning.compact import compact_cache

    typer.echo(compact_cache(cache, target_mb, mirror, progress).summary())


@cache_app.command("verify")
def cache_verify(cache: CacheDir, progress: Progress = True) -> None:
    """Check manifests, per-shard sha256, schema, recipes and caption-key uniqueness; exit 1 with the first problem."""
    from captioning.verify import verify_cache

    typer.echo(verify_cache(cache, progress=progress).summary())


@cache_app.command("gc")
def cache_gc(url: RemoteUrl, grace: Grace = "24h", delete: Delete = False) -> None:
    """Find (and with --delete, remove) uploaded shard files no log entry names: a dead writer's leftovers."""
    from captioning.remote_cache import collect_cache_garbage
    from pipeline.core.garbage import parse_grace

    typer.echo(collect_cache_garbage(url, parse_grace(grace), delete).summary())


@store_app.command("info")
def store_info(
    store: Annotated[Path, typer.Argument(help="Embedding store directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a line.")] = False,
) -> None:
    """Encoder recipe, codec, projection, bytes per token, segments, captions and tokens of an embedding store."""
    from dataclasses import asdict

    from embedding_cache.store import EmbeddingStore

    info = EmbeddingStore(store).info()
    typer.echo(json.dumps(asdict(info)) if as_json else info.summary())


@store_app.command("verify")
def store_verify(
    store: Annotated[str, typer.Argument(help="Embedding store: a directory, or an fsspec URL (mirrored locally).")],
    deep: Annotated[bool, typer.Option(help="Also re-encode a sample of captions to compare (needs --cache).")] = False,
    cache: Annotated[Path | None, typer.Option(help="--deep: the caption cache the store was embedded from.")] = None,
    model: Annotated[str | None, typer.Option(help="--deep: the T5 encoder (default: the recorded hub id).")] = None,
    sample: Annotated[int, typer.Option(help="--deep: captions to re-encode.")] = 64,
    seed: Annotated[int, typer.Option(help="--deep: seed of the sample.")] = 0,
    device: Annotated[str, typer.Option(help="--deep: device for the encoder (auto, cpu, cuda, cuda:N).")] = "auto",
    progress: Progress = True,
) -> None:
    """Check segments, offsets, recorded sha256, finiteness and key uniqueness; exit 1 with the first problem."""
    from embedding_cache.verify import verify_store

    report = verify_store(
        store, deep=deep, cache=cache, model=model, sample=sample, seed=seed, device=device, progress=progress
    )
    typer.echo(report.summary())


@store_app.command("gc")
def store_gc(url: RemoteUrl, grace: Grace = "24h", delete: Delete = False) -> None:
    """Find (and with --delete, remove) uploaded segment files neither the root nor the log names."""
    from embedding_cache.remote_store import collect_store_garbage
    from pipeline.core.garbage import parse_grace

    typer.echo(collect_store_garbage(url, parse_grace(grace), delete).summary())
