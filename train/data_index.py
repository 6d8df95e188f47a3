"""The training set, joined once at start-up: which images, their sha256, their caption keys.

Images come from `list_images` (random access, no bytes read). Each image's
sha256 comes from the caption cache's source id → image_sha256 record when the
cache has one, because hashing millions of images costs a full pass over the
data; a random sample of those records is checked against the bytes, since
another folder may reuse the same relative names (members of tar shards on object
storage are read for this by byte range; training reads only each node's local
copies, `train.loop.images_for_training`). Captions are joined by
sha256 and kept as embedding-store *keys* (text_sha256), and resolved once, here, to
where their tokens lie: (segment, first token row, length) columns (`Spans`), so no
rank or DataLoader worker ever builds a key index. Published segments never change, so
the spans stay true while the store keeps the segments the index names; a store that
dropped one (rebuilt, compacted) is refused in one line, and the index is rebuilt.

The index is saved beside the run as one Parquet file (one row per image, the
captions' columns as lists, the scalars in the schema metadata), so a resumed run
trains on the same join.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from captioning.cache import CaptionCache
from embedding_cache.reader import Spans, StoreKeys
from embedding_cache.store import EmbeddingStore
from pipeline.core.arrow_pool import bulk_memory_pool
from pipeline.core.digests import SHA256_BYTES, arrow_to_bytes, bytes_to_arrow, hex_to_bytes
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.fsutil import atomic_writer
from pipeline.core.refs import Columnar, ImageRef, ImageRefs
from pipeline.core.remote import is_remote
from pipeline.core.sources import ImageReader, list_images, read_images

logger = logging.getLogger(__name__)

FORMAT = "tcjepa-train-index"
VERSION = 2
KEY_BYTES = SHA256_BYTES  # a caption's key: the sha256 of its text
DIGEST_BYTES = SHA256_BYTES  # an image's sha256
UNREADABLE = "unreadable"

_SCHEMA = pa.schema(
    [
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("path", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("column", pa.dictionary(pa.int32(), pa.string()), nullable=False),
        pa.field("sha256", pa.binary(DIGEST_BYTES), nullable=False),
        pa.field("captions", pa.large_list(pa.binary(KEY_BYTES)), nullable=False),
        pa.field("caption_segment", pa.large_list(pa.int32()), nullable=False),
        pa.field("caption_start", pa.large_list(pa.int64()), nullable=False),
        pa.field("caption_length", pa.large_list(pa.int32()), nullable=False),
    ]
)


class HexDigests(Columnar[str]):
    """sha256 digests as one uint8 `[n, 32]` array, each given as hex when asked for."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    @classmethod
    def of(cls, digests: Sequence[str]) -> HexDigests:
        if isinstance(digests, HexDigests):
            return digests
        flat = np.frombuffer(bytes.fromhex("".join(digests)), dtype=np.uint8)
        return cls(flat.reshape(-1, DIGEST_BYTES).copy())

    def __len__(self) -> int:
        return len(self.values)

    def _item(self, row: int) -> str:
        return self.values[row].tobytes().hex()


