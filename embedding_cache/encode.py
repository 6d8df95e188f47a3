"""T5 encoding: the encoder recipe, tokenisation with truncation, token-budget batching.

Captions are sorted by token length and cut into batches whose padded size
(batch × longest) stays under a token budget, so almost no compute goes to
padding, unlike a loop that pads every batch to the maximum length. T5
overflows in float16, so it computes in bfloat16 (or float32); results are
checked for finiteness and stored as float16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from embedding_cache.codec import CODECS
from embedding_cache.transform import codec_of
from pipeline.core.devices import resolve_device
from pipeline.core.errors import UserError
from pipeline.core.model_identity import load_config, model_identity

COMPUTE_DTYPES = ("bfloat16", "float32")
FLOAT16_MAX = 65504.0


def encoder_recipe(
    model: str,
    max_length: int,
    eos: bool,
    compute_dtype: str,
    storage_dtype: str = "float16",
    project_dim: int | None = None,
) -> tuple[dict[str, Any], int]:
    """Everything chosen that changes the stored vectors, and the model width; reads files, loads no weights.

    This is a *request*: a store made from it adds what it fitted (a projection's arrays, int8's channel scaling;
    see `embedding_cache.transform`).
    """
    if storage_dtype not in CODECS:
        raise UserError(f"--store-dtype {storage_dtype}: choose one of {', '.join(CODECS)}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise UserError(
            f"--dtype {compute_dtype}: T5 must run in one of {', '.join(COMPUTE_DTYPES)} (it overflows in float16)"
        )
    if max_length < 2:
        raise UserError(f"--max-length must be at least 2 (got {max_length})")
    config = load_config(model, "--model")
    if config.model_type not in ("t5", "mt5", "umt5"):
        raise UserError(f"--model {model} is a {config.model_type!r} model; `tcjepa embed` needs a T5 encoder")
    width = int(config.d_model)
    if project_dim is not None and not 1 <= project_dim < width:
        raise UserError(f"--project-dim {project_dim}: must be between 1 and the model's width {width} (exclusive)")
    recipe = {
        "kind": "t5-encoder",
        **model_identity(model, config, "--model"),
        "max_length": max_length,
        "eos": eos,
        "compute_dtype": compute_dtype,
        "storage_dtype": storage_dtype,
    }
    if project_dim is not None:
        recipe["projection"] = {"method": "pca", "dim": project_dim}
    return recipe, width


def recipe_like(model: str, stored: dict[str, Any]) -> dict[str, Any]:
    """The request `encoder_recipe` makes for `model` with a store's settings; `transform.requested(stored)` equals it
    exactly when `model` is the encoder that made the store."""
    projection = stored.get("projection") or {}
    recipe, _ = encoder_recipe(
        model,
        int(stored["max_length"]),
        bool(stored["eos"]),
        str(stored["compute_dtype"]),
        codec_of(stored),
        projection.get("dim"),
    )
    return recipe


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None


def tokenize(tokenizer: Any, texts: list[str], max_length: int, eos: bool) -> tuple[list[list[int]], int]:
    """Token ids per text, cut to `max_length` (EOS kept last when `eos`), and how many were cut."""
    # verbose=False: the tokenizer's warning about texts longer than its model_max_length is not for us; they are
    # cut here, and counted.
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    limit = max_length - 1 if eos else max_length
    truncated = sum(len(x) > limit for x in ids)
    eos_id = [tokenizer.eos_token_id] if eos else []
    return [list(x[:limit]) + eos_id for x in ids], truncated


def plan_batches(lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Indices grouped into batches, sorted by length, with batch size × longest ≤ token_budget."""
    if token_budget < int(lengths.max(initial=1)):
        raise UserError(
            f"--token-budget {token_budget} is smaller than the longest caption ({int(lengths.max())} tokens); raise "
            "it or lower --max-length"
        )
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * lengths[order[stop]] <= token_budget:
            stop += 1
        batches.append(order[start:stop])
        start = stop
    return batches


@dataclass
class T5Encoder:
    """A loaded T5 encoder that turns token id lists into float16 arrays."""

    model: Any
    device: Any
    dtype: Any

    @classmethod
    def load(cls, model: str, device: str, compute_dtype: str) -> T5Encoder:
        import torch
        from transformers import T5EncoderModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the embed job shows its own progress
        dev = resolve_device(device)
        dtype = getattr(torch, compute_dtype)
        net = T5EncoderModel.from_pretrained(model, dtype=dtype).to(dev).eval()
        return cls(net, dev, dtype)

    def encode(self, batch: list[list[int]]) -> list[np.ndarray]:
        """Encode one batch; each caption's `[length, d]` float16 array, or ValueError(index) when not finite."""
        import torch

        longest = max(len(x) for x in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        with torch.inference_mode():
            hidden = self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).last_hidden_state.float()
        valid = mask.to(self.device).bool()
        bad = (~torch.isfinite(hidden) | (hidden.abs() > FLOAT16_MAX)).any(-1) & valid
        if bad.any():
            raise NonFiniteEmbedding(int(bad.any(-1).nonzero()[0, 0]))
        out = hidden.half().cpu().numpy()
        return [out[i, : len(x)] for i, x in enumerate(batch)]


class NonFiniteEmbedding(ValueError):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index
