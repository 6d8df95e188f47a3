import io
import json
import multiprocessing
import pickle
import re
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.core import refs as refs_module
from pipeline.core.errors import UserError
from pipeline.core.images import ImagePolicy, decode
from pipeline.core.recipes import sha256_bytes
from pipeline.core.refs import ImageRef, ImageRefs
from pipeline.core.sources import ImageReader, iter_images, list_images
from tests.support.images import bad_image_catalogue, png

IMAGES = {f"im{i}.png": png((40 * i, 255 - 30 * i, 90)) for i in range(5)}


def test_every_source_kind_yields_the_same_images(tmp_path):
    import datasets

    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for i, (name, data) in enumerate(IMAGES.items()):
        (folder / ("sub" if i % 2 else "") / name).write_bytes(data)
    (folder / "notes.txt").write_text("not an image")
    pq.write_table(
        pa.table({"image": [{"bytes": d, "path": n} for n, d in IMAGES.items()], "caption": ["x"] * 5}),
        tmp_path / "hf.parquet",
    )
    pq.write_table(pa.table({"jpg": list(IMAGES.values())}), tmp_path / "raw.parquet")
    pq.write_table(
        pa.table({"file": [str(folder / ("sub" if i % 2 else "") / n) for i, n in enumerate(IMAGES)]}),
        tmp_path / "paths.parquet",
    )
    ds = datasets.Dataset.from_dict(
        {"image": [Image.open(io.BytesIO(d)) for d in IMAGES.values()]},
        features=datasets.Features({"image": datasets.Image()}),
    )
    ds.save_to_disk(str(tmp_path / "hfdir"))
    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        for name, data in IMAGES.items():
            info = tarfile.TarInfo(f"{name[:-4]}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            meta = json.dumps({"caption": "x"}).encode()
            info = tarfile.TarInfo(f"{name[:-4]}.json")
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))

    expected = {sha256_bytes(d) for d in IMAGES.values()}
    for inputs, column in [
        ([folder], None),
        ([tmp_path / "hf.parquet"], None),
        ([tmp_path / "raw.parquet"], None),
        ([tmp_path / "paths.parquet"], "file"),
        ([tmp_path / "shard-000.tar"], None),
    ]:
        entries = list(iter_images(inputs, column))
        assert all(e.error is None for e in entries), inputs
        assert {sha256_bytes(e.data) for e in entries} == expected and len(entries) == 5, inputs
    hf_entries = list(iter_images([tmp_path / "hfdir"]))
    assert len(hf_entries) == 5
    # a datasets round trip re-encodes the pixels; the decoded images are the same
    assert sorted(np.asarray(Image.open(io.BytesIO(e.data))).sum() for e in hf_entries) == sorted(
        np.asarray(Image.open(io.BytesIO(d))).sum() for d in IMAGES.values()
    )
    ids = [e.source_id for e in iter_images([folder])]
    assert ids == sorted(ids) and "sub/im1.png" in ids
    assert [e.source_id for e in iter_images([tmp_path / "shard-000.tar"])][0] == "shard-000.tar::im0.png"
    assert [e.source_id for e in iter_images([tmp_path / "raw.parquet"])][2] == "raw.parquet::2"


