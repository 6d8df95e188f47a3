"""Captioning with the tiny VLM on vLLM (the session's `vllm_engine`, `tcjepa caption`), and reading the rows of a
caption cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_VLLM_ARGS = {"max_model_len": 1024}
CAPTION_MAX_TOKENS = 12
# `tcjepa caption` flags of the configuration `caption_config` makes.
VLLM_CLI = [
    "--vllm-arg",
    "max_model_len=1024",
    "--max-tokens",
    str(CAPTION_MAX_TOKENS),
    "--chunk-images",
    "4",
    "--decode-workers",
    "1",
]


def caption_config(images: list, cache: Path, tiny_models: Path, **kw: Any):
    """A `CaptionConfig` for the tiny VLM on vLLM (the settings of `VLLM_CLI`)."""
    from captioning.engines import SamplingConfig
    from captioning.work import CaptionConfig

    return CaptionConfig(
        inputs=images,
        cache=cache,
        model=str(tiny_models / "vlm"),
        engine_args=dict(TINY_VLLM_ARGS),
        sampling=SamplingConfig(max_tokens=CAPTION_MAX_TOKENS),
        chunk_images=4,
        decode_workers=1,
        **kw,
    )


def caption_rows(cache: Path, recipe: str | None = None) -> list[dict]:
    """Every caption row of a cache (of one recipe)."""
    from captioning.cache import CaptionCache

    return CaptionCache(cache).read_captions(recipes=None if recipe is None else [recipe]).to_pylist()
