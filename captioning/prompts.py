"""Prompt templates and how N captions per image are spread over them.

K prompts × n samples = N captions: with N = 8 and the 4 default prompts, each
prompt is sampled twice; when K does not divide N, the first N mod K prompts get
one sample more (and with N < K the last prompts get none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import UserError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


DEFAULT_PROMPTS = (
    Prompt("dense", "Describe this image in detail."),
    Prompt(
        "spatial",
        "Describe the layout of this image: what is where (left, right, top, bottom, centre) and how the objects are "
        "arranged relative to each other.",
    ),
    Prompt("objects", "List the objects in this image with their colours, shapes, sizes, materials and textures."),
    Prompt("setting", "Describe the background and setting of this image."),
)


def samples_per_prompt(n_captions: int, n_prompts: int) -> list[int]:
    """How many samples each prompt gets so that they add up to `n_captions`."""
    if n_captions < 1:
        raise UserError(f"--captions-per-image must be at least 1 (got {n_captions})")
    base, extra = divmod(n_captions, n_prompts)
    return [base + (i < extra) for i in range(n_prompts)]


def load_prompts(path: Path | None) -> list[Prompt]:
    """The default prompts, or those of a file: a .json/.yaml list of strings or {"id", "text"}, or text lines."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file")
    raw = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        import yaml

        try:
            items = json.loads(raw) if path.suffix.lower() == ".json" else yaml.safe_load(raw)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise UserError(f"--prompts {path}: cannot parse ({str(exc).splitlines()[0]})") from None
        if not isinstance(items, list):
            raise UserError(f"--prompts {path}: expected a list of prompts")
    else:
        items = [line.strip() for line in raw.splitlines() if line.strip()]
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"id": f"p{i}", "text": item}
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
            raise UserError(f"--prompts {path}: entry {i} needs a non-empty 'text'")
        prompts.append(Prompt(str(item.get("id", f"p{i}")), item["text"].strip()))
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts")
    if len({p.id for p in prompts}) != len(prompts):
        raise UserError(f"--prompts {path}: prompt ids must be unique")
    return prompts
