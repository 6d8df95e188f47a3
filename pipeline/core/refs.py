"""Where images are: the file names that hold them, `ImageRef`, one image's place in its source, and `ImageRefs`,
many of them as Arrow columns.

Local sources (`pipeline.core.sources`) and tar shards on object storage (`pipeline.core.remote_tars`) list
images as the same refs, a tar shard's members from its headers alone (`tar_member_refs`); both import this
module, and `sources` reaches the remote shards through `remote_tars`, never the other way round.
"""

from __future__ import annotations

import logging
import tarfile
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TypeVar, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.core.errors import UserError

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
TABLE_SUFFIXES = (".parquet",)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ")  # gzip, bzip2, xz


@dataclass(frozen=True)
class ImageRef:
    """Where one image's bytes are, so that a worker can read it without scanning its source."""

    source_id: str  # exactly the source id iter_images gives the same image
    kind: str  # "file" | "tar" | "table"
    path: str  # absolute path of the file / tar shard / parquet file / HF dataset dir
    offset: int = 0  # tar: byte offset of the member's data; table: row number
    size: int = -1  # tar: member size in bytes
    column: str = ""  # table: image column


def skip_warning(label: str, problem: str) -> None:
    """A source list_images cannot list: iter_images reports it as an error entry, here it is said once."""
    logger.warning(f"warning: {label}: {problem}; its images are left out")


TarMember = tuple[str, int, int]  # (member name, byte offset of its data, size)


def tar_image_members(f: BinaryIO, label: str, shown: str) -> tuple[list[TarMember], bool]:
    """The regular image members of the uncompressed tar shard open as `f` (seekable: only the headers are read),
    and whether the listing reached the shard's end (False: it is damaged, and said so once); a compressed shard
    (named `shown`) is refused."""
    compressed = f.read(6).startswith(COMPRESSED_MAGIC)
    if compressed:
        raise UserError(
            f"{shown}: compressed tar shard; training reads images at random offsets, so decompress it first (e.g. "
            "gunzip -k) and pass the .tar"
        )
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.TarError as exc:
        skip_warning(label, f"unreadable tar shard ({exc})")
        return [], False
    members: list[TarMember] = []
    with tar:
        try:
            for member in tar:
                # links and sparse members have no contiguous data to pread; iter_images reports links as errors
                if member.name.lower().endswith(IMAGE_SUFFIXES) and member.isreg() and not member.issparse():
                    members.append((member.name, member.offset_data, member.size))
        except (tarfile.TarError, EOFError) as exc:
            skip_warning(label, f"tar shard ends early or is corrupt ({exc}); members after the damage")
            return members, False
    return members, True


MEMBERS_SCHEMA = pa.schema([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64())])


def members_table(members: list[TarMember]) -> pa.Table:
    """A tar shard's members as the columns of `MEMBERS_SCHEMA`."""
    if not members:
        return MEMBERS_SCHEMA.empty_table()
    columns = [pa.array(values, field.type) for values, field in zip(zip(*members), MEMBERS_SCHEMA)]
    return pa.Table.from_arrays(columns, schema=MEMBERS_SCHEMA)


def member_refs(members: pa.Table, label: str, where: str) -> ImageRefs:
    """Refs of a tar shard's members (`members_table`), with source ids ``label::member`` and `where` as their path:
    made column by column, no object per member (a run over 14 M images lists them all at start-up)."""
    n = members.num_rows
    source_ids = pc.binary_join_element_wise(pa.scalar(f"{label}::"), members.column("name"), "")
    return ImageRefs.from_columns(
        source_ids,
        np.zeros(n, np.int32),
        ["tar"],
        np.zeros(n, np.int32),
        [where],
        members.column("offset"),
        members.column("size"),
    )


def tar_member_refs(f: BinaryIO, label: str, where: str, shown: str) -> ImageRefs:
    """Refs of the regular image members of the uncompressed tar shard open as `f` (see `tar_image_members`)."""
    return member_refs(members_table(tar_image_members(f, label, shown)[0]), label, where)


T = TypeVar("T")
ITER_ROWS = 65_536  # rows an `ImageRefs` iteration converts at once


