"""Image sources: folders, Parquet files, HF `datasets` (saved to disk, or whatever `load_dataset` opens),
WebDataset tar shards.

One abstraction for the captioner and the trainer: `iter_images(inputs)` yields
every image's raw bytes with a stable *source id* (the path inside a folder,
``file.parquet::row``, ``shard.tar::member``, ``hf:ID[split]::row``). Nothing here
decodes images; an entry that cannot be read comes with an error instead of bytes,
so one bad file never stops a job. Images are identified downstream by the sha256
of their bytes; the source id is recorded beside it.

An input ``hf:PATH_OR_ID`` (optionally ``hf:PATH_OR_ID[split]``; else `split`) is
opened with ``datasets.load_dataset``: a hub id and a local ``imagefolder`` or
Parquet data directory go through the same code, streamed when read in order.

`iter_samples` also yields each image's captions, for importing captions that sit
beside the images: a WebDataset sample's ``.txt`` (one caption per non-blank line)
and ``.json`` (``caption`` or ``captions``) members, or a table's caption column.

The trainer reads images at random instead: `list_images(inputs)` lists the
same images as `ImageRef`s (`pipeline.core.refs`) without reading their bytes, and an `ImageReader`
in each DataLoader worker fetches one image per call (a file read, one
``pread`` from a tar shard, one row of a memory-mapped Arrow table).
"""

from __future__ import annotations

import os
import tarfile
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes, user_cache_dir
from pipeline.core.refs import (
    IMAGE_SUFFIXES,
    MEMBERS_SCHEMA,
    TABLE_SUFFIXES,
    TAR_SUFFIXES,
    ImageRef,
    ImageRefs,
    member_refs,
    members_table,
    skip_warning,
    tar_image_members,
)
from pipeline.core.remote import is_remote
from pipeline.core.remote_tars import RANGE_BATCH, list_remote_tars, read_ranges

if TYPE_CHECKING:
    import datasets

IMAGE_COLUMNS = ("image", "img", "jpg", "png", "image_bytes")
HF_PREFIX = "hf:"
DEFAULT_SPLIT = "train"
CAPTION_SUFFIXES = (".txt", ".json")
OPEN_HANDLES = 64  # per reader: enough for a worker's working set, far below the fd limit


@dataclass(frozen=True)
class ImageEntry:
    source_id: str
    data: bytes | None
    error: str | None = None


@dataclass(frozen=True)
class Sample:
    """An image (as `ImageEntry`) with the captions its source holds beside it, as raw values (checked by the
    importer): strings, lists, or what a caption member or cell held."""

    image: ImageEntry | None  # None: a WebDataset sample without an image member
    key: str  # the sample's key (tar: member path without its extensions; table: the row's source id)
    captions: list[object]
    problems: list[str]  # caption members that could not be read as text or JSON


def _leaves(kinds: list[tuple[Path, str]]) -> Iterator[tuple[Path, str, str]]:
    """(path, kind, label) of every single source: folders expand to their files (recursive,
    sorted, links to directories not followed); the label prefixes the source ids."""
    for path, kind in kinds:
        if kind == "hf":
            yield path, kind, str(path)
            continue
        if kind != "folder":
            yield path, kind, path.name
            continue
        paths: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
            dirnames.sort()
            paths.extend(
                Path(dirpath) / f
                for f in filenames
                if f.lower().endswith((*IMAGE_SUFFIXES, *TABLE_SUFFIXES, *TAR_SUFFIXES))
            )
        for file in sorted(paths):
            rel = file.relative_to(path).as_posix()
            name = rel.lower()
            yield (
                file,
                "parquet" if name.endswith(TABLE_SUFFIXES) else "tar" if name.endswith(TAR_SUFFIXES) else "image",
                rel,
            )


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


def _load_hf(root: Path) -> datasets.Dataset:
    import datasets

    ds = datasets.load_from_disk(str(root))
    if isinstance(ds, datasets.DatasetDict):
        raise UserError(f"{root} holds several splits ({', '.join(ds)}); pass one split's directory")
    return ds


