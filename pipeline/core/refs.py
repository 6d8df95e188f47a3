"""Where images are: the file names that hold them, and `ImageRef`, one image's place in its source.

Local sources (`pipeline.core.sources`) and tar shards on object storage (`pipeline.core.remote_tars`) list
images as the same refs, a tar shard's members from its headers alone (`tar_member_refs`); both import this
module, and `sources` reaches the remote shards through `remote_tars`, never the other way round.
"""

from __future__ import annotations

import logging
import tarfile
from dataclasses import dataclass
from typing import BinaryIO

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


def member_refs(members: list[TarMember], label: str, where: str) -> list[ImageRef]:
    """Refs of a tar shard's members, with source ids ``label::member`` and `where` as their path."""
    return [ImageRef(f"{label}::{name}", "tar", where, offset, size) for name, offset, size in members]


def tar_member_refs(f: BinaryIO, label: str, where: str, shown: str) -> list[ImageRef]:
    """Refs of the regular image members of the uncompressed tar shard open as `f` (see `tar_image_members`)."""
    return member_refs(tar_image_members(f, label, shown)[0], label, where)
