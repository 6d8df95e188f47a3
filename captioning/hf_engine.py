"""The transformers backend, for vision-language models vLLM does not serve.

Same requests, prompts and recipe semantics as the vLLM backend; slower (one
`generate` call per request, `num_return_sequences` samples). Sample k of a
request is drawn with the torch seed `seed + k`, so a caption is reproducible.
"""

from __future__ import annotations

from captioning.engines import CaptionRequest, Generated, SamplingConfig, chat_prompt, load_processor
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError


class HFEngine:
    name = "transformers"

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False) -> None:
        import transformers
        from transformers import AutoModelForImageTextToText

        self.version = transformers.__version__
        self.processor = load_processor(model, trust_remote_code)
        self.chat_template: str = self.processor.chat_template
        self.engine_args = {"dtype": dtype} if dtype != "auto" else {}
        self.device = resolve_device(device)
        try:
            self.model = (
                AutoModelForImageTextToText.from_pretrained(model, dtype=dtype, trust_remote_code=trust_remote_code)
                .to(self.device)
                .eval()
            )
        except (OSError, ValueError) as exc:
            raise UserError(
                f"--model {model}: transformers cannot load it as an image-text-to-text model "
                f"({str(exc).splitlines()[0]})"
            ) from None

    def generate(self, requests: list[CaptionRequest], sampling: SamplingConfig) -> list[list[Generated]]:
        import torch

        results = []
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for r in requests:
            inputs = self.processor(
                text=[chat_prompt(self.processor, r.prompt)], images=[r.image], return_tensors="pt"
            ).to(self.device)
            prompt_len = inputs["input_ids"].shape[1]
            samples = []
            for k in range(r.n):
                torch.manual_seed(r.seed + k)
                with torch.inference_mode():
                    out = self.model.generate(
                        **inputs,
                        do_sample=True,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        max_new_tokens=sampling.max_tokens,
                    )
                tokens = out[0, prompt_len:].tolist()
                stopped = bool(tokens) and tokens[-1] in eos_ids
                if stopped:
                    tokens = tokens[:-1]
                text = self.processor.decode(tokens, skip_special_tokens=True)
                samples.append(
                    Generated(
                        text,
                        "stop" if stopped or len(tokens) < sampling.max_tokens else "length",
                        len(tokens) + stopped,
                    )
                )
            results.append(samples)
        return results

    def close(self) -> None:
        """Nothing runs outside this process."""
