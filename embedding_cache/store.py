"""The embedding store: a Zarr v3 group of immutable segments of T5 token embeddings.

Layout (readable by plain ``zarr``)::

    zarr.json                      root group; attributes["tcjepa"] = {format, version,
                                   encoder (recipe), encoder_hash, d_model (the stored width), segments: [ids]}
    projection/, channel_scales    fitted arrays of the store's transform, when its recipe has them
                                   (see `embedding_cache.transform`)
    segments/<id>/tokens           float16 or int8 [segment_tokens, width], flat, uncompressed, sharded
    segments/<id>/scales           int8 only: float32 [segment_tokens], chunked as `tokens`
    segments/<id>/channel_scales   int8 with pre-scaling only: float32 [width], the root's, so a
                                   segment alone gives vector = tokens * scales[:, None] * channel_scales
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
The root's `version` says how to read it: 1 (float16 only) and 2 (codecs and
projections) are read; a newer one is refused rather than misread.
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

from embedding_cache.codec import bytes_per_token
from embedding_cache.plain_arrays import read_plain_array
from embedding_cache.transform import (
    ROOT_ARRAYS,
    StoreTransform,
    array_sha256,
    codec_of,
    is_fitted,
    requested,
    root_arrays,
)
from pipeline.core.digests import DigestIndex
from pipeline.core.errors import UserError
from pipeline.core.fsutil import fsync_dir, pid_alive
from pipeline.core.recipes import recipe_hash

FORMAT = "tcjepa-embedding-store"
VERSION = 2
READABLE_VERSIONS = (1, 2)
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
    def for_bytes(
        cls, width: int, chunk_bytes: int = 16 << 20, shard_bytes: int = 1 << 30, itemsize: int = 2
    ) -> TokenLayout:
        """Power-of-two row counts closest below the byte targets (16 MiB chunks, 1 GiB shards) for rows of `width`
        values of `itemsize` bytes."""
        row = itemsize * width
        chunk = 1 << max(int(np.log2(max(chunk_bytes // row, 1))), 0)
        shards = max(shard_bytes // (chunk * row), 1)
        return cls(chunk, 1 << int(np.log2(shards)))

    def fitted(self, rows: int) -> TokenLayout:
        """The layout for a segment known to hold `rows` tokens in all, when no shard is written yet: at most this
        layout's chunk and shard sizes, with (almost) no padding, so a small segment takes little more than its
        payload on disk (zarr writes every inner chunk whole)."""
        if rows >= self.shard_tokens:
            return self
        chunks = max(-(-rows // self.chunk_tokens), 1)
        chunk = max(-(-rows // chunks), 1)
        return TokenLayout(chunk, chunks)


def _creator_leftovers_only(path: Path) -> bool:
    """True when `path` holds nothing but what creating a store leaves: the lock, staging, an empty `segments` group,
    fitted root arrays."""
    for entry in path.iterdir():
        if entry.name in (".lock", STAGING, *ROOT_ARRAYS):
            continue
        if entry.name == "segments" and entry.is_dir() and all(p.name == "zarr.json" for p in entry.iterdir()):
            continue
        return False
    return True


def write_empty_root(
    directory: Path, encoder: dict[str, Any], width: int, transform: StoreTransform | None = None
) -> None:
    """A store root with no segments in `directory`: its `zarr.json`, the empty `segments` group, and the fitted
    arrays of `transform` (which a recipe that names them needs)."""
    import zarr

    if root_arrays(encoder) and transform is None:
        raise ValueError("this encoder recipe records fitted arrays: pass the transform that holds them")
    root = zarr.open_group(str(directory), mode="w", zarr_format=3)
    root.create_group("segments")
    if transform is not None:
        transform.write(directory)
    root.attrs["tcjepa"] = {
        "format": FORMAT,
        "version": VERSION,
        "encoder": encoder,
        "encoder_hash": recipe_hash(encoder),
        "d_model": width,
        "segments": [],
    }


def payload_bytes(codec: str, width: int, tokens: int, captions: int) -> int:
    """Bytes a store's arrays take for `tokens` token vectors of `captions` captions (what a dry run projects;
    on disk a few KiB of metadata per segment come on top)."""
    return tokens * bytes_per_token(codec, width) + captions * (8 + KEY_BYTES)


def _attrs(group: Any) -> dict[str, Any]:
    return dict(group.attrs.get("tcjepa", {}))


def check_version(root: Path, version: Any) -> None:
    """Refuse a store this tcjepa cannot read: newer (it would misread it) or not a version at all."""
    if isinstance(version, int) and version > max(READABLE_VERSIONS):
        raise UserError(
            f"{root}: embedding store format version {version} is newer than this tcjepa reads (up to "
            f"{max(READABLE_VERSIONS)}); upgrade tcjepa"
        )
    if version not in READABLE_VERSIONS:
        raise UserError(
            f"{root}: embedding store format version {version!r} is not supported (this tcjepa reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )


@dataclass(frozen=True)
class StoreInfo:
    """What a store holds (`tcjepa store info`): its encoder recipe, codec, projection and counts."""

    encoder_hash: str
    encoder: dict[str, Any]
    version: int
    d_model: int  # the stored width (the projection's dim, if any)
    codec: str
    projection: dict[str, Any] | None  # dim, source_width, explained_variance
    bytes_per_token: int
    segments: int
    captions: int
    tokens: int
    bytes_on_disk: int

    def summary(self) -> str:
        projection = self.projection
        pca = (
            f" (PCA {projection['source_width']} -> {projection['dim']}, "
            f"{100 * projection['explained_variance']:.1f}% of the variance)"
            if projection
            else ""
        )
        return (
            f"{self.segments} segments, {self.captions} captions, {self.tokens} tokens; {self.codec}, width "
            f"{self.d_model}{pca}, {self.bytes_per_token} bytes per token; {self.bytes_on_disk / 2**20:.2f} MiB on "
            f"disk; encoder {self.encoder_hash[:12]} ({self.encoder.get('model', self.encoder.get('kind'))}, max "
            f"length {self.encoder.get('max_length')})"
        )


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
        check_version(self.root, meta.get("version"))
        self.version: int = meta["version"]
        self.encoder: dict[str, Any] = meta["encoder"]
        self.encoder_hash: str = meta["encoder_hash"]
        self.width: int = int(meta["d_model"])  # of the stored vectors (the projection's K, if any)
        self.codec = codec_of(self.encoder)
        if self.version == 1 and (self.codec != "float16" or is_fitted(self.encoder)):
            raise UserError(f"{self.root}: a version 1 store must hold float16 vectors without projection")
        self._transform: StoreTransform | None = None
        self._published_index = DigestIndex()
        self._indexed: set[str] = set()

    @property
    def source_width(self) -> int:
        """The width of the encoder's vectors, which `SegmentWriter.append` takes."""
        projection = self.encoder.get("projection")
        return int(projection["source_width"]) if projection else self.width

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.codec, self.width)

    @property
    def transform(self) -> StoreTransform:
        """The store's projection and codec, its fitted arrays read once and checked against the recipe."""
        if self._transform is None:
            self._transform = StoreTransform.load(self.root, self.encoder)
        return self._transform

    @classmethod
    def open_or_create(
        cls, root: str | Path, encoder_recipe: dict[str, Any], width: int, *, transform: StoreTransform | None = None
    ) -> EmbeddingStore:
        """Open the store at `root`, refusing one made with another encoder recipe, or create it.

        `encoder_recipe` is a JSON-able dict that says what made the vectors (for T5: model, revision, tokenizer,
        max length, EOS policy, dtype, storage codec, projection); its hash is what decides whether two sets of
        vectors may share a store. `width` is the stored vectors' dimension; `transform` holds the fitted arrays
        the recipe records (a projection, int8's channel scales), written into a new root. An existing store
        keeps its own.
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
                    for name in ("segments", *ROOT_ARRAYS):  # left by a creator killed between its renames
                        if (path / name).exists():
                            shutil.rmtree(path / name)
                    staging = path / STAGING / f"root-{uuid.uuid4().hex}"
                    write_empty_root(staging, encoder, width, transform)
                    for name in ("segments", *ROOT_ARRAYS):
                        if (staging / name).exists():
                            os.rename(staging / name, path / name)
                    os.rename(staging / "zarr.json", path / "zarr.json")
                    shutil.rmtree(staging)
                    fsync_dir(path)
        store = cls(path)
        # Another creator's fit may have won the race: its arrays are the store's, and its vectors comparable.
        store.check_encoder(requested(encoder) if transform is not None else encoder)
        return store

    def check_encoder(self, encoder: dict[str, Any]) -> None:
        """Refuse to mix vectors of two encoder recipes in one store.

        `encoder` is a store's full recipe (compared whole), or a request (what `tcjepa embed` was asked for: the
        fitted entries come from the store, so only the choices are compared). A codec or projection that differs
        is named first, as the user chose it.
        """
        have, want = self.encoder, encoder
        if not is_fitted(encoder):
            have, want = requested(self.encoder), requested(encoder)
        if codec_of(have) != codec_of(want):
            raise UserError(
                f"--store-dtype {codec_of(want)}: --store {self.root} holds {codec_of(have)} vectors (a store keeps "
                f"one codec); use --store-dtype {codec_of(have)} or a new --store"
            )
        dims = [(r.get("projection") or {}).get("dim") for r in (have, want)]
        if dims[0] != dims[1]:
            held = f"a --project-dim {dims[0]} projection" if dims[0] else "unprojected vectors"
            asked = f"--project-dim {dims[1]}" if dims[1] else "no --project-dim"
            raise UserError(
                f"{asked}: --store {self.root} holds {held} (fitted when it was made); use "
                f"{f'--project-dim {dims[0]}' if dims[0] else 'no --project-dim'} or a new --store"
            )
        wanted = recipe_hash(want)
        if recipe_hash(have) != wanted:
            diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
            raise UserError(
                f"--store {self.root} holds embeddings from another encoder recipe ({recipe_hash(have)[:12]} vs "
                f"{wanted[:12]}; "
                f"differs in: {', '.join(diff)}); use a new --store for this encoder"
            )

    def segment_ids(self) -> list[str]:
        import zarr

        return list(_attrs(zarr.open_group(str(self.root), mode="r", zarr_format=3))["segments"])

    def segment_path(self, segment: str) -> Path:
        return self.root / "segments" / segment

    def read_keys(self, segment: str) -> np.ndarray:
        """The segment's caption keys, uint8 `[n, 32]` (read without zarr: see `plain_arrays`)."""
        return read_plain_array(self.segment_path(segment) / "keys")

    def read_offsets(self, segment: str) -> np.ndarray:
        """The segment's token offsets, int64 `[n + 1]` (read without zarr: see `plain_arrays`)."""
        return read_plain_array(self.segment_path(segment) / "offsets")

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

    def info(self) -> StoreInfo:
        """The encoder recipe, codec, projection, bytes per token, counts and bytes on disk of the store."""
        projection, stats = self.encoder.get("projection"), self.stats()
        return StoreInfo(
            encoder_hash=self.encoder_hash,
            encoder=self.encoder,
            version=self.version,
            d_model=self.width,
            codec=self.codec,
            projection=None
            if projection is None
            else {k: projection[k] for k in ("dim", "source_width", "explained_variance")},
            bytes_per_token=self.bytes_per_token,
            segments=stats["segments"],
            captions=stats["captions"],
            tokens=stats["tokens"],
            bytes_on_disk=sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()),
        )

    def _lock(self) -> FileLock:
        return FileLock(str(self.root / ".lock"), timeout=LOCK_TIMEOUT_S)

    def default_layout(self) -> TokenLayout:
        """~16 MiB chunks in ~1 GiB shard files of this store's tokens."""
        return TokenLayout.for_bytes(self.width, itemsize=self.transform.token_dtype.itemsize)

    def new_segment(self, layout: TokenLayout | None = None) -> SegmentWriter:
        """A writer for one new segment (staged; part of the store once `publish`ed). `layout` defaults to
        `default_layout()`; a segment smaller than one shard gets chunks fitted to it."""
        self._clean_staging()
        return SegmentWriter(self, layout or self.default_layout())

    def _clean_staging(self) -> None:
        """Remove staging segments left by dead writers on this host."""
        try:
            entries = list((self.root / STAGING).iterdir())
        except FileNotFoundError:  # none, or another writer on this host just removed it empty (drop_empty_staging)
            return
        host = socket.gethostname()
        for entry in entries:
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
    """Writes one segment in the store's staging area, whole shards at a time.

    `append` takes the encoder's vectors and stores them through the store's transform (projection, codec). The
    `tokens` (and `scales`) arrays are created at the first write: a segment that ends before its first shard is
    full gets a layout fitted to its size.
    """

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
        self._transform = self.store.transform
        self._int8 = self._transform.codec == "int8"
        self._arrays: dict[str, Any] = {}
        self._pending: list[tuple[np.ndarray, np.ndarray | None]] = []
        self._pending_rows = 0
        self._written_rows = 0
        self._lengths: list[int] = []
        self._keys: list[bytes] = []
        self._sha256 = {"tokens": hashlib.sha256(), "scales": hashlib.sha256()}
        self._finished = False

    def append(self, key: bytes, vectors: np.ndarray) -> None:
        """Add one caption's `[length, source width]` float vectors (the encoder's), stored as the store keeps them."""
        if (
            len(key) != KEY_BYTES
            or vectors.ndim != 2
            or vectors.shape[1] != self.store.source_width
            or vectors.dtype.kind != "f"
        ):
            raise ValueError(f"bad caption entry: key of {len(key)} bytes, vectors {vectors.shape} {vectors.dtype}")
        self.append_stored(key, *self._transform.encode(vectors))

    def append_stored(self, key: bytes, tokens: np.ndarray, scales: np.ndarray | None) -> None:
        """Add one caption as already encoded for this store (tokens, and scales for int8)."""
        self._keys.append(key)
        self._lengths.append(len(tokens))
        self._pending.append((tokens, scales))
        self._pending_rows += len(tokens)
        self.captions += 1
        self.tokens += len(tokens)
        if self._pending_rows >= self.layout.shard_tokens:
            self._flush(final=False)

    def _create_arrays(self, final_rows: int | None) -> None:
        """`tokens` (and `scales`), chunked by the layout, or by one fitted to `final_rows` when that is all."""
        layout = self.layout if final_rows is None else self.layout.fitted(final_rows)
        self.layout = layout
        d = self.store.width
        common: dict[str, Any] = {"compressors": None, "fill_value": 0, "config": {"write_empty_chunks": True}}
        self._arrays["tokens"] = self._group.create_array(
            "tokens",
            shape=(0, d),
            chunks=(layout.chunk_tokens, d),
            shards=(layout.shard_tokens, d),
            dtype=self._transform.token_dtype,
            **common,
        )
        if self._int8:
            self._arrays["scales"] = self._group.create_array(
                "scales",
                shape=(0,),
                chunks=(layout.chunk_tokens,),
                shards=(layout.shard_tokens,),
                dtype="float32",
                **common,
            )

    def _flush(self, final: bool) -> None:
        """Write every whole shard pending (and, at the end, the partial last one)."""
        if not self._arrays:
            self._create_arrays(self._pending_rows if final else None)
        if not self._pending:
            return
        parts = {"tokens": np.concatenate([t for t, _ in self._pending])}
        if self._int8:
            parts["scales"] = np.concatenate([s for _, s in self._pending if s is not None]).astype(np.float32)
        rows = len(parts["tokens"])
        n_write = rows if final else (rows // self.layout.shard_tokens) * self.layout.shard_tokens
        if n_write == 0:
            return
        start = self._written_rows
        for name, buf in parts.items():
            array = self._arrays[name]
            array.resize((start + n_write, *array.shape[1:]))
            array[start : start + n_write] = buf[:n_write]
            self._sha256[name].update(np.ascontiguousarray(buf[:n_write], dtype=buf.dtype.newbyteorder("<")).data)
        self._written_rows += n_write
        rest_tokens = parts["tokens"][n_write:]
        rest_scales = parts["scales"][n_write:] if self._int8 else None
        self._pending = [(rest_tokens, rest_scales)] if len(rest_tokens) else []
        self._pending_rows = len(rest_tokens)

    def keys_array(self) -> np.ndarray:
        return np.frombuffer(b"".join(self._keys), dtype=np.uint8).reshape(-1, KEY_BYTES)

    def finish(self, **attrs: Any) -> None:
        """Write the last shard, offsets, keys (and channel scales) and the segment's attributes; fsync everything."""
        self._flush(final=True)
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        n = len(self._lengths)
        chunk_rows = max(min(n, 1 << 20), 1)
        keys = self.keys_array()
        self._group.create_array("offsets", data=offsets, chunks=(chunk_rows + 1,), compressors=None)
        self._group.create_array("keys", data=keys, chunks=(chunk_rows, KEY_BYTES), compressors=None)
        checksums = {
            "tokens": self._sha256["tokens"].hexdigest(),
            "offsets": array_sha256(offsets),
            "keys": array_sha256(keys),
        }
        if self._int8:
            checksums["scales"] = self._sha256["scales"].hexdigest()
        channel_scales = self._transform.channel_scales
        if channel_scales is not None:
            self._group.create_array(
                "channel_scales", data=channel_scales, chunks=channel_scales.shape, compressors=None
            )
            checksums["channel_scales"] = array_sha256(channel_scales)
        self.attrs.update(attrs)
        self._group.attrs.update(
            {
                "captions": n,
                "tokens": int(offsets[-1]),
                "encoder_hash": self.store.encoder_hash,
                "codec": self._transform.codec,
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
        scales = zarr.open_array(str(self.staging / "scales"), mode="r") if self._int8 else None
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        out = SegmentWriter(self.store, self.layout)
        for i in np.flatnonzero(~drop):
            lo, hi = offsets[i], offsets[i + 1]
            out.append_stored(self._keys[i], src[lo:hi], None if scales is None else scales[lo:hi])
        out.finish(**self.attrs)
        return out

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.store.drop_empty_staging()
