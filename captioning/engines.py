"""What a captioning engine takes and returns, and the chat prompt both engines build.

An engine turns a list of `CaptionRequest` (an RGB image, a prompt, how many
samples, a seed) into, per request, that many `Generated` captions. The prompt
text is the model's own chat template applied to one user turn holding the
image and the instruction, so the vLLM and transformers backends see the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from captioning.prompts import Prompt


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; part of the caption recipe."""

    max_tokens: int = 160
    temperature: float = 0.8
    top_p: float = 0.95

    def recipe(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}


@dataclass
class CaptionRequest:
    image: Image.Image
    prompt: Prompt
    n: int
    seed: int


@dataclass(frozen=True)
class Generated:
    text: str
    finish_reason: str
    num_tokens: int


class CaptionEngine(Protocol):
    name: str
    version: str
    chat_template: str
    engine_args: dict[str, Any]

    def generate(self, requests: list[CaptionRequest], sampling: SamplingConfig) -> list[list[Generated]]: ...

    def close(self) -> None: ...


def user_turn(prompt: Prompt) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt.text}]}]


def load_processor(model: str, trust_remote_code: bool) -> Any:
    """The model's processor (image processor + tokenizer + chat template)."""
    from transformers import AutoProcessor

    from pipeline.core.errors import UserError

    try:
        processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: cannot load its processor ({str(exc).splitlines()[0]})") from None
    if not getattr(processor, "chat_template", None):
        raise UserError(f"--model {model}: the processor has no chat template; a vision-language chat model is needed")
    return processor


def chat_prompt(processor: Any, prompt: Prompt) -> str:
    return processor.apply_chat_template(user_turn(prompt), add_generation_prompt=True, tokenize=False)
