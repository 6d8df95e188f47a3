"""`key=value` command-line pairs (`--vllm-arg`, `--set`), values read as YAML."""

from __future__ import annotations

from typing import Any

import yaml

from pipeline.core.errors import UserError


def parse_key_values(pairs: list[str], flag: str, example: str) -> dict[str, Any]:
    """Values are YAML scalars, flow lists or flow mappings (2, 0.9, true, [0.99, 1.0], {image: 1})."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{flag} {pair!r}: expected key=value, e.g. {example}")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UserError(f"{flag} {pair!r}: cannot read the value as YAML") from None
    return out
