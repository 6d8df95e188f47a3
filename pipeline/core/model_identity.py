"""What identifies a model checkpoint in a recipe: its weights and tokenizer files, or its hub revision.

A local directory is identified by the sha256 of its weight files and of its
tokenizer/processor files (a renamed copy of the same weights gives the same
recipe); a hub id by the id and the commit it resolved to. Weight hashes are
remembered per machine by (path, size, mtime, inode), so a 16 GB checkpoint is
read once, not at the start of each of 64 array tasks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError
from pipeline.core.recipes import sha256_tree

WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def load_config(model: str, option: str) -> Any:
    """The model's transformers config, or a one-line UserError naming `option`."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise UserError(f"{option} {model}: cannot load a model config ({str(exc).splitlines()[0]})") from None


def model_identity(model: str, config: Any, option: str) -> dict[str, Any]:
    local = Path(model)
    if local.is_dir():
        weights = [p.name for p in local.iterdir() if p.suffix in WEIGHT_SUFFIXES]
        if not weights:
            raise UserError(f"{option} {model}: no weight files (*.safetensors, *.bin) in the directory")
        return {
            "model": local.name,
            "weights_sha256": sha256_tree(local, weights, remember=True),
            "tokenizer_sha256": sha256_tree(local, [n for n in TOKENIZER_FILES if (local / n).exists()]),
        }
    return {"model": model, "revision": getattr(config, "_commit_hash", None)}