def _undecoded(ds: Any, name: str, *others: str) -> Any:
    """Only columns `name` (and `others`), with an Image feature left as its stored {bytes, path} (a Dataset or an
    IterableDataset alike)."""
    import datasets

    ds = ds.select_columns([name, *others])
    image = (ds.features or {}).get(name)
    return ds.cast_column(name, datasets.Image(decode=False)) if isinstance(image, datasets.Image) else ds


def _hf_dataset(root: Path, column: str | None) -> Iterator[ImageEntry]:
    ds = _load_hf(root)
    name = _image_column(list(ds.column_names), column, str(root))
    for row, value in enumerate(_undecoded(ds, name).to_iterable_dataset()):
        data, error = _value_bytes(value[name], root)
        yield ImageEntry(f"{root.name}::{row}", data, error)


def hf_spec(text: str, split: str = DEFAULT_SPLIT) -> str:
    """The canonical form ``hf:PATH_OR_ID[split]`` of an ``hf:`` input (the split given in it, else `split`)."""
    name, inner = _parse_hf(text)
    return f"{HF_PREFIX}{name}[{inner or split}]"


def _parse_hf(spec: str) -> tuple[str, str | None]:
    body = spec[len(HF_PREFIX) :]
    if body.endswith("]") and "[" in body:
        name, split = body[:-1].rsplit("[", 1)
    else:
        name, split = body, None
    if not name or split == "":
        raise UserError(f"{spec}: expected hf:PATH_OR_ID or hf:PATH_OR_ID[split] (a hub id or a local data directory)")
    return name, split


