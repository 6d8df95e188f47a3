"""The embedding store: a Zarr v3 group of immutable segments of T5 token embeddings.

Layout (readable by plain ``zarr``)::

    zarr.json                      root group; attributes["tcjepa"] = {format, version,
                                   encoder (recipe), encoder_hash, d_model (the width), segments: [ids]}
    segments/<id>/tokens           float16 [segment_tokens, width], flat, uncompressed, sharded
    segments/<id>/offsets          int64 [n + 1]: caption i is tokens[offsets[i]:offsets[i+1]]
    segments/<id>/keys             uint8 [n, 32]: sha256 of the caption's UTF-8 text
                                   (segment attributes: captions, tokens, encoder_hash, and
                                   sha256 of each array's row-major bytes, for `store verify`)
    .staging/<id>/                 a segment being written (not part of the store)
    .lock                          held while the segment list changes

A writer fills a staging segment, then, under the lock, drops captions that
another writer published meanwhile, renames the directory into ``segments/`` and
adds its id to the root's segment list (zarr writes ``zarr.json`` atomically).
Only listed segments exist for readers; a key lives in exactly one segment.
On object storage `embedding_cache.remote_store` publishes segments through a log
of conditional puts instead of the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from pipeline.core.digests import DigestIndex
from pipeline.core.errors import UserError
from pipeline.core.fsutil import fsync_dir, pid_alive
from pipeline.core.recipes import recipe_hash

FORMAT = "tcjepa-embedding-store"
VERSION = 1
KEY_BYTES = 32
LOCK_TIMEOUT_S = 600.0
STAGING = ".staging"


@dataclass(frozen=True)
class TokenLayout:
    """How `tokens` is chunked: inner chunks of `chunk_tokens` rows, `shard_chunks` per shard file."""

    chunk_tokens: int = 1 << 14
    shard_chunks: int = 64

    @property
    def shard_tokens(self) -> int:
        return self.chunk_tokens * self.shard_chunks

    @classmethod
    def for_bytes(cls, width: int, chunk_bytes: int = 16 << 20, shard_bytes: int = 1 << 30) -> TokenLayout:
        """Power-of-two row counts closest below the byte targets (16 MiB chunks, 1 GiB shards)."""
        row = 2 * width
        chunk = 1 << max(int(np.log2(max(chunk_bytes // row, 1))), 0)
        shards = max(shard_bytes // (chunk * row), 1)
        return cls(chunk, 1 << int(np.log2(shards)))


def array_sha256(array: np.ndarray) -> str:
    """sha256 of an array's row-major little-endian bytes: a checksum independent of zarr's file layout."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))).hexdigest()


def _creator_leftovers_only(path: Path) -> bool:
    """True when `path` holds nothing but what creating a store leaves: the lock, staging, an empty `segments` group."""
    for entry in path.iterdir():
        if entry.name in (".lock", STAGING):
            continue
        if entry.name == "segments" and entry.is_dir() and all(p.name == "zarr.json" for p in entry.iterdir()):
            continue
        return False
    return True


def write_empty_root(directory: Path, encoder: dict[str, Any], width: int) -> None:
    """A store root with no segments in `directory`: its `zarr.json` and the empty `segments` group."""
    import zarr

    root = zarr.open_group(str(directory), mode="w", zarr_format=3)
    root.create_group("segments")
    root.attrs["tcjepa"] = {
        "format": FORMAT,
        "version": VERSION,
        "encoder": encoder,
        "encoder_hash": recipe_hash(encoder),
        "d_model": width,
        "segments": [],
    }


def _attrs(group: Any) -> dict[str, Any]:
    return dict(group.attrs.get("tcjepa", {}))


