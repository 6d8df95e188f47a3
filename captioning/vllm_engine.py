"""The vLLM backend: one `LLM` per process, requests sent in chunks with per-request seeds.

`SamplingParams(n=k, seed=s)` gives the k samples seeds s..s+k-1 inside vLLM, so a
caption is reproducible from (image, recipe). Engine options pass through from
`--vllm-arg key=value`; on CPU builds the settings vLLM needs there are filled
in unless given (see docs/cli.md, "vLLM on CPU").
"""

from __future__ import annotations

import os
from typing import Any

from captioning.engines import CaptionRequest, Generated, SamplingConfig, chat_prompt, load_processor
from pipeline.core.errors import UserError

# Engine options that change the generated text, and so belong in the recipe.
OUTPUT_AFFECTING_ARGS = (
    "dtype",
    "quantization",
    "max_model_len",
    "mm_processor_kwargs",
    "hf_overrides",
    "tokenizer",
    "revision",
)


def is_cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def default_engine_args(cpu: bool) -> dict[str, Any]:
    """Settings needed for the CPU build (seeded sampling breaks with chunked prefill there)."""
    args: dict[str, Any] = {"limit_mm_per_prompt": {"image": 1, "video": 0}}
    if cpu:
        args.update(enforce_eager=True, enable_chunked_prefill=False, max_num_batched_tokens=16384)
    return args


_PROCESS_IS_THE_ENGINES = False


def give_this_process_to_the_engine() -> None:
    """Called by a process that exists to caption (the `caption` command, a Ray captioning actor): on the CPU build
    the engine core then runs in it rather than in two processes of its own, each importing vLLM again (the tiny
    model's start: 35 s becomes 9 s on 2 cores, `benchmarks/caption.py`), with nothing to overlap (the CPU runs the
    model either way). Not where anything else runs afterwards: in-process, vLLM sets up torch.distributed and
    environment variables of its own."""
    global _PROCESS_IS_THE_ENGINES
    _PROCESS_IS_THE_ENGINES = True


def prepare_cpu_environment() -> None:
    """vLLM's CPU build wants ~all RAM for its KV cache and pins one core by default."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if _PROCESS_IS_THE_ENGINES:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class VLLMEngine:
    name = "vllm"

    def __init__(self, model: str, engine_args: dict[str, Any], trust_remote_code: bool = False) -> None:
        import vllm

        self.version = vllm.__version__
        self.processor = load_processor(model, trust_remote_code)
        self.chat_template: str = self.processor.chat_template
        self.engine_args = dict(engine_args)
        cpu = is_cpu_build()
        if cpu:
            prepare_cpu_environment()
        args = {**default_engine_args(cpu), **engine_args}
        try:
            self.llm = vllm.LLM(model=model, trust_remote_code=trust_remote_code, **args)
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"vLLM refused the engine options {sorted(engine_args)}: {str(exc).splitlines()[0]}"
            ) from None

    def generate(self, requests: list[CaptionRequest], sampling: SamplingConfig) -> list[list[Generated]]:
        from vllm import SamplingParams

        prompts = {}
        inputs, params = [], []
        for r in requests:
            if r.prompt.id not in prompts:
                prompts[r.prompt.id] = chat_prompt(self.processor, r.prompt)
            inputs.append({"prompt": prompts[r.prompt.id], "multi_modal_data": {"image": r.image}})
            params.append(
                SamplingParams(
                    n=r.n,
                    seed=r.seed,
                    max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                )
            )
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out in outputs:
            samples = sorted(out.outputs, key=lambda c: c.index)
            result.append([Generated(c.text, str(c.finish_reason or "unknown"), len(c.token_ids)) for c in samples])
        return result

    def close(self) -> None:
        """Stop the engine's worker processes now rather than at interpreter exit."""
        self.llm.llm_engine.engine_core.shutdown()
