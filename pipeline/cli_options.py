"""Option types that several `tcjepa` commands share (pipeline/cli.py, pipeline/cli_cache_store.py): each declared
once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

CacheDir = Annotated[
    str, typer.Argument(help="Caption cache: a directory, or an fsspec URL (s3://...: mirrored locally first).")
]
Mirror = Annotated[
    Path | None, typer.Option(help="Local mirror directory of s3:// (fsspec) URLs (default: ~/.cache/tcjepa/mirror).")
]
Executor = Annotated[
    str, typer.Option(help="local (this process) or ray (Ray Data, a model actor per GPU; see docs/cluster.md).")
]
RayAddress = Annotated[
    str | None,
    typer.Option(help="With --executor ray: the cluster to join (default: RAY_ADDRESS, else a local instance)."),
]
RayActors = Annotated[
    int | None,
    typer.Option(
        help="With --executor ray: model actors (default: one per GPU, or per tensor_parallel_size GPUs; else 1)."
    ),
]
Progress = Annotated[bool, typer.Option(help="Show a progress bar.")]
