"""Session-wide fixtures: tiny models and synthetic data are built once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def python_module(
    module: str, *args: str, check: bool = True, timeout: float = 600, **kwargs
) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` from the repository root in a subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kwargs,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"python -m {module} {' '.join(map(str, args))} exited "
            f"{proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def tcjepa(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m pipeline ...`) in a subprocess."""
    return python_module("pipeline", *args, check=check, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    tcjepa("synth", "--out", out, "--n-images", 40, "--seed", 3)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """`DIR/t5` (random tiny T5) and `DIR/vlm` (random tiny Qwen2-VL), built through the CLI."""
    out = tmp_path_factory.mktemp("tiny")
    tcjepa("tiny-models", "--out", out)
    return out


@pytest.fixture(scope="session")
def annotated_cache(tmp_path_factory, synth_dir) -> Path:
    cache = tmp_path_factory.mktemp("cache") / "cache"
    tcjepa("caption", "--cache", cache, "--annotations", synth_dir / "captions.jsonl")
    return cache


@pytest.fixture(scope="session")
def annotated_store(tmp_path_factory, annotated_cache, tiny_models) -> Path:
    """Embeddings (random tiny T5) of every caption of `annotated_cache`, in small chunks and shards."""
    path = tmp_path_factory.mktemp("store") / "store"
    tcjepa(
        "embed",
        "--cache",
        annotated_cache,
        "--store",
        path,
        "--model",
        tiny_models / "t5",
        "--chunk-tokens",
        "64",
        "--shard-chunks",
        "4",
        "--window",
        "64",
        "--no-progress",
    )
    return path


TINY_VLLM_ARGS = {"max_model_len": 1024}


@pytest.fixture(scope="session")
def vllm_engine(tiny_models):
    """One vLLM engine (CPU build) on the tiny Qwen2-VL for the whole session: a start costs ~20 s."""
    from captioning.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_models / "vlm"), dict(TINY_VLLM_ARGS))
    yield engine
    engine.close()
