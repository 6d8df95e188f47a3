"""A random, tiny Qwen2-VL checkpoint for offline tests of the captioning path.

The real captioner is a Qwen2-VL-class model served by vLLM. Tests and CPU
development need something with the same architecture, processor and chat
template that loads in seconds without a model hub: this module writes one
from scratch. Everything is made locally and deterministically from ``seed``:

* a byte-level BPE tokenizer trained on a small built-in corpus of scene
  descriptions, with Qwen2-VL's special tokens appended after the learned
  vocabulary (as in the real tokenizer, where they follow the BPE ids);
* a hand-written Qwen2-VL chat template;
* a Qwen2-VL image processor whose pixel budget gives 4-16 image tokens;
* a ~0.4M-parameter model with random bfloat16 weights (vLLM on CPU
  downcasts float32 checkpoints to bfloat16 anyway). Head dims are 32 in
  both towers because vLLM's CPU attention only supports sizes 32, 64, ...

Two builds with the same seed are byte-identical, so their digests can pin
test fixtures.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

# Qwen2-VL's special tokens, in the real tokenizer's order. Their ids are
# assigned right after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# 256 byte symbols + 121 merges + the special tokens; the corpus supports ~137 merges.
VOCAB_SIZE = 384
MAX_MODEL_LEN = 1024

PATCH_SIZE = 14
MERGE_SIZE = 2
# Pixel budget per image; one token per merged 28x28 patch: 56x56 -> 4, 112x112 -> 16.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange", "cyan", "white")
_SHAPES = ("circle", "square", "triangle", "diamond", "cross")
_SIZES = ("small", "large")
_PLACES = ("top left", "top right", "bottom left", "bottom right", "centre")


def corpus() -> list[str]:
    """Short scene descriptions and chat words: the BPE merges come from these."""
    lines = [
        f"A {size} {colour} {shape} in the {place}."
        for size, colour, shape, place in itertools.product(_SIZES, _COLOURS, _SHAPES, _PLACES)
    ]
    shape_pairs = itertools.cycle(itertools.permutations(_SHAPES, 2))
    lines += [
        f"There is a {colour} {shape} next to a {other} {shape2}."
        for (colour, other), (shape, shape2) in zip(itertools.permutations(_COLOURS, 2), shape_pairs)
    ]
    lines += [f"Describe the image. The {place} cell is empty." for place in _PLACES]
    lines += ["system", "user", "assistant", "You are a helpful assistant."]
    return lines


def _train_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE trained with Qwen2's own pre-tokenizer, as a Qwen2Tokenizer.

    Special ids follow the learned vocabulary; like Qwen2-VL-Instruct, EOS is
    ``<|im_end|>`` (end of an assistant turn) and padding is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    # An empty Qwen2Tokenizer supplies the exact normalizer, pre-tokenizer and decoder.
    reference = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = reference.normalizer
    bpe.pre_tokenizer = reference.pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    vocab = bpe.get_vocab()
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=MAX_MODEL_LEN,
    )


def build_tiny_vlm(out: Path, seed: int = 0) -> None:
    """Write the tiny Qwen2-VL model directory to ``out`` (weights depend only on ``seed``)."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _train_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    vision = {
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 32
            "num_key_value_heads": 1,
            "max_position_embeddings": MAX_MODEL_LEN,
            # M-RoPE splits head_dim / 2 = 16 rotary frequencies over (t, h, w).
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "num_heads": 2,  # head_dim 32
            "mlp_ratio": 4,
            "hidden_size": 64,  # the merger projects straight into the text width
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # Seed a forked RNG so building a fixture leaves the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
