"""Image sources: folders, Parquet files / HF `datasets` directories, WebDataset tar shards.

One abstraction for the captioner and the trainer: `iter_images(inputs)` yields
every image's raw bytes with a stable *source id* (the path inside a folder,
``file.parquet::row``, ``shard.tar::member``). Nothing here decodes images;
an entry that cannot be read comes with an error instead of bytes, so one bad
file never stops a job. Images are identified downstream by the sha256 of
their bytes; the source id is recorded beside it.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
TABLE_SUFFIXES = (".parquet",)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_COLUMNS = ("image", "img", "jpg", "png", "image_bytes")


@dataclass(frozen=True)
class ImageEntry:
    source_id: str
    data: bytes | None
    error: str | None = None


def _folder(root: Path, image_column: str | None) -> Iterator[ImageEntry]:
    """Images, Parquet files and tar shards below `root` (recursive, sorted, links not followed)."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        paths.extend(Path(dirpath) / f for f in filenames if f.lower().endswith((*IMAGE_SUFFIXES, *TABLE_SUFFIXES, *TAR_SUFFIXES)))
    for path in sorted(paths):
        rel = path.relative_to(root).as_posix()
        name = rel.lower()
        if name.endswith(TABLE_SUFFIXES):
            yield from _parquet(path, image_column, rel)
        elif name.endswith(TAR_SUFFIXES):
            yield from _tar(path, rel)
        else:
            yield _file(path, rel)


def _file(path: Path, label: str) -> ImageEntry:
    try:
        return ImageEntry(label, path.read_bytes())
    except OSError as exc:
        return ImageEntry(label, None, f"unreadable file: {exc.strerror or exc}")


def _tar(path: Path, label: str) -> Iterator[ImageEntry]:
    try:
        tar = tarfile.open(path, mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        yield ImageEntry(f"{label}::", None, f"unreadable tar shard: {exc}")
        return
    with tar:
        try:
            for member in tar:
                if not member.name.lower().endswith(IMAGE_SUFFIXES):
                    continue
                sid = f"{label}::{member.name}"
                if not member.isreg():
                    yield ImageEntry(sid, None, "tar member is a link or not a regular file")
                    continue
                handle = tar.extractfile(member)
                yield ImageEntry(sid, handle.read() if handle else b"")
        except (tarfile.TarError, OSError, EOFError) as exc:
            yield ImageEntry(f"{label}::", None, f"tar shard ends early or is corrupt: {exc}")


def _image_column(names: list[str], column: str | None, where: str) -> str:
    if column:
        if column not in names:
            raise UserError(f"{where} has no column {column!r} (columns: {', '.join(names)})")
        return column
    for name in IMAGE_COLUMNS:
        if name in names:
            return name
    raise UserError(f"{where}: no image column among {', '.join(names)}; name it with --image-column")


def _value_bytes(value: object, base: Path) -> tuple[bytes | None, str | None]:
    """Bytes of one image cell: raw bytes, an HF Image struct {bytes, path}, or a path string."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"], None
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if isinstance(value, str) and value:
        path = Path(value) if Path(value).is_absolute() else base / value
        try:
            return path.read_bytes(), None
        except OSError as exc:
            return None, f"image path in table unreadable: {exc.strerror or exc}"
    return None, "empty image cell"


def _parquet(path: Path, column: str | None, label: str) -> Iterator[ImageEntry]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        yield ImageEntry(f"{label}::", None, f"unreadable parquet file: {exc}")
        return
    name = _image_column(pf.schema_arrow.names, column, str(path))
    row = 0
    for batch in pf.iter_batches(columns=[name], batch_size=256):
        for value in batch.column(0).to_pylist():
            data, error = _value_bytes(value, path.parent)
            yield ImageEntry(f"{label}::{row}", data, error)
            row += 1


def _hf_dataset(root: Path, column: str | None) -> Iterator[ImageEntry]:
    import datasets

    ds = datasets.load_from_disk(str(root))
    if isinstance(ds, datasets.DatasetDict):
        raise UserError(f"{root} holds several splits ({', '.join(ds)}); pass one split's directory")
    name = _image_column(list(ds.column_names), column, str(root))
    if isinstance(ds.features[name], datasets.Image):
        ds = ds.cast_column(name, datasets.Image(decode=False))
    for row, value in enumerate(ds.select_columns([name]).to_iterable_dataset()):
        data, error = _value_bytes(value[name], root)
        yield ImageEntry(f"{root.name}::{row}", data, error)


def describe_input(path: Path) -> str:
    """Which kind of source `path` is: folder, hf-dataset, parquet, tar or image."""
    if path.is_dir():
        return "hf-dataset" if (path / "dataset_info.json").exists() and (path / "state.json").exists() else "folder"
    name = path.name.lower()
    for kind, suffixes in (("parquet", TABLE_SUFFIXES), ("tar", TAR_SUFFIXES), ("image", IMAGE_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    raise UserError(f"{path}: not a folder, .parquet file, .tar shard, HF datasets directory or image file")


def iter_images(inputs: list[Path], image_column: str | None = None) -> Iterator[ImageEntry]:
    """Every image of every input, in a deterministic order; bad inputs are refused before any is read."""
    kinds = []
    for path in map(Path, inputs):
        if not path.exists():
            raise UserError(f"{path}: no such file or directory")
        kinds.append((path, describe_input(path)))
    return _iter_inputs(kinds, image_column)


def _iter_inputs(kinds: list[tuple[Path, str]], image_column: str | None) -> Iterator[ImageEntry]:
    for path, kind in kinds:
        if kind == "folder":
            yield from _folder(path, image_column)
        elif kind == "hf-dataset":
            yield from _hf_dataset(path, image_column)
        elif kind == "parquet":
            yield from _parquet(path, image_column, path.name)
        elif kind == "tar":
            yield from _tar(path, path.name)
        else:
            yield _file(path, path.name)
