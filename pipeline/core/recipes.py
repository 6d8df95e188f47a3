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


def sha256_tree(root: str | Path, names: Iterable[str], remember: bool = False) -> str:
    """One hash over several files of a directory (name and content of each, sorted by name).

    With `remember`, each file's hash is kept by (path, size, mtime, inode) in the user's tcjepa cache, for large
    files replaced but never edited in place (model weights: 16 GB for a 7B VLM, hashed at every job start else).
    """
    digest = hashlib.sha256()
    root = Path(root)
    for name in sorted(names):
        file_hash = remembered_sha256(root / name) if remember else sha256_file(root / name)
        digest.update(name.encode("utf-8") + b"\0" + file_hash.encode("ascii") + b"\n")
    return digest.hexdigest()


def remembered_sha256(path: Path) -> str:
    """`sha256_file(path)`, read once per (real path, size, mtime, inode) and remembered under the tcjepa cache.

    Each entry is its own small file, written atomically, so concurrent jobs on one machine share it safely.
    """
    from pipeline.core.fsutil import atomic_write_bytes, user_cache_dir

    real = Path(path).resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()
    entry = user_cache_dir() / "file-sha256" / key
    try:
        known = entry.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = sha256_file(real)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(entry, digest.encode("ascii"))
    except OSError:  # a read-only home: the hash is still right, only not remembered
        pass
    return digest


def text_key(text: str) -> bytes:
    """The 32-byte key of a caption in the embedding store: sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).digest()
