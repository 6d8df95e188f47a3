"""Canonical JSON and content hashes: the identities caches and stores are keyed by.

A *recipe* is a JSON object holding everything that changes an artefact (the
captions a VLM writes, the vectors T5 produces). Its hash is the sha256 of its
canonical JSON: sorted keys, no whitespace, UTF-8, no NaN. Two teams that
produce the same recipe get the same hash, so their caches merge.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HASH_CHUNK = 1 << 20


def canonical_json(obj: Any) -> bytes:
    """Serialise `obj` so that equal objects give equal bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def recipe_hash(recipe: dict[str, Any]) -> str:
    """Hex sha256 of the recipe's canonical JSON."""
    return hashlib.sha256(canonical_json(recipe)).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_tree(root: str | Path, names: Iterable[str]) -> str:
    """One hash over several files of a directory (name and content of each, sorted by name)."""
    digest = hashlib.sha256()
    root = Path(root)
    for name in sorted(names):
        digest.update(name.encode("utf-8") + b"\0" + sha256_file(root / name).encode("ascii") + b"\n")
    return digest.hexdigest()


def text_key(text: str) -> bytes:
    """The 32-byte key of a caption in the embedding store: sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).digest()