class EmbeddingStore:
    """A store on the local file system, opened for reading or appending."""

    def __init__(self, root: str | Path) -> None:
        import zarr

        self.root = Path(root)
        if not (self.root / "zarr.json").is_file():
            raise UserError(
                f"{self.root} is not an embedding store (no zarr.json); `tcjepa embed --store {self.root}` creates one"
            )
        meta = _attrs(zarr.open_group(str(self.root), mode="r", zarr_format=3))
        if meta.get("format") != FORMAT:
            raise UserError(f"{self.root} is a zarr group but not a tcjepa embedding store")
        if meta.get("version") != VERSION:
            raise UserError(
                f"{self.root}: embedding store version {meta.get('version')} is not supported (this tcjepa reads "
                f"{VERSION})"
            )
        self.encoder: dict[str, Any] = meta["encoder"]
        self.encoder_hash: str = meta["encoder_hash"]
        self.width: int = int(meta["d_model"])
        self._published_index = DigestIndex()
        self._indexed: set[str] = set()

    @classmethod
    def open_or_create(cls, root: str | Path, encoder_recipe: dict[str, Any], width: int) -> EmbeddingStore:
        """Open the store at `root`, refusing one made with another encoder recipe, or create it.

        `encoder_recipe` is a JSON-able dict that says what made the vectors (for T5: model, revision, tokenizer,
        max length, EOS policy, dtype); its hash is what decides whether two sets of vectors may share a store.
        `width` is the vectors' dimension.
        """
        path = Path(root)
        encoder = encoder_recipe
        if not (path / "zarr.json").exists():
            # Another process may be creating the same store: only what a creator makes is tolerated here.
            if path.exists() and (not path.is_dir() or not _creator_leftovers_only(path)):
                raise UserError(f"--store {path} exists and is not an embedding store; choose a new or empty directory")
            path.mkdir(parents=True, exist_ok=True)
            with FileLock(str(path / ".lock"), timeout=LOCK_TIMEOUT_S):
                if not (path / "zarr.json").exists():
                    if (path / "segments").exists():  # a creator killed between its two renames
                        shutil.rmtree(path / "segments")
                    staging = path / STAGING / f"root-{uuid.uuid4().hex}"
                    write_empty_root(staging, encoder, width)
                    os.rename(staging / "segments", path / "segments")
                    os.rename(staging / "zarr.json", path / "zarr.json")
                    shutil.rmtree(staging)
                    fsync_dir(path)
        store = cls(path)
        store.check_encoder(encoder)
        return store

    def check_encoder(self, encoder: dict[str, Any]) -> None:
        """Refuse to mix vectors of two encoder recipes in one store."""
        wanted = recipe_hash(encoder)
        if self.encoder_hash != wanted:
            diff = sorted(k for k in set(encoder) | set(self.encoder) if encoder.get(k) != self.encoder.get(k))
            raise UserError(
                f"--store {self.root} holds embeddings from another encoder recipe ({self.encoder_hash[:12]} vs "
                f"{wanted[:12]}; "
                f"differs in: {', '.join(diff)}); use a new --store for this encoder"
            )

    def segment_ids(self) -> list[str]:
        import zarr

        return list(_attrs(zarr.open_group(str(self.root), mode="r", zarr_format=3))["segments"])

    def segment_path(self, segment: str) -> Path:
        return self.root / "segments" / segment

    def read_keys(self, segment: str) -> np.ndarray:
        import zarr

        return zarr.open_array(str(self.segment_path(segment) / "keys"), mode="r")[:]

    def read_offsets(self, segment: str) -> np.ndarray:
        import zarr

        return zarr.open_array(str(self.segment_path(segment) / "offsets"), mode="r")[:]

    def published(self) -> DigestIndex:
        """Index of every published key (payload: nothing meaningful); refreshed incrementally."""
        for segment in self.segment_ids():
            if segment not in self._indexed:
                self._published_index.add(self.read_keys(segment))
                self._indexed.add(segment)
        return self._published_index

    def stats(self) -> dict[str, int]:
        import zarr

        captions = tokens = 0
        for segment in self.segment_ids():
            attrs = zarr.open_group(str(self.segment_path(segment)), mode="r", zarr_format=3).attrs
            captions += int(attrs["captions"])
            tokens += int(attrs["tokens"])
        return {"segments": len(self.segment_ids()), "captions": captions, "tokens": tokens}

    def _lock(self) -> FileLock:
        return FileLock(str(self.root / ".lock"), timeout=LOCK_TIMEOUT_S)

    def new_segment(self, layout: TokenLayout | None = None) -> SegmentWriter:
        """A writer for one new segment (staged; part of the store once `publish`ed). `layout` defaults to ~16 MiB
        chunks in ~1 GiB shard files."""
        self._clean_staging()
        return SegmentWriter(self, layout or TokenLayout.for_bytes(self.width))

    def _clean_staging(self) -> None:
        """Remove staging segments left by dead writers on this host."""
        staging = self.root / STAGING
        if not staging.is_dir():
            return
        host = socket.gethostname()
        for entry in staging.iterdir():
            parts = entry.name.split("-")
            if len(parts) >= 4 and parts[-3] == host and parts[-2].isdigit() and not pid_alive(int(parts[-2])):
                shutil.rmtree(entry, ignore_errors=True)

    def drop_empty_staging(self) -> None:
        """Remove `.staging` once no writer uses it; another writer staging (or one that just removed it) is not an
        error."""
        with contextlib.suppress(OSError):
            (self.root / STAGING).rmdir()

    def publish(self, writer: SegmentWriter) -> PublishResult:
        """Make a finished staging segment part of the store; duplicates of published keys are dropped."""
        import zarr

        with self._lock():
            root = zarr.open_group(str(self.root), mode="r+", zarr_format=3)
            meta = _attrs(root)
            listed = list(meta["segments"])
            for orphan in (self.root / "segments").iterdir():
                if orphan.is_dir() and orphan.name not in listed:
                    shutil.rmtree(orphan)
            duplicate = self.published().contains(writer.keys_array())
            source = writer
            if duplicate.any():
                source = writer.without(duplicate)
            if source.captions == 0:
                source.discard()
                if source is not writer:
                    writer.discard()
                return PublishResult(None, 0, 0, int(duplicate.sum()))
            final = self.segment_path(source.segment_id)
            os.rename(source.staging, final)
            fsync_dir(final.parent)
            meta["segments"] = [*listed, source.segment_id]
            root.attrs["tcjepa"] = meta
            self._published_index.add(source.keys_array())
            self._indexed.add(source.segment_id)
            if source is not writer:
                writer.discard()
        self.drop_empty_staging()
        return PublishResult(source.segment_id, source.captions, source.tokens, int(duplicate.sum()))