@dataclass
class TrainIndex:
    # usable images, in source order, and the hex sha256 of each one's bytes: given as lists or columns, kept as
    # columns (`ImageRefs`, `HexDigests`)
    refs: Sequence[ImageRef]
    sha256: Sequence[str]
    caption_offsets: np.ndarray  # int64 [n+1], CSR into caption_keys and the spans
    # uint8 [m, 32]: each image's caption keys, ordered (recipe, prompt_id, sample), no repeated text; None in an index
    # loaded without them (`load`: training reads the spans, and at 10^8 captions the keys are 3.5 GB a rank)
    caption_keys: np.ndarray | None
    recipes: list[str]  # recipe hashes, in the order the captions are
    coverage: dict[int, int]  # number of captions -> number of images
    left_out: dict[str, int] = field(default_factory=dict)  # reason -> listed images not in `refs`
    missing_embeddings: int = 0  # distinct captions of these images that the store lacks (dropped)
    # The store segments the captions lie in (store order), and each caption's span there, its segment a position in
    # `segments` (-1 for every caption of an index built without a store).
    segments: list[str] = field(default_factory=list)
    spans: Spans | None = None

    def __post_init__(self) -> None:
        self.refs = ImageRefs.of(self.refs)
        self.sha256 = HexDigests.of(self.sha256)
        if self.spans is None:
            m = int(self.caption_offsets[-1])
            self.spans = Spans(np.full(m, -1, np.int32), np.zeros(m, np.int64), np.zeros(m, np.int32))

    def __len__(self) -> int:
        return len(self.refs)

    def keys(self) -> np.ndarray:
        """The caption keys (`caption_keys`), refused in an index loaded without them."""
        if self.caption_keys is None:
            raise ValueError("this index was loaded without its caption keys: TrainIndex.load(path, keys=True)")
        return self.caption_keys

    def captions_of(self, i: int) -> np.ndarray:
        """Store keys (`[k, 32]` uint8) of image i's captions."""
        return self.keys()[self.caption_offsets[i] : self.caption_offsets[i + 1]]

    def covered_fraction(self) -> float:
        """Fraction of images with at least one caption."""
        return 1.0 - self.coverage.get(0, 0) / len(self.refs) if self.refs else 0.0

    def coverage_line(self) -> str:
        """One line for the log, e.g. ``400 images: 0 captions 3, 1–7 0, 8 397; 99.2% with at least one``."""
        top = max(self.coverage, default=0)
        parts = [f"0 captions {self.coverage.get(0, 0)}"]
        if top >= 2:
            middle = sum(v for k, v in self.coverage.items() if 0 < k < top)
            parts.append(f"{'1' if top == 2 else f'1–{top - 1}'} {middle}")
        if top >= 1:
            parts.append(f"{top} {self.coverage[top]}")
        line = f"{len(self.refs)} images: {', '.join(parts)}; {100 * self.covered_fraction():.1f}% with at least one"
        if self.left_out:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.left_out.items()))
            line += f"; {sum(self.left_out.values())} images left out ({reasons})"
        if self.missing_embeddings:
            line += (
                f"; {self.missing_embeddings} captions not in the embedding store were dropped "
                "(run `tcjepa embed` on this cache and store to add them)"
            )
        return line

    @property
    def caption_spans(self) -> Spans:
        assert self.spans is not None  # set by __post_init__
        return self.spans

    @classmethod
    def stale_segments(cls, path: Path, segment_ids: list[str]) -> list[str]:
        """The segments the index saved at `path` reads that a store listing `segment_ids` no longer holds (empty:
        still valid), from the file's footer alone: rank 0 checks a resumed run's index without loading it."""
        held = set(segment_ids)
        return [s for s in cls.read_meta(path)["segments"] if s not in held]

    def save(self, path: Path) -> None:
        """Write the index as one Parquet file, atomically."""
        offsets = pa.array(self.caption_offsets, pa.int64())
        spans = self.caption_spans
        keys = bytes_to_arrow(self.keys())
        refs = ImageRefs.of(self.refs).table
        columns = {
            **{name: refs.column(name) for name in ImageRefs.NAMES},
            "sha256": bytes_to_arrow(HexDigests.of(self.sha256).values),
            "captions": pa.LargeListArray.from_arrays(offsets, keys),
            "caption_segment": pa.LargeListArray.from_arrays(offsets, pa.array(spans.segment, pa.int32())),
            "caption_start": pa.LargeListArray.from_arrays(offsets, pa.array(spans.start, pa.int64())),
            "caption_length": pa.LargeListArray.from_arrays(offsets, pa.array(spans.length, pa.int32())),
        }
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "recipes": self.recipes,
            "coverage": {str(k): v for k, v in self.coverage.items()},
            "left_out": self.left_out,
            "missing_embeddings": self.missing_embeddings,
            "segments": self.segments,
        }
        table = pa.Table.from_pydict(columns, schema=_SCHEMA).replace_schema_metadata({"tcjepa": json.dumps(meta)})
        with atomic_writer(Path(path)) as f:  # straight to the file: at 10^8 captions the file is GBs
            pq.write_table(table, f, compression="zstd")

    @staticmethod
    def read_meta(path: Path) -> dict:
        """The saved index's scalars (recipes, coverage, the segments it reads ...) from the file's footer, refused in
        one line when it is not an index of this version (or not Parquet at all)."""
        try:
            meta = json.loads((pq.read_schema(path).metadata or {}).get(b"tcjepa", b"{}"))
        except (pa.ArrowInvalid, json.JSONDecodeError):
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise UserError(f"{path} is not a tcjepa train index v{VERSION}; delete it to rebuild the index")
        return meta

    @classmethod
    @bulk_memory_pool()  # every rank loads it at start-up: at 10⁷ captions ~1 s against 2.5-4.3 on mimalloc
    def load(cls, path: Path, keys: bool = False) -> TrainIndex:
        """The saved index, a column at a time, each caption column's chunks copied once into one numpy array: never
        the whole table, nor those chunks combined by Arrow first (every rank loads it; at 10⁷ captions the peak was
        2.3 GB). The caption keys only with `keys`: training reads the spans."""
        meta = cls.read_meta(path)

        def chunks(name: str) -> list[pa.Array]:
            return pq.read_table(path, columns=[name]).column(name).chunks

        def end_to_end(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            return np.concatenate([empty, *parts])  # a new array, owning its memory (no Arrow buffer held)

        def values(name: str, dtype: type, read: list[pa.Array] | None = None) -> np.ndarray:
            """A list column's values, row after row (its chunks `read` already, or read now)."""
            parts: list[np.ndarray] = [
                np.asarray(c.flatten().to_numpy(zero_copy_only=False), dtype=dtype) for c in (read or chunks(name))
            ]
            return end_to_end(parts, np.zeros(0, dtype))

        segment_chunks = chunks("caption_segment")  # its offsets are every caption column's
        counts = end_to_end([np.diff(c.offsets.to_numpy()) for c in segment_chunks], np.zeros(0, np.int64))
        segment = values("caption_segment", np.int32, segment_chunks)
        del segment_chunks
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        caption_keys = None
        if keys:
            keys_by_chunk = [c.flatten() for c in chunks("captions")]  # each chunk's keys freed as they are copied
            caption_keys = _laid_end_to_end(keys_by_chunk, KEY_BYTES)
        sha256 = _laid_end_to_end(chunks("sha256"), DIGEST_BYTES)
        return cls(
            ImageRefs(pq.read_table(path, columns=list(ImageRefs.NAMES))),
            HexDigests(sha256),
            offsets,
            caption_keys,
            meta["recipes"],
            {int(k): v for k, v in meta["coverage"].items()},
            meta["left_out"],
            meta["missing_embeddings"],
            meta["segments"],
            Spans(
                segment,
                values("caption_start", np.int64),
                values("caption_length", np.int32),
            ),
        )


def _hash_refs(refs: Sequence[ImageRef], progress: bool, what: str) -> list[str | None]:
    """sha256 of each image's bytes, None for one that cannot be read (tar members on object storage read by byte
    range)."""
    from tqdm import tqdm

    return [
        None if data is None else hashlib.sha256(data).hexdigest()
        for data in tqdm(
            read_images(refs),
            total=len(refs),
            desc=what,
            unit="image",
            disable=not progress or not refs,
            dynamic_ncols=True,
        )
    ]


def verify_images(index: TrainIndex, progress: bool = True, threads: int = 8) -> None:
    """Hash every image of `index` and stop, in one line, at the first whose bytes differ from the sha256 recorded
    when the index was built (`tcjepa train --verify-images`). Training itself hashes nothing: this pass is how a
    changed source is caught, rather than on every read. An unreadable image passes here; the loader replaces it.

    Tar shards on object storage are left to the fetch of each node's shards, which checks every member it uses."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    reader = ImageReader()
    refs = [ref for ref in index.refs if not is_remote(ref.path)]
    recorded = [sha for ref, sha in zip(index.refs, index.sha256) if not is_remote(ref.path)]

    def sha(ref: ImageRef) -> str | None:
        try:
            return hashlib.sha256(reader.read(ref)).hexdigest()
        except OSError:
            return None

    with ThreadPoolExecutor(threads) as pool:
        hashes = pool.map(sha, refs)
        bar = tqdm(hashes, total=len(refs), desc="verifying images", unit="image", disable=not progress or not refs)
        for ref, indexed, actual in zip(refs, recorded, bar):
            if actual is not None and actual != indexed:
                raise DataProblem(
                    f"image {ref.source_id} changed since the run's index was built (sha256 {actual[:12]}, indexed "
                    f"{indexed[:12]}); restore it, or delete the run's index.parquet to rebuild the index"
                )


def _hex_bytes(column: pa.Array | pa.ChunkedArray, width: int, what: str) -> np.ndarray:
    """uint8 `[n, width]` from a column of hex strings, chunk by chunk into one array (no copy of the column into
    one array first: at 10⁷ captions that copy of 640 MB cost more than the decoding)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if missing := sum(chunk.null_count for chunk in chunks):
        raise DataProblem(f"{missing} {what} values are missing; run `tcjepa cache verify`")
    out = np.empty((sum(len(chunk) for chunk in chunks), width), dtype=np.uint8)
    row = 0
    for chunk in chunks:
        try:
            out[row : row + len(chunk)] = hex_to_bytes(chunk, width)
        except ValueError:
            raise DataProblem(
                f"a {what} value is not a {2 * width}-digit hex digest; run `tcjepa cache verify`"
            ) from None
        row += len(chunk)
    return out


def _laid_end_to_end(chunks: list[pa.FixedSizeBinaryArray], width: int) -> np.ndarray:
    """uint8 `[n, width]`: the chunks' (fixed-width binary) values in order, each chunk released as soon as it is
    copied (`chunks` is emptied), so that a column is never held twice (at 10⁷ caption keys, 320 MB less at the
    peak)."""
    out = np.empty((sum(len(chunk) for chunk in chunks), width), dtype=np.uint8)
    row = 0
    chunks.reverse()
    while chunks:
        values = arrow_to_bytes(chunks.pop())
        out[row : row + len(values)] = values
        row += len(values)
    return out


@dataclass
class _CacheRows:
    """The cache's captions (every recipe) and its failure records that name an image, read once, their repeated
    strings (source_id, image_sha256, recipe, prompt_id) read dictionary-encoded, their keys (text_sha256) as 32
    bytes decoded shard by shard, and image_sha256 coded once for both uses: the source id → sha256 record and the
    captions' grouping by image. At 10⁷ captions the strings as rows would be 2.5 GB on rank 0 (now ~0.5), and each
    pass over them a pass over every row (at ImageNet-21k scale, 10⁸)."""

    captions: pa.Table  # source_id, recipe, prompt_id, sample
    keys: np.ndarray  # uint8 [n, 32]: each caption's text_sha256
    bad: np.ndarray | None  # bool [n]: the rows whose text_sha256 is not a hex sha256 (None: no such row)
    failures: pa.Table
    shas: pa.Array  # the distinct image sha256s (hex)
    sha: np.ndarray  # int32: each row's position in `shas`, the captions' rows then the failures'

    REPEATED = ["source_id", "image_sha256", "recipe", "prompt_id"]

    @classmethod
    def read(cls, cache: CaptionCache) -> _CacheRows:
        captions = cache.read_captions(
            columns=["source_id", "image_sha256", "recipe", "prompt_id", "sample", "text_sha256"],
            dictionary=cls.REPEATED,
            digests=["text_sha256"],
        )
        chunks = captions.column("text_sha256").chunks
        captions = captions.drop_columns(["text_sha256"])
        bad = None
        if any(chunk.null_count for chunk in chunks):
            bad = np.concatenate([chunk.is_null().to_numpy(zero_copy_only=False) for chunk in chunks])
        keys = _laid_end_to_end(chunks, KEY_BYTES)
        failures = cache.read_failures().filter(pc.is_valid(pc.field("image_sha256")))
        shas, sha = cls.encoded(captions, failures, "image_sha256")
        # image_sha256 is the codes from here on: its shards' dictionaries freed (at 10⁷ captions, ~200 MB)
        return cls(captions.drop_columns(["image_sha256"]), keys, bad, failures, shas, sha)

    @staticmethod
    def encoded(captions: pa.Table, failures: pa.Table, name: str) -> tuple[pa.Array, np.ndarray]:
        """Column `name` of the captions then the failures as codes into one dictionary: (distinct values; int32 code
        of each row). Each chunk's own dictionary (a shard's distinct values, as read) is unified with the others',
        so a value is hashed once a shard, not once a row, and no string is copied into one array."""
        chunks = captions.column(name).chunks + failures.column(name).chunks
        if not chunks:
            return pa.array([], pa.string()), np.zeros(0, dtype=np.int32)
        coded = pa.dictionary(pa.int32(), pa.string())
        unified = pa.chunked_array(
            [
                chunk.cast(coded) if pa.types.is_dictionary(chunk.type) else chunk.dictionary_encode()
                for chunk in chunks
            ],
            coded,
        ).unify_dictionaries()
        return unified.chunks[0].dictionary, np.concatenate([chunk.indices.to_numpy() for chunk in unified.chunks])


@dataclass
class _RecordedSha256:
    """The sha256 (hex) the cache recorded for each source id (any recipe, captions or failures), none where it
    recorded more than one. Ids and sha256s as dictionary codes; an id is ambiguous when one of its rows differs from
    the sha256 one of them left in a table indexed by id: no sort, no group-by over strings."""

    ids: pa.Array  # the distinct source ids
    sha: np.ndarray  # int64: each id's one sha256, a position in `shas`; -1: several
    shas: pa.Array

    @classmethod
    def of(cls, rows: _CacheRows) -> _RecordedSha256:
        ids, sid = _CacheRows.encoded(rows.captions, rows.failures, "source_id")
        sha = np.full(len(ids), -1, dtype=np.int64)
        sha[sid] = rows.sha  # one of each id's rows wins
        sha[sid[rows.sha != sha[sid]]] = -1
        return cls(ids, sha, rows.shas)

    def of_listed(self, source_ids: pa.Array) -> pa.Array:
        """Per listed image, its id's sha256, null where there is none, it is ambiguous, or more than one listed
        image has that id."""
        if not len(self.ids):  # an empty cache
            return pa.nulls(len(source_ids), pa.string())
        at = pc.index_in(source_ids, value_set=self.ids).fill_null(-1).to_numpy()
        code = np.where(at >= 0, self.sha[np.maximum(at, 0)], -1)
        listed = source_ids.dictionary_encode().indices.to_numpy()
        code[np.bincount(listed)[listed] > 1] = -1
        return self.shas.take(pa.array(np.maximum(code, 0), mask=code < 0)).cast(pa.string())


def _image_sha256(refs: Sequence[ImageRef], recorded: pa.Array, verify_sample: int, progress: bool) -> pa.Array:
    """Each image's sha256 (hex; null: unreadable): the cache's record, checked on a random sample, else hashed from
    the bytes."""
    known = recorded.is_valid().to_numpy(zero_copy_only=False)
    sample = sorted(random.sample(np.flatnonzero(known).tolist(), min(verify_sample, int(known.sum()))))
    actual = _hash_refs([refs[i] for i in sample], progress, "verifying image hashes")
    expected = recorded.take(pa.array(sample, pa.int64())).to_pylist()
    differ = sum(a is not None and a != e for a, e in zip(actual, expected))
    if differ:
        logger.warning(
            f"warning: {differ} of {len(sample)} sampled images differ from what the caption cache recorded for their "
            "source id "
            f"(another folder with the same file names?); hashing every image"
        )
        return pa.array(_hash_refs(refs, progress, "hashing images"), pa.string())
    unknown = np.flatnonzero(~known)
    hashed = _hash_refs([refs[i] for i in unknown], progress, "hashing images")
    # an unreadable sampled image is left out like any other
    replaced = dict(zip(unknown.tolist(), hashed)) | dict(zip(sample, actual))
    mask = np.zeros(len(refs), dtype=bool)
    mask[list(replaced)] = True
    values = pa.array([replaced[i] for i in sorted(replaced)], pa.string())
    return pc.replace_with_mask(recorded, pa.array(mask), values)


def _distinct(column: pa.ChunkedArray) -> pa.Array:
    """The column's distinct values, first seen first, as plain values (a dictionary-encoded column's decoded)."""
    values = pc.unique(column)
    return values.dictionary_decode() if pa.types.is_dictionary(values.type) else values


def _codes(column: pa.ChunkedArray, values: pa.Array | None = None) -> tuple[pa.Array, np.ndarray]:
    """Each row's position among `values` (default: the column's distinct values, first seen first), found by
    hashing: sorting millions of strings is what this avoids."""
    values = _distinct(column) if values is None else values
    return values, pc.index_in(column, value_set=values).to_numpy()


def lexsort_unless_sorted(columns: Sequence[np.ndarray]) -> np.ndarray | None:
    """`np.lexsort(columns)` (the last column sorts first), or None when the rows are in that order already: a few
    passes over each column instead of a sort and the gathers it needs (at 10⁷ rows of 4 columns: 0.19 s against
    the sort's 0.69 s alone)."""
    in_order = np.ones(max(len(columns[0]) - 1, 0), dtype=bool)  # row i+1 is not before row i, by the columns so far
    for column in columns:  # the last sorts first: built up from the first
        in_order = (column[1:] > column[:-1]) | ((column[1:] == column[:-1]) & in_order)
    return None if in_order.all() else np.lexsort(columns)


NEIGHBOURS_COMPARED = 64  # images with at most this many caption rows have their rows compared pairwise, not sorted


def first_of_each_pair(image: np.ndarray, head: np.ndarray) -> np.ndarray:
    """Positions, ascending, of the rows that are the first of their (image, key) pair: `image` int codes `[n]`,
    `head` each key's first 16 bytes (uint8 `[n, 16]`).

    When `image` is grouped (non-decreasing, as the index's rows are) and no image has more than
    `NEIGHBOURS_COMPARED` rows, each row is compared with the k rows before it, for k up to the largest group: a
    few vectorised passes instead of a sort of every row (10x faster at 10⁷ captions of 4 per image). Otherwise,
    sorted by image, then key (lexsort is stable: equal pairs keep their order), a row repeats the pair of the row
    before it when both are the same; the key's first 8 bytes sort, unless two keys of an image share them and
    differ after."""
    words = np.ascontiguousarray(head).view(">u8")
    n = len(image)
    change = np.flatnonzero(np.diff(image)) + 1
    if n and (np.diff(image) >= 0).all():
        largest = int(np.diff(np.concatenate([[0], change, [n]])).max())
        if largest <= NEIGHBOURS_COMPARED:
            repeat = np.zeros(n, dtype=bool)
            for k in range(1, largest):
                repeat[k:] |= (image[k:] == image[:-k]) & (words[k:] == words[:-k]).all(axis=1)
            return np.flatnonzero(~repeat)
    pairs = np.lexsort((words[:, 0], image))
    step = (np.diff(image[pairs]) == 0) & (np.diff(words[pairs, 0]) == 0)
    if (np.diff(words[pairs, 1])[step] != 0).any():
        pairs = np.lexsort((words[:, 1], words[:, 0], image))
        step = (np.diff(image[pairs]) == 0) & (np.diff(words[pairs, 0]) == 0)
    same = np.zeros(n, dtype=bool)
    same[1:] = step & (np.diff(words[pairs, 1]) == 0)
    return np.sort(pairs[~same])


@dataclass
class _CaptionRows:
    """The chosen recipes' captions grouped by image and, within an image, ordered by (recipe, prompt_id, sample),
    no text repeated for an image: image `images[i]` has the caption keys `keys[starts[i]:starts[i + 1]]`.
    Ordered by integer codes and key bytes, never by the strings."""

    keys: np.ndarray  # uint8 [m, 32]
    images: pa.Array
    starts: np.ndarray

    @classmethod
    def of(cls, rows: _CacheRows, recipes: list[str]) -> _CaptionRows:
        table, keys, image, bad = rows.captions, rows.keys, rows.sha[: rows.captions.num_rows], rows.bad
        chosen = pc.is_in(table.column("recipe"), value_set=pa.array(recipes, pa.string()))
        if not pc.all(chosen).as_py():
            mask = chosen.to_numpy(zero_copy_only=False)
            table, keys, image = table.filter(chosen), keys[mask], image[mask]
            bad = None if bad is None else bad[mask]
        if bad is not None and bad.any():  # another recipe's bad keys do not stop a run that does not use them
            raise DataProblem("a text_sha256 value is not a 64-digit hex digest; run `tcjepa cache verify`")
        present = np.zeros(len(rows.shas), dtype=bool)
        present[image] = True  # the images the chosen recipes captioned, renumbered in the order of `shas`
        if not present.all():  # else every image is there, as numbered: no copy of 2.5 M sha256s at 10⁷ captions
            images, image = rows.shas.filter(pa.array(present)), (np.cumsum(present, dtype=np.int32) - 1)[image]
        else:
            images = rows.shas
        _, rank = _codes(table.column("recipe"), pa.array(recipes, pa.string()))
        _, prompt = _codes(table.column("prompt_id"), _distinct(table.column("prompt_id")).sort())
        order = lexsort_unless_sorted((table.column("sample").to_numpy(), prompt, rank, image))
        if order is None:  # as caption jobs write them: no sort, no gather
            kept = first_of_each_pair(image, keys[:, :16])
        else:
            kept = order[first_of_each_pair(image[order], keys[order, :16])]
        starts = np.searchsorted(image[kept], np.arange(len(images) + 1)).astype(np.int64)
        in_order = order is None and len(kept) == len(keys)  # in order, no text repeated: no copy
        return cls(keys if in_order else keys[kept], images, starts)

    def keys_of(self, sha256: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(keys, counts): each image's caption keys (`[m, 32]` uint8), concatenated in image order, and how many
        each image has."""
        if not len(self.images):  # the chosen recipes captioned nothing (an empty cache, or failures only)
            return np.zeros((0, KEY_BYTES), dtype=np.uint8), np.zeros(len(sha256), dtype=np.int64)
        block = pc.index_in(sha256, value_set=self.images).fill_null(-1).to_numpy()
        has = block >= 0
        counts = np.where(has, np.diff(self.starts)[np.maximum(block, 0)], 0)
        first = np.where(has, self.starts[np.maximum(block, 0)], 0)
        before = np.cumsum(counts) - counts
        rows = np.repeat(first - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)
        if len(rows) == len(self.keys) and (rows == np.arange(len(rows))).all():
            return self.keys, counts  # every image, in the cache's order: no copy of the keys
        return self.keys[rows], counts


def _rejected(failures: pa.Table, captioned: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(sha256, reason) of images a captioner read but rejected (undecodable, too small, ...) and the chosen recipes
    did not caption: the trainer could not use them either. One reason per image, the first in order, without its
    parenthesised detail."""
    # the captioned images among the failures' (a hash of the failures' few sha256s, not of every image's)
    failed = failures.column("image_sha256").combine_chunks()
    also_captioned = captioned.filter(pc.is_in(captioned, value_set=failed))
    failures = failures.filter(pc.invert(pc.is_in(failures.column("image_sha256"), value_set=also_captioned)))
    failures = failures.sort_by([("image_sha256", "ascending"), ("reason", "ascending")])
    shas, sha = _codes(failures.column("image_sha256"))  # sorted: each sha's rows are one run, its first first
    first = np.searchsorted(sha, np.arange(len(shas)))
    reasons = pc.list_element(pc.split_pattern(failures.column("reason").take(first), " (", max_splits=1), 0)
    return shas, reasons.combine_chunks()


@dataclass
class _CacheSide:
    """What the join needs of the cache, made on the thread that reads it, beside the listing of the images and the
    reading of the store's keys: each source id's recorded sha256, the chosen recipes' captions grouped by image, and
    the images a captioner rejected that those recipes did not caption. The cache's string columns are dropped with
    the thread."""

    recorded: _RecordedSha256
    captions: _CaptionRows
    rejected: tuple[pa.Array, pa.Array]

    @classmethod
    def read(cls, cache: CaptionCache, recipes: list[str]) -> _CacheSide:
        rows = _CacheRows.read(cache)
        captions = _CaptionRows.of(rows, recipes)
        return cls(_RecordedSha256.of(rows), captions, _rejected(rows.failures, captions.images))


@bulk_memory_pool()  # its columns at 10⁷ captions: gigabytes read and dropped
def build_index(
    inputs: Sequence[str | Path],
    cache: Path | None,
    store: Path | None,
    recipes: list[str],
    min_coverage: float = 0.95,
    image_column: str | None = None,
    verify_sample: int = 64,
    progress: bool = True,
    split: str = "train",
) -> TrainIndex:
    """Join the images of `inputs` with their captions in `cache` whose embeddings `store` holds.

    Without a cache (plain I-JEPA) every readable image is used, with no captions. Raises
    UserError when fewer than `min_coverage` of the images have a caption (0 disables the check).
    """
    if cache is None and store is not None:
        raise UserError("--store needs --cache: the captions whose embeddings to look up")
    caption_cache = CaptionCache(cache) if cache is not None else None
    chosen = caption_cache.resolve_recipes(recipes) if caption_cache is not None else []
    opened = EmbeddingStore(store) if store is not None else None  # a store that is not one fails here, at once
    # The store's keys, the listing of the images and the cache's side of the join are made at once (each mostly
    # file reading and Arrow or numpy work that releases the GIL), their errors reported in this order.
    with ThreadPoolExecutor(3, thread_name_prefix="tcjepa-index") as pool:
        store_keys = pool.submit(lambda: StoreKeys(opened) if opened is not None else None)
        listing = pool.submit(list_images, inputs, image_column, split)
        cache_read = pool.submit(lambda: _CacheSide.read(caption_cache, chosen) if caption_cache is not None else None)
        embeddings, refs, cache_side = store_keys.result(), listing.result(), cache_read.result()
    if not refs:
        raise UserError(f"no images found in {', '.join(map(str, inputs))}")
    listed = ImageRefs.of(refs)
    recorded = pa.nulls(len(refs), pa.string())
    captions = rejected = None
    if cache_side is not None:
        recorded = cache_side.recorded.of_listed(listed.table.column("source_id").combine_chunks())
        captions, rejected = cache_side.captions, cache_side.rejected
    sha256 = _image_sha256(refs, recorded, verify_sample, progress)

    # Left out (the reason; null: kept): images that cannot be read, and images a captioner rejected that no chosen
    # recipe captioned.
    reason = pa.nulls(len(refs), pa.string())
    if rejected is not None:
        shas, reasons = rejected
        reason = pc.take(reasons, pc.index_in(sha256, value_set=shas))
    reason = pc.if_else(pc.is_null(sha256), pa.scalar(UNREADABLE), reason)
    kept = np.flatnonzero(pc.is_null(reason).to_numpy(zero_copy_only=False))
    left_out = {row["values"]: row["counts"] for row in pc.value_counts(reason.drop_null()).to_pylist()}
    everything = len(kept) == len(refs)  # nothing left out: the listing and the hashes as they are, not copies
    kept_sha256 = sha256 if everything else sha256.take(pa.array(kept, pa.int64()))

    counts = np.zeros(len(kept), dtype=np.int64)
    caption_keys = np.zeros((0, KEY_BYTES), dtype=np.uint8)
    if captions is not None:
        caption_keys, counts = captions.keys_of(kept_sha256)
    del cache_side, captions  # the cache's side is in caption_keys now: freed before the lookups (at 10⁷, ~0.5 GB)
    missing = 0
    segments: list[str] = []
    spans = None
    rows = np.zeros(0, dtype=np.int64)  # each caption key's row in the store
    if embeddings is not None and len(caption_keys):
        rows = embeddings.locate(caption_keys)
        embeddings.drop_key_index()  # the spans need the segments' extents only: 32 bytes a stored key freed
        absent = rows < 0
        if absent.any():
            missing = len(np.unique(np.ascontiguousarray(caption_keys[absent]).view(f"V{KEY_BYTES}")))
            image = np.repeat(np.arange(len(kept)), counts)
            caption_keys, counts = caption_keys[~absent], np.bincount(image[~absent], minlength=len(kept))
            rows = rows[~absent]
    offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if embeddings is not None:
        segments, spans = embeddings.spans_of_rows(rows)
    sizes, images = np.unique(counts, return_counts=True)
    index = TrainIndex(
        ImageRefs(listed.table if everything else listed.table.take(pa.array(kept, pa.int64()))),
        HexDigests(_hex_bytes(kept_sha256, DIGEST_BYTES, "image sha256")),
        offsets,
        caption_keys,
        chosen,
        dict(zip(sizes.tolist(), images.tolist())),
        dict(sorted(left_out.items())),
        missing,
        segments,
        spans,
    )
    if not index.refs:
        raise UserError(f"no usable images: {index.coverage_line()}")
    if caption_cache is not None and index.covered_fraction() < min_coverage:
        raise UserError(
            f"caption coverage below --min-coverage {min_coverage:g}: {index.coverage_line()}; "
            f"caption the missing images (tcjepa caption) or lower --min-coverage to train anyway"
        )
    return index
