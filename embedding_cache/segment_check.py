"""One embedding store segment checked against its store and the sha256s recorded when it was written.

`tcjepa store verify` (`embedding_cache.verify`) checks every segment of a store this way, and a mirror
(`embedding_cache.remote_store`) checks each segment it fetches before renaming it in; both import this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedding_cache.reader import shard_index
from embedding_cache.store import KEY_BYTES, EmbeddingStore
from embedding_cache.transform import array_sha256
from pipeline.core.errors import DataProblem, UserError

READ_ROWS = 1 << 18


@dataclass
class StoreVerifyReport:
    """What `tcjepa store verify` found: `verify_segment` adds each segment it checks to it."""

    segments: int = 0
    captions: int = 0
    tokens: int = 0
    bytes_hashed: int = 0
    deep_compared: int = 0
    deep_min_cosine: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        deep = ""
        if self.deep_compared:
            deep = f"; deep: {self.deep_compared} captions re-encoded, lowest token cosine {self.deep_min_cosine:.4f}"
        notes = "".join(f"; note: {n}" for n in self.notes)
        return (
            f"ok: {self.segments} segments, {self.captions} captions, {self.tokens} tokens, "
            f"{self.bytes_hashed / 2**20:.1f} MiB hashed in {self.seconds:.1f} s{deep}{notes}"
        )


def check_shard_indexes(array_dir: Path, shards: tuple[int, ...], chunks: tuple[int, ...]) -> None:
    """Every shard file of the array at `array_dir` against its index's crc32c (`embedding_cache.reader.shard_index`):
    a damaged index is named in one line before any of its chunks is read."""
    per_shard = int(np.prod([s // c for s, c in zip(shards, chunks)]))
    for shard in sorted(p for p in (array_dir / "c").rglob("*") if p.is_file()):
        shard_index(shard, np.memmap(shard, dtype=np.uint8, mode="r"), per_shard)


def verify_segment(
    store: EmbeddingStore,
    segment: str,
    path: Path | None = None,
    report: StoreVerifyReport | None = None,
    bar: Any = None,
) -> np.ndarray:
    """Check one segment (at `path`, by default its place in the store); returns its keys, raises DataProblem."""
    import zarr

    path = store.segment_path(segment) if path is None else path

    def problem(what: str) -> DataProblem:
        return DataProblem(f"{path}: {what}")

    if not (path / "zarr.json").is_file():
        raise problem("listed in the store's zarr.json but missing on disk")
    try:
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        attrs = dict(group.attrs)
        tokens = zarr.open_array(str(path / "tokens"), mode="r")
        offsets = zarr.open_array(str(path / "offsets"), mode="r")[:]
        keys = zarr.open_array(str(path / "keys"), mode="r")[:]
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise problem(f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    if attrs.get("encoder_hash") != store.encoder_hash:
        raise problem(
            f"written for encoder {str(attrs.get('encoder_hash'))[:12]}, the store's is {store.encoder_hash[:12]}"
        )
    n, n_tokens = int(attrs.get("captions", -1)), int(attrs.get("tokens", -1))
    if offsets.dtype != np.int64 or offsets.shape != (n + 1,):
        raise problem(f"offsets are {offsets.dtype}{list(offsets.shape)}, expected int64[{n + 1}] for {n} captions")
    if offsets[0] != 0 or (np.diff(offsets) < 1).any() or offsets[-1] != n_tokens:
        bad = (
            "do not start at 0"
            if offsets[0] != 0
            else (
                "do not end at the token count"
                if offsets[-1] != n_tokens
                else f"do not grow at caption {int(np.flatnonzero(np.diff(offsets) < 1)[0])}"
            )
        )
        raise problem(f"offsets {bad}")
    if keys.dtype != np.uint8 or keys.shape != (n, KEY_BYTES):
        raise problem(f"keys are {keys.dtype}{list(keys.shape)}, expected uint8[{n}, {KEY_BYTES}]")
    token_dtype = store.transform.token_dtype
    if tokens.dtype != token_dtype or tokens.shape != (n_tokens, store.width):
        raise problem(
            f"tokens are {tokens.dtype}{list(tokens.shape)}, expected {token_dtype}[{n_tokens}, {store.width}] "
            f"(the store's codec is {store.codec})"
        )
    scales = None
    if store.codec == "int8":
        try:
            scales = zarr.open_array(str(path / "scales"), mode="r")
        except (FileNotFoundError, KeyError, ValueError):
            raise problem("has no scales, which an int8 store's segment needs") from None
        if scales.dtype != np.float32 or scales.shape != (n_tokens,):
            raise problem(f"scales are {scales.dtype}{list(scales.shape)}, expected float32[{n_tokens}]")
    expected_channels = store.transform.channel_scales
    if expected_channels is not None:
        try:
            channels = zarr.open_array(str(path / "channel_scales"), mode="r")[:]
        except (FileNotFoundError, KeyError, ValueError):
            raise problem("has no channel_scales, which this store's int8 codec needs") from None
        if channels.dtype != np.float32 or not np.array_equal(channels, expected_channels):
            raise problem("channel_scales differ from the store root's")
    for name, array in (("tokens", tokens), *((("scales", scales),) if scales is not None else ())):
        try:
            check_shard_indexes(path / name, array.shards, array.chunks)
        except UserError as exc:
            raise problem(str(exc).removeprefix(f"{path}/")) from None
    recorded = attrs.get("sha256")
    if not isinstance(recorded, dict):
        raise problem("records no checksums (written by an older tcjepa); re-embed into a new store to verify it")
    digests = {"tokens": hashlib.sha256(), "scales": hashlib.sha256()}
    for start in range(0, n_tokens, READ_ROWS):
        block = tokens[start : start + READ_ROWS]
        values = block if scales is None else scales[start : start + READ_ROWS]
        finite = np.isfinite(values) if values.ndim == 1 else np.isfinite(values).all(axis=1)
        if not finite.all():
            row = start + int(np.flatnonzero(~finite)[0])
            caption = int(np.searchsorted(offsets, row, side="right")) - 1
            raise problem(
                f"non-finite value in token row {row} (caption {caption}, key {keys[caption].tobytes().hex()[:16]})"
            )
        digests["tokens"].update(np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<")).data)
        if scales is not None:
            digests["scales"].update(np.ascontiguousarray(values, dtype="<f4").data)
        if bar is not None:
            bar.update(len(block))
    actual = {"tokens": digests["tokens"].hexdigest(), "offsets": array_sha256(offsets), "keys": array_sha256(keys)}
    if scales is not None:
        actual["scales"] = digests["scales"].hexdigest()
    if expected_channels is not None:
        actual["channel_scales"] = array_sha256(expected_channels)
    for name, digest in actual.items():
        if recorded.get(name) != digest:
            raise problem(
                f"{name} do not match the sha256 recorded when the segment was written (changed or corrupted on disk)"
            )
    if report is not None:
        report.segments += 1
        report.captions += n
        report.tokens += n_tokens
        report.bytes_hashed += n_tokens * store.bytes_per_token + offsets.nbytes + keys.nbytes
    return keys