@dataclass
class PublishResult:
    segment: str | None
    captions: int
    tokens: int
    duplicates_dropped: int


@dataclass
class SegmentWriter:
    """Writes one segment in the store's staging area, whole shards at a time."""

    store: EmbeddingStore
    layout: TokenLayout
    segment_id: str = field(init=False)
    staging: Path = field(init=False)
    captions: int = 0
    tokens: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import zarr

        self.segment_id = f"{time.time_ns():020d}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.staging = self.store.root / STAGING / self.segment_id
        self._group = zarr.open_group(str(self.staging), mode="w", zarr_format=3)
        d = self.store.width
        self._tokens = self._group.create_array(
            "tokens",
            shape=(0, d),
            chunks=(self.layout.chunk_tokens, d),
            shards=(self.layout.shard_tokens, d),
            dtype="float16",
            compressors=None,
            fill_value=0,
            config={"write_empty_chunks": True},
        )
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._written_rows = 0
        self._lengths: list[int] = []
        self._keys: list[bytes] = []
        self._tokens_sha256 = hashlib.sha256()
        self._finished = False

    def append(self, key: bytes, tokens: np.ndarray) -> None:
        """Add one caption's `[length, width]` float16 embeddings."""
        if (
            len(key) != KEY_BYTES
            or tokens.ndim != 2
            or tokens.shape[1] != self.store.width
            or tokens.dtype != np.float16
        ):
            raise ValueError(f"bad caption entry: key of {len(key)} bytes, tokens {tokens.shape} {tokens.dtype}")
        self._keys.append(key)
        self._lengths.append(len(tokens))
        self._pending.append(tokens)
        self._pending_rows += len(tokens)
        self.captions += 1
        self.tokens += len(tokens)
        if self._pending_rows >= self.layout.shard_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        """Write every whole shard pending (and, at the end, the partial last one)."""
        if not self._pending:
            return
        buf = np.concatenate(self._pending)
        n_write = len(buf) if final else (len(buf) // self.layout.shard_tokens) * self.layout.shard_tokens
        if n_write == 0:
            return
        start = self._written_rows
        self._tokens.resize((start + n_write, self.store.width))
        self._tokens[start : start + n_write] = buf[:n_write]
        self._tokens_sha256.update(np.ascontiguousarray(buf[:n_write], dtype="<f2"))
        self._written_rows += n_write
        rest = buf[n_write:]
        self._pending = [rest] if len(rest) else []
        self._pending_rows = len(rest)

    def keys_array(self) -> np.ndarray:
        return np.frombuffer(b"".join(self._keys), dtype=np.uint8).reshape(-1, KEY_BYTES)

    def finish(self, **attrs: Any) -> None:
        """Write the last shard, offsets, keys and the segment's attributes; fsync everything."""
        self._flush(final=True)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        n = len(self._lengths)
        chunk_rows = max(min(n, 1 << 20), 1)
        keys = self.keys_array()
        self._group.create_array("offsets", data=offsets, chunks=(chunk_rows + 1,), compressors=None)
        self._group.create_array("keys", data=keys, chunks=(chunk_rows, KEY_BYTES), compressors=None)
        self.attrs.update(attrs)
        checksums = {
            "tokens": self._tokens_sha256.hexdigest(),
            "offsets": array_sha256(offsets),
            "keys": array_sha256(keys),
        }
        self._group.attrs.update(
            {
                "captions": n,
                "tokens": int(offsets[-1]),
                "encoder_hash": self.store.encoder_hash,
                "sha256": checksums,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **self.attrs,
            }
        )
        for dirpath, _, files in os.walk(self.staging):
            for name in files:
                with open(os.path.join(dirpath, name), "rb") as f:
                    os.fsync(f.fileno())
        self._finished = True

    def without(self, drop: np.ndarray) -> SegmentWriter:
        """A new finished staging segment holding this one's captions except those in `drop`."""
        import zarr

        src = zarr.open_array(str(self.staging / "tokens"), mode="r")
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        out = SegmentWriter(self.store, self.layout)
        for i in np.flatnonzero(~drop):
            out.append(self._keys[i], src[offsets[i] : offsets[i + 1]])
        out.finish(**self.attrs)
        return out

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.store.drop_empty_staging()
