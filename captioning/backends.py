"""The captioning backends, by the name `--backend` takes: choosing one is a lookup in `BACKENDS`, not an if-chain.

Each backend says what the recipe records about it (engine name, package version, the
engine options that change the text) and how to start its engine. Engines import their
libraries only when started.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from captioning.engines import CaptionEngine
from captioning.vllm_engine import OUTPUT_AFFECTING_ARGS as VLLM_OUTPUT_AFFECTING_ARGS
from pipeline.core.errors import UserError


def _start_vllm(model: str, engine_args: dict[str, Any], device: str, trust_remote_code: bool) -> CaptionEngine:
    from captioning.vllm_engine import VLLMEngine

    return VLLMEngine(model, engine_args, trust_remote_code)


def _start_hf(model: str, engine_args: dict[str, Any], device: str, trust_remote_code: bool) -> CaptionEngine:
    from captioning.hf_engine import HFEngine

    return HFEngine(model, device, str(engine_args.get("dtype", "auto")), trust_remote_code)


@dataclass(frozen=True)
class Backend:
    engine: str  # the engine's name in the recipe
    package: str  # the package whose version the recipe records
    output_affecting_args: tuple[str, ...]  # engine options that change the text, so belong in the recipe
    accepted_args: tuple[str, ...] | None  # engine options it takes (None: any, passed through to the engine)
    start: Callable[[str, dict[str, Any], str, bool], CaptionEngine]  # (model, engine_args, device, trust_remote_code)

    def version(self) -> str:
        return str(importlib.import_module(self.package).__version__)

    def check_args(self, name: str, engine_args: dict[str, Any]) -> None:
        """Refuse engine options this backend would ignore."""
        if self.accepted_args is None:
            return
        unknown = sorted(set(engine_args) - set(self.accepted_args))
        if unknown:
            accepted = ", ".join(self.accepted_args)
            raise UserError(f"--backend {name} takes only {accepted} among engine options, not {unknown}")


BACKENDS: dict[str, Backend] = {
    "vllm": Backend("vllm", "vllm", VLLM_OUTPUT_AFFECTING_ARGS, None, _start_vllm),
    "hf": Backend("transformers", "transformers", ("dtype",), ("dtype",), _start_hf),
}


def get_backend(name: str) -> Backend:
    """The backend called `name`, or a one-line error naming the choices."""
    if name not in BACKENDS:
        raise UserError(f"--backend {name!r}: choose {' or '.join(BACKENDS)}")
    return BACKENDS[name]