def test_tar_links_and_traversal_are_never_followed(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png("red"))
    with tarfile.open(tmp_path / "evil.tar", "w") as tar:
        link = tarfile.TarInfo("link.png")
        link.type = tarfile.SYMTYPE
        link.linkname = str(secret)
        tar.addfile(link)
        data = png("blue")
        info = tarfile.TarInfo("../../escape.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    entries = list(iter_images([tmp_path / "evil.tar"]))
    assert entries[0].data is None and "link" in entries[0].error
    assert entries[1].data == data  # read from the archive itself, nothing is extracted
    assert not (tmp_path.parent.parent / "escape.png").exists()


def test_bad_inputs_are_refused_up_front(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        iter_images([tmp_path / "absent"])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(UserError, match="not a folder"):
        iter_images([tmp_path / "x.csv"])
    pq.write_table(pa.table({"label": [1]}), tmp_path / "t.parquet")
    with pytest.raises(UserError, match="no image column"):
        list(iter_images([tmp_path / "t.parquet"]))


def test_decode_normalises_or_names_the_problem(tmp_path):
    policy = ImagePolicy(max_pixels=512 * 512)
    for name, (data, reason) in bad_image_catalogue().items():
        image, error = decode(data, policy)
        if reason is None:
            assert error is None, (name, error)
            assert image.mode == "RGB" and image.width * image.height <= 512 * 512, name
        else:
            assert image is None and error.startswith(reason), (name, error)
    rgba, _ = decode(png((255, 0, 0, 0), (20, 20), "RGBA"), policy)
    assert rgba.getpixel((3, 3)) == (255, 255, 255), "transparent pixels become white"
    big, _ = decode(png("white", (3000, 2000)), policy)
    assert abs(big.width / big.height - 1.5) < 0.01


def _read_all(reader, refs):
    return [reader.read(r) for r in refs]


def test_list_images_reads_what_iter_images_yields(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # Parquet's Arrow copies, also in the child
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = tmp_path / "folder"
    (folder / "a" / "b").mkdir(parents=True)
    names = list(IMAGES)
    for i, name in enumerate(names):
        (folder / ["", "a", "a/b"][i % 3] / name).write_bytes(IMAGES[name])
    pq.write_table(
        pa.table({"image": [{"bytes": d, "path": None} for d in IMAGES.values()]}),
        folder / "a" / "t.parquet",
        row_group_size=2,
    )
    pq.write_table(pa.table({"file": [str(folder / n) for n in names[::3]] + ["", None]}), tmp_path / "paths.parquet")
    pq.write_table(pa.table({"label": [1, 2], "jpg": [IMAGES[names[0]], IMAGES[names[1]]]}), tmp_path / "raw.parquet")
    ds = datasets.Dataset.from_dict(
        {"image": [Image.open(io.BytesIO(d)) for d in IMAGES.values()], "n": list(range(5))},
        features=datasets.Features({"image": datasets.Image(), "n": datasets.Value("int32")}),
    )
    ds.save_to_disk(str(tmp_path / "hfdir"))
    with tarfile.open(folder / "a" / "shard.tar", "w") as tar:
        for name, data in IMAGES.items():
            for member, payload in ((name, data), (f"{name[:-4]}.json", b"{}")):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        link = tarfile.TarInfo("link.png")
        link.type = tarfile.SYMTYPE
        link.linkname = names[0]
        tar.addfile(link)
    (tmp_path / "shard.tar").write_bytes((folder / "a" / "shard.tar").read_bytes())

    reader = ImageReader()
    for inputs, column in [
        ([folder], None),
        ([tmp_path / "hfdir"], None),
        ([tmp_path / "raw.parquet"], None),
        ([tmp_path / "shard.tar", folder / names[0]], None),
        ([tmp_path / "paths.parquet"], "file"),
    ]:
        entries = [e for e in iter_images(inputs, column) if e.data is not None or "link" not in e.error]
        refs = list_images(inputs, column)
        assert [r.source_id for r in refs] == [e.source_id for e in entries], inputs
        for ref, entry in zip(refs, entries):
            if entry.data is None:
                with pytest.raises(OSError, match=re.escape(entry.error)):
                    reader.read(ref)
            else:
                assert reader.read(ref) == entry.data, ref
    refs = list_images([folder])
    assert (
        {r.kind for r in refs} == {"file", "table", "tar"}
        and len(refs) == 15
        and all(r.path.startswith("/") for r in refs)
    )
    assert "a/shard.tar::link.png" not in {r.source_id for r in refs}

    refs = list_images([folder, tmp_path / "hfdir", tmp_path / "raw.parquet"])
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # the reader is pickled into the child before any use
        assert pool.apply(_read_all, (ImageReader(), refs)) == _read_all(reader, refs)
    assert vars(pickle.loads(pickle.dumps(reader)))["_handles"] == {}  # a used reader pickles without its handles
    reader.close()
    assert _read_all(reader, refs[:3]) == [e.data for e in list(iter_images([folder]))[:3]]


def test_listed_refs_are_columns_whose_items_iteration_and_slices_agree(tmp_path, monkeypatch):
    """Tar shards and loose files listed together: one `ImageRefs`, each shard's path stored once in the path
    column's dictionary; iteration (converted a batch at a time) gives what indexing gives, across batch bounds."""
    folder = tmp_path / "images"
    folder.mkdir()
    for shard in ("a.tar", "b.tar"):
        with tarfile.open(folder / shard, "w") as tar:
            for k in range(3):
                data = png(k)
                info = tarfile.TarInfo(f"{k}.png")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (folder / "c.png").write_bytes(png(9))
    refs = list_images([folder])
    assert isinstance(refs, ImageRefs) and len(refs) == 7
    assert [r.source_id for r in refs] == [*(f"{s}.tar::{k}.png" for s in "ab" for k in range(3)), "c.png"]
    paths = refs.table.column("path").combine_chunks()
    assert sorted(paths.dictionary.to_pylist()) == sorted(str(folder / f) for f in ("a.tar", "b.tar", "c.png"))
    monkeypatch.setattr(refs_module, "ITER_ROWS", 2)
    assert list(refs) == [refs[i] for i in range(len(refs))] == refs[:]
    assert refs[-1] == ImageRef("c.png", "file", str(folder / "c.png"))
    assert ImageRefs.concat([refs[:2], [], refs]) == refs[:2] + list(refs)


def test_a_columnar_sequence_must_say_how_it_makes_an_item():
    class Lengthy(refs_module.Columnar[int]):
        def __len__(self) -> int:
            return 1

    with pytest.raises(TypeError, match="_item"):
        Lengthy()  # type: ignore[abstract]


def test_list_images_refuses_what_it_cannot_read_at_random(tmp_path):
    import gzip

    with pytest.raises(UserError, match="no such file"):
        list_images([tmp_path / "absent"])
    pq.write_table(pa.table({"label": [1]}), tmp_path / "t.parquet")
    with pytest.raises(UserError, match="no image column"):
        list_images([tmp_path / "t.parquet"])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("x.png")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(buf.getvalue()))
    assert [e.data for e in iter_images([tmp_path / "s.tar.gz"])] == [b"abc"]
    with pytest.raises(UserError, match="compressed tar shard.*decompress"):
        list_images([tmp_path / "s.tar.gz"])


def _parquet_bytes(table: pa.Table) -> bytes:
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return buffer.getvalue().to_pybytes()


def _shard(path, names) -> None:
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(IMAGES[next(iter(IMAGES))])
            tar.addfile(info, io.BytesIO(IMAGES[next(iter(IMAGES))]))


def test_a_tar_shards_listing_is_remembered_until_the_shard_changes(tmp_path, monkeypatch, capsys):
    """The listing is read back while the shard's (path, size, mtime, inode) stay; a shard damaged in place under
    the same mtime still lists from memory, and once its mtime moves it is read again (and, unreadable, not
    remembered); an unreadable entry or a cache that cannot be written only costs the remembering."""
    import os

    cache = tmp_path / "cache"
    monkeypatch.setenv("TCJEPA_CACHE_DIR", str(cache))
    images = tmp_path / "images"
    images.mkdir()
    shard = images / "s.tar"
    _shard(shard, ["a.png", "notes.txt", "b.png"])
    first = list_images([images])
    assert [r.source_id for r in first] == ["s.tar::a.png", "s.tar::b.png"]
    [entry] = (cache / "tar-listing").iterdir()
    assert list_images([images]) == first

    stat = shard.stat()
    with open(shard, "r+b") as f:  # the first header overwritten in place: the same size and inode
        f.write(b"x" * 512)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert list_images([images]) == first, "listed from memory, not from the damaged headers"
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))  # past any timestamp granularity
    for _ in range(2):
        capsys.readouterr()
        assert list_images([images]) == []
        assert "warning: s.tar: " in capsys.readouterr().err, "said each time: not remembered"
    assert list((cache / "tar-listing").iterdir()) == [entry]

    _shard(shard, ["c.png", "d.png", "e.png"])
    listed = [r.source_id for r in list_images([images])]
    assert listed == ["s.tar::c.png", "s.tar::d.png", "s.tar::e.png"]
    new = [e for e in (cache / "tar-listing").iterdir() if e != entry]
    assert len(new) == 1
    for unreadable in (b"not parquet", _parquet_bytes(pa.table({"other": [1]}))):
        new[0].write_bytes(unreadable)
        assert [r.source_id for r in list_images([images])] == listed
        assert pq.read_table(new[0]).column_names == ["name", "offset", "size"], "listed again and rewritten"
    monkeypatch.setenv("TCJEPA_CACHE_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    assert [r.source_id for r in list_images([images])] == listed, "a cache that cannot be written"
    reader = ImageReader()
    assert [reader.read(r) for r in list_images([images])] == [IMAGES[next(iter(IMAGES))]] * 3