def _open_hf(spec: str, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """`datasets.load_dataset` of a canonical spec; a failure to open it is one line."""
    import datasets

    name, split = _parse_hf(spec)
    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except Exception as exc:  # datasets raises many types: not found, offline, unknown split, bad config
        raise UserError(
            f"{spec}: datasets.load_dataset cannot open it ({type(exc).__name__}: {_first_line(exc)})"
        ) from None


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def _hf_base(spec: str) -> Path:
    """Where relative image paths of an ``hf:`` dataset are resolved: its directory when it is a local one."""
    name = Path(_parse_hf(spec)[0])
    return name if name.is_dir() else Path.cwd()


def _hf_columns(ds: datasets.Dataset | datasets.IterableDataset) -> list[str]:
    names = ds.column_names if ds.column_names is not None else list(ds.features or {})
    return list(names)


def _hf_stream(spec: str, column: str | None) -> Iterator[ImageEntry]:
    ds = _open_hf(spec, streaming=True)
    name = _image_column(_hf_columns(ds), column, spec)
    for row, value in enumerate(_undecoded(ds, name)):
        data, error = _value_bytes(value[name], _hf_base(spec))
        yield ImageEntry(f"{spec}::{row}", data, error)


def describe_input(path: Path) -> str:
    """Which kind of source `path` is: hf (``hf:PATH_OR_ID``), folder, hf-dataset, parquet, tar or image."""
    if str(path).startswith(HF_PREFIX):
        return "hf"
    if path.is_dir():
        return "hf-dataset" if (path / "dataset_info.json").exists() and (path / "state.json").exists() else "folder"
    name = path.name.lower()
    for kind, suffixes in (("parquet", TABLE_SUFFIXES), ("tar", TAR_SUFFIXES), ("image", IMAGE_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    raise UserError(f"{path}: not a folder, .parquet file, .tar shard, HF datasets directory or image file")


def _check_inputs(inputs: list[Path], split: str = DEFAULT_SPLIT) -> list[tuple[Path, str]]:
    """(path, kind) of each input (an ``hf:`` one in its canonical form); a missing or unknown one is refused before
    any is read."""
    kinds = []
    for path in map(Path, inputs):
        if str(path).startswith(HF_PREFIX):
            kinds.append((Path(hf_spec(str(path), split)), "hf"))
            continue
        if not path.exists():
            raise UserError(f"{path}: no such file or directory")
        kinds.append((path, describe_input(path)))
    return kinds


def iter_images(
    inputs: list[Path], image_column: str | None = None, split: str = DEFAULT_SPLIT
) -> Iterator[ImageEntry]:
    """Every image of every input, in a deterministic order; bad inputs are refused before any is read.

    `split` is the split of ``hf:`` inputs that do not name one.
    """
    return _iter_inputs(_check_inputs(inputs, split), image_column)


def _iter_inputs(kinds: list[tuple[Path, str]], image_column: str | None) -> Iterator[ImageEntry]:
    for path, kind, label in _leaves(kinds):
        if kind == "hf":
            yield from _hf_stream(label, image_column)
        elif kind == "hf-dataset":
            yield from _hf_dataset(path, image_column)
        elif kind == "parquet":
            yield from _parquet(path, image_column, label)
        elif kind == "tar":
            yield from _tar(path, label)
        else:
            yield _file(path, label)


# ---- images with the captions beside them (importing a data set's own captions) -----------


def iter_samples(
    inputs: list[Path], image_column: str | None = None, caption_column: str | None = None, split: str = DEFAULT_SPLIT
) -> Iterator[Sample]:
    """Every image of `inputs` with the captions its source holds beside it, in `iter_images` order and with its
    source ids.

    Tar shards are read as WebDataset: consecutive members sharing a key (the member path up to the first dot of
    its file name) form a sample. Tables (Parquet, HF datasets, ``hf:``) take their captions from `caption_column`.
    A loose image file holds no captions: it is yielded without any, unread.
    """
    kinds = _check_inputs(inputs, split)
    if caption_column is None and any(k in ("parquet", "hf-dataset", "hf") for _, k in kinds):
        raise UserError("captions in a table (Parquet, HF datasets, hf:) need --caption-column NAME")
    for path, kind, label in _leaves(kinds):
        if kind == "tar":
            yield from _tar_samples(path, label)
        elif kind in ("parquet", "hf-dataset", "hf"):
            if caption_column is None:  # a table found inside a folder
                raise UserError(f"{label}: captions in a table need --caption-column NAME")
            yield from _table_samples(path, kind, label, image_column, caption_column)
        else:
            yield Sample(ImageEntry(label, None, "an image file holds no captions"), label, [], [])


def describe_sources(inputs: list[Path], split: str = DEFAULT_SPLIT) -> list[dict[str, object]]:
    """What identifies a set of sources without reading them, however they are named on the command line (a folder
    or its files): each file's name and size, sorted; each ``hf:`` spec."""
    out: list[dict[str, object]] = []
    for path, kind, label in _leaves(_check_inputs(inputs, split)):
        if kind == "hf":
            out.append({"source": label})
        else:  # a saved HF dataset is a directory: its files' sizes
            files = [p for p in Path(path).rglob("*") if p.is_file()] if Path(path).is_dir() else [Path(path)]
            out.append({"source": Path(path).name, "bytes": sum(p.stat().st_size for p in files)})
    return sorted(out, key=lambda d: (str(d["source"]), int(str(d.get("bytes", 0)))))


def webdataset_key(member: str) -> tuple[str, str]:
    """(key, extension) of a WebDataset member: ``dir/abc.seg.jpg`` -> (``dir/abc``, ``seg.jpg``)."""
    head, _, base = member.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{head}/{stem}" if head else stem), extension.lower()


def _caption_values(extension: str, data: bytes, problems: list[str]) -> list[object]:
    """Captions of one ``.txt`` (a caption per non-blank line) or ``.json`` (``caption`` or ``captions``) member."""
    import json

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        problems.append("caption not valid UTF-8")
        return []
    if not extension.endswith("json"):
        return [line for line in text.splitlines() if line.strip()] or [""]
    try:
        doc = json.loads(text)
    except ValueError:
        problems.append("unparseable JSON caption")
        return []
    if not isinstance(doc, dict) or not ("caption" in doc or "captions" in doc):
        problems.append("JSON without caption or captions")
        return []
    values = doc.get("captions", doc.get("caption"))
    return list(values) if isinstance(values, list) else [values]


def _tar_samples(path: Path, label: str) -> Iterator[Sample]:
    try:
        tar = tarfile.open(path, mode="r:*")
    except (tarfile.TarError, OSError) as exc:
        yield Sample(ImageEntry(f"{label}::", None, f"unreadable tar shard: {exc}"), f"{label}::", [], [])
        return
    key: str | None = None
    image: ImageEntry | None = None
    captions: list[object] = []
    problems: list[str] = []
    with tar:
        try:
            for member in tar:
                member_key, extension = webdataset_key(member.name)
                if not (f".{extension}".endswith(IMAGE_SUFFIXES) or f".{extension}".endswith(CAPTION_SUFFIXES)):
                    continue
                if member_key != key:
                    if key is not None:
                        yield Sample(image, f"{label}::{key}", captions, problems)
                    key, image, captions, problems = member_key, None, [], []
                sid = f"{label}::{member.name}"
                if not member.isreg():
                    if f".{extension}".endswith(IMAGE_SUFFIXES):
                        image = ImageEntry(sid, None, "tar member is a link or not a regular file")
                    continue
                handle = tar.extractfile(member)
                data = handle.read() if handle else b""
                if f".{extension}".endswith(IMAGE_SUFFIXES):
                    image = image or ImageEntry(sid, data)
                else:
                    captions.extend(_caption_values(extension, data, problems))
        except (tarfile.TarError, OSError, EOFError) as exc:
            problems.append(f"tar shard ends early or is corrupt: {exc}")
    if key is not None:
        yield Sample(image, f"{label}::{key}", captions, problems)


def _table_samples(
    path: Path, kind: str, label: str, image_column: str | None, caption_column: str
) -> Iterator[Sample]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        names, prefix, base = pf.schema_arrow.names, label, path.parent
    else:
        ds = _open_hf(label, streaming=True) if kind == "hf" else _load_hf(path)
        names = _hf_columns(ds)
        prefix = label if kind == "hf" else path.name
        base = _hf_base(label) if kind == "hf" else path
    image = _image_column(names, image_column, label)
    if caption_column not in names:
        raise UserError(f"{label} has no column {caption_column!r} (columns: {', '.join(names)})")
    if kind == "parquet":
        rows: Iterator[dict[str, Any]] = (
            row
            for batch in pf.iter_batches(columns=[image, caption_column], batch_size=256)
            for row in batch.to_pylist()
        )
    else:
        rows = iter(_undecoded(ds, image, caption_column))
    for row_number, row in enumerate(rows):
        data, error = _value_bytes(row[image], base)
        sid = f"{prefix}::{row_number}"
        value = row[caption_column]
        yield Sample(ImageEntry(sid, data, error), sid, list(value) if isinstance(value, list) else [value], [])


# ---- random access (the trainer) ----------------------------------------------------------


TAR_LISTING_VERSION = 1


def remembered_tar_members(path: Path, label: str) -> pa.Table:
    """A local tar shard's image members (`tar_image_members`, as `members_table`'s columns), listed once per (real
    path, size, mtime, inode) and remembered under the tcjepa cache, as file hashes are (`remembered_sha256`).

    Python's tarfile parses ~30 µs of headers per member: every run over 14 M images would list for 7 minutes on
    one core before its first step. Remembered, a shard's listing is one small Parquet file read back in a few µs
    per member. A damaged shard's partial listing is not remembered (its warning is given again); a changed shard
    has another key; an entry that cannot be read is listed anew and rewritten.
    """
    import hashlib

    real = Path(path).resolve()
    st = real.stat()
    key = f"v{TAR_LISTING_VERSION}\0{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    entry = user_cache_dir() / "tar-listing" / f"{hashlib.sha256(key.encode()).hexdigest()}.parquet"
    remembered = _read_listing(entry)
    if remembered is not None:
        return remembered
    with open(real, "rb") as f:
        members, complete = tar_image_members(f, label, str(path))
    table = members_table(members)
    if complete:
        _write_listing(entry, table)
    return table


def _read_listing(entry: Path) -> pa.Table | None:
    """A remembered listing; None when there is none or it cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(entry, columns=MEMBERS_SCHEMA.names).cast(MEMBERS_SCHEMA)
    except (OSError, KeyError, pa.ArrowException):
        return None


def _write_listing(entry: Path, table: pa.Table) -> None:
    """Remember a listing (atomically: concurrent runs share the cache); a cache that cannot be written only means
    the listing is not remembered."""
    import pyarrow.parquet as pq

    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    with suppress(OSError):
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(entry, buffer.getvalue().to_pybytes())


def _tar_refs(path: Path, label: str) -> Sequence[ImageRef]:
    """Regular image members of an uncompressed tar shard, from the headers alone (remembered)."""
    try:
        return member_refs(remembered_tar_members(path, label), label, os.path.abspath(path))
    except OSError as exc:
        skip_warning(label, f"unreadable tar shard ({exc})")
        return []


def _parquet_refs(path: Path, column: str | None, label: str) -> list[ImageRef]:
    """One ref per row, from the file's metadata alone."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        skip_warning(label, f"unreadable parquet file ({exc})")
        return []
    name = _image_column(pf.schema_arrow.names, column, str(path))
    where = os.path.abspath(path)
    return [ImageRef(f"{label}::{row}", "table", where, row, column=name) for row in range(pf.metadata.num_rows)]


def _hf_refs(root: Path, column: str | None) -> list[ImageRef]:
    ds = _load_hf(root)
    name = _image_column(list(ds.column_names), column, str(root))
    where = os.path.abspath(root)
    return [ImageRef(f"{root.name}::{row}", "table", where, row, column=name) for row in range(ds.num_rows)]


def _hf_spec_refs(spec: str, column: str | None) -> list[ImageRef]:
    """One ref per row of an ``hf:`` dataset, read at random from the Arrow files `datasets` prepares once."""
    ds = _open_hf(spec, streaming=False)
    name = _image_column(_hf_columns(ds), column, spec)
    return [ImageRef(f"{spec}::{row}", "hf", spec, row, column=name) for row in range(ds.num_rows)]


def list_images(inputs: Sequence[str | Path], image_column: str | None = None, split: str = DEFAULT_SPLIT) -> ImageRefs:
    """Same images, same order, same source ids as iter_images, without reading image bytes: as Arrow columns, a
    tar shard's members never made into objects.

    Tar shards are listed from their headers, Parquet files from their metadata. Entries
    iter_images yields only as errors (links in tar shards, unreadable shards) are left
    out; a file or table cell that turns out unreadable fails in `ImageReader.read`.

    An input may also be a URL (``s3://...``) of a tar shard, or of a prefix holding tar shards: such shards are
    listed as a local folder's are (source ids ``relative/path.tar::member``), their headers read by byte range, and
    their refs keep the shard's URL as their path (`pipeline.core.remote_tars`).
    """
    local = iter(_check_inputs([Path(i) for i in inputs if not is_remote(str(i))], split))
    remote = [str(i) for i in inputs if is_remote(str(i))]
    shards: dict[str, Sequence[ImageRef]] = {}
    if remote:
        shards = list_remote_tars(remote)
    parts: list[Sequence[ImageRef]] = []
    files: list[ImageRef] = []  # loose image files in a row, one part

    def add(part: Sequence[ImageRef]) -> None:
        nonlocal files
        if files:
            parts.append(files)
            files = []
        parts.append(part)

    for given in inputs:
        if is_remote(str(given)):
            add(shards[str(given)])
            continue
        for path, kind, label in _leaves([next(local)]):
            if kind == "hf":
                add(_hf_spec_refs(label, image_column))
            elif kind == "hf-dataset":
                add(_hf_refs(path, image_column))
            elif kind == "parquet":
                add(_parquet_refs(path, image_column, label))
            elif kind == "tar":
                add(_tar_refs(path, label))
            else:
                files.append(ImageRef(label, "file", os.path.abspath(path)))
    add([])
    return ImageRefs.concat(parts)


def read_images(refs: Sequence[ImageRef], batch: int = RANGE_BATCH) -> Iterator[bytes | None]:
    """Each ref's bytes, in order (None: unreadable): local ones through an `ImageReader`, tar members on object
    storage by byte range (`pipeline.core.remote_tars.read_ranges`), `batch` refs' requests at once. For building the
    run index, not for training."""
    reader = ImageReader()
    try:
        for start in range(0, len(refs), batch):
            chunk = refs[start : start + batch]
            fetched = iter(read_ranges([r for r in chunk if is_remote(r.path)]))
            for ref in chunk:
                if is_remote(ref.path):
                    yield next(fetched)
                    continue
                try:
                    yield reader.read(ref)
                except OSError:
                    yield None
    finally:
        reader.close()


def count_images(inputs: list[Path], image_column: str | None = None) -> int | None:
    """How many images `iter_images` will yield (from names, headers and metadata, no image read); None when an
    input is an ``hf:`` data set, which would have to be prepared to be counted."""
    if any(str(p).startswith(HF_PREFIX) for p in inputs):
        return None
    return len(list_images(inputs, image_column))


class ImageReader:
    """Reads one image's bytes per call from an `ImageRef`.

    Handles (tar shard descriptors, memory-mapped Arrow tables) are opened on first use
    and belong to the process that opened them: a reader pickled into, or forked with, a
    DataLoader worker opens its own. A Parquet file is read through a memory-mapped Arrow
    copy of its image column that `datasets` writes once to its cache (HF_DATASETS_CACHE),
    because Parquet itself can only be read a whole page of images at a time.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._handles: OrderedDict[str, int | datasets.Dataset] = OrderedDict()

    def __reduce__(self) -> tuple[type[ImageReader], tuple[()]]:
        """Pickle as a fresh reader: open handles never travel to another process."""
        return ImageReader, ()

    def read(self, ref: ImageRef) -> bytes:
        """The image's bytes; OSError (naming the source id) when they cannot be read."""
        if ref.kind == "file":
            try:
                return Path(ref.path).read_bytes()
            except OSError as exc:
                raise OSError(f"{ref.source_id}: unreadable file: {exc.strerror or exc}") from exc
        if ref.kind == "tar":
            data = os.pread(self._handle(ref), ref.size, ref.offset)
            if len(data) != ref.size:
                raise OSError(f"{ref.source_id}: tar shard {ref.path} is shorter than when it was listed")
            return data
        if ref.kind in ("table", "hf"):
            if ref.kind == "hf":
                base = _hf_base(ref.path)
            else:
                base = Path(ref.path) if os.path.isdir(ref.path) else Path(ref.path).parent
            table = self._handle(ref)
            assert not isinstance(table, int)
            cell, error = _value_bytes(table[ref.offset][ref.column], base)
            if cell is None:
                raise OSError(f"{ref.source_id}: {error}")
            return cell
        raise ValueError(f"unknown ImageRef kind {ref.kind!r}")

    def _handle(self, ref: ImageRef) -> int | datasets.Dataset:
        """The open tar descriptor or Arrow table for `ref`, least recently used ones closed."""
        if self._pid != os.getpid():  # forked: the parent's handles are not ours to use or close
            self._pid, self._handles = os.getpid(), OrderedDict()
        key = f"{ref.kind}:{ref.path}:{ref.column}"
        handle = self._handles.get(key)
        if handle is None:
            handle = self._open(ref)
            self._handles[key] = handle
            if len(self._handles) > OPEN_HANDLES:
                self._close(self._handles.popitem(last=False)[1])
        else:
            self._handles.move_to_end(key)
        return handle

    @staticmethod
    def _open(ref: ImageRef) -> int | datasets.Dataset:
        if ref.kind == "tar":
            try:
                return os.open(ref.path, os.O_RDONLY)
            except OSError as exc:
                raise OSError(f"{ref.source_id}: unreadable tar shard: {exc.strerror or exc}") from exc
        if ref.kind == "hf":
            return _undecoded(_open_hf(ref.path, streaming=False), ref.column)
        if os.path.isdir(ref.path):
            return _undecoded(_load_hf(Path(ref.path)), ref.column)
        import datasets

        return _undecoded(datasets.Dataset.from_parquet(ref.path, columns=[ref.column]), ref.column)

    @staticmethod
    def _close(handle: int | datasets.Dataset) -> None:
        if isinstance(handle, int):
            os.close(handle)

    def close(self) -> None:
        """Close this process's handles (the reader stays usable and reopens on demand)."""
        if self._pid == os.getpid():
            for handle in self._handles.values():
                self._close(handle)
        self._handles = OrderedDict()