class Columnar(Sequence[T]):
    """A sequence whose items are made from columns when asked for; none is kept."""

    @abstractmethod
    def _item(self, row: int) -> T:
        """The item of row `row` (0 <= row < len(self)), made from the columns."""

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        return self._item(range(len(self))[i])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


class ImageRefs(Columnar[ImageRef]):
    """Image refs as Arrow columns: an `ImageRef` is made when one is asked for.

    A list of ImageRef objects costs ~440 B per image (6 GB for ImageNet-21k) in every process, and the pages of a
    forked DataLoader worker's copy are duplicated as reference counts touch them; Arrow buffers are not. The
    columns kind, path and column are dictionary-encoded: a tar shard's path is stored once.
    """

    NAMES = ("source_id", "kind", "path", "offset", "size", "column")

    def __init__(self, table: pa.Table) -> None:
        self.table = table.select(list(self.NAMES))
        self._columns = [column.combine_chunks() for column in self.table.columns]

    @classmethod
    def from_columns(
        cls,
        source_ids: pa.Array | pa.ChunkedArray,
        kinds: np.ndarray,
        kind_names: Sequence[str],
        paths: np.ndarray,
        path_names: Sequence[str],
        offsets: pa.Array | pa.ChunkedArray | np.ndarray,
        sizes: pa.Array | pa.ChunkedArray | np.ndarray,
    ) -> ImageRefs:
        """Refs from their columns: kind and path as int32 codes into the names given; no image column (files and tar
        members; a table's rows come through `of`)."""

        def encoded(codes: np.ndarray, names: Sequence[str]) -> pa.DictionaryArray:
            return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(list(names), pa.string()))

        n = len(source_ids)
        return cls(
            pa.table(
                {
                    "source_id": source_ids,
                    "kind": encoded(kinds, kind_names),
                    "path": encoded(paths, path_names),
                    "offset": pa.array(offsets, pa.int64()) if isinstance(offsets, np.ndarray) else offsets,
                    "size": pa.array(sizes, pa.int64()) if isinstance(sizes, np.ndarray) else sizes,
                    "column": encoded(np.zeros(n, np.int32), [""]),
                }
            )
        )

    @classmethod
    def of(cls, refs: Sequence[ImageRef]) -> ImageRefs:
        """`refs` as columns (itself when it is already)."""
        if isinstance(refs, ImageRefs):
            return refs
        return cls(
            pa.table(
                {
                    "source_id": pa.array([r.source_id for r in refs], pa.string()),
                    "kind": pa.array([r.kind for r in refs], pa.string()).dictionary_encode(),
                    "path": pa.array([r.path for r in refs], pa.string()).dictionary_encode(),
                    "offset": pa.array([r.offset for r in refs], pa.int64()),
                    "size": pa.array([r.size for r in refs], pa.int64()),
                    "column": pa.array([r.column for r in refs], pa.string()).dictionary_encode(),
                }
            )
        )

    @classmethod
    def concat(cls, parts: Sequence[Sequence[ImageRef]]) -> ImageRefs:
        """The refs of `parts` one after the other, the dictionaries of their encoded columns unified."""
        tables = [cls.of(part).table for part in parts]
        if not tables:
            return cls.of([])
        table = pa.concat_tables(tables).unify_dictionaries()
        return cls(table)

    def __len__(self) -> int:
        return self.table.num_rows

    def _item(self, row: int) -> ImageRef:
        return ImageRef(*(column[row].as_py() for column in self._columns))

    def __iter__(self) -> Iterator[ImageRef]:
        """In order, a batch of rows converted at a time (a row at a time costs ~10x more)."""
        for lo in range(0, len(self), ITER_ROWS):
            for row in zip(*(column[lo : lo + ITER_ROWS].to_pylist() for column in self._columns)):
                yield ImageRef(*row)

    def with_paths(self, paths: Mapping[str, str]) -> ImageRefs:
        """These refs with the files named in `paths` read from where it maps them (a node's local copies of tar
        shards on object storage): only the path column's dictionary changes, not a row."""
        column = self.table.column("path").combine_chunks()
        dictionary = pa.array([paths.get(p, p) for p in column.dictionary.to_pylist()], pa.string())
        remapped = pa.DictionaryArray.from_arrays(column.indices, dictionary)
        return ImageRefs(self.table.set_column(self.table.schema.get_field_index("path"), "path", remapped))
