import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from captioning.annotations import ImportReport
from captioning.cache import CaptionCache
from pipeline.core.errors import UserError
from pipeline.core.recipes import sha256_file
from tests.support.commands import refused, tcjepa


def _image(path, colour):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def test_jsonl_import_skips_bad_entries_and_is_idempotent(tmp_path):
    root = tmp_path / "imgs"
    _image(root / "a.png", "red")
    _image(root / "sub" / "b.png", "blue")
    _image(root / "copy_of_a.png", "red")  # same bytes as a.png: same image
    lines = [
        json.dumps({"image": "a.png", "captions": ["  a red square ", "", "   ", "red again"]}).encode(),
        json.dumps({"image": "sub/b.png", "captions": ["blue", 7]}).encode(),
        json.dumps({"image": "missing.png", "captions": ["nobody"]}).encode(),
        b'{"image": "sub/b.png", "captions": ["bad \xff\xfe bytes"]}',
        b"{not json",
        json.dumps({"image": "copy_of_a.png", "captions": ["a third red caption"]}).encode(),
        b"",
    ]
    ann = tmp_path / "caps.jsonl"
    ann.write_bytes(b"\n".join(lines) + b"\n")
    proc = tcjepa("caption", "--cache", tmp_path / "cache", "--annotations", ann, "--image-root", root)
    out = proc.stdout
    assert "2 images, 4 captions added" in out
    for reason in (
        "empty caption: 2",
        "missing image file: 1",
        "caption not valid UTF-8: 1",
        "unparseable line: 1",
        "caption not a string: 1",
    ):
        assert reason in out, out
    cache = CaptionCache(tmp_path / "cache")
    rows = cache.read_captions().to_pylist()
    a = sha256_file(root / "a.png")
    texts_a = [r["text"] for r in sorted(rows, key=lambda r: r["sample"]) if r["image_sha256"] == a]
    assert texts_a == ["a red square", "red again", "a third red caption"]
    assert {r["prompt_id"] for r in rows} == {"annotation"}
    assert cache.read_failures().to_pylist()[0]["source_id"] == "missing.png"
    (recipe,) = cache.recipes().values()
    assert recipe.recipe["kind"] == "annotations" and recipe.recipe["source_sha256"] == sha256_file(ann)
    again = tcjepa("caption", "--cache", tmp_path / "cache", "--annotations", ann, "--image-root", root).stdout
    assert "0 captions added, 4 already cached" in again
    assert len(cache.shard_ids()) == 1


def test_coco_import(tmp_path):
    _image(tmp_path / "imgs" / "1.jpg", "green")
    _image(tmp_path / "imgs" / "2.jpg", "white")
    coco = {
        "images": [
            {"id": 1, "file_name": "1.jpg"},
            {"id": 2, "file_name": "2.jpg"},
            {"id": 3, "file_name": "gone.jpg"},
        ],
        "annotations": [
            {"id": 11, "image_id": 1, "caption": "second by id"},
            {"id": 10, "image_id": 1, "caption": "first by id"},
            {"id": 12, "image_id": 2, "caption": "A white image."},
            {"id": 13, "image_id": 3, "caption": "lost"},
            {"id": 14, "image_id": 99, "caption": "no such image"},
        ],
    }
    ann = tmp_path / "captions_train.json"
    ann.write_text(json.dumps(coco))
    out = tcjepa(
        "caption", "--cache", tmp_path / "cache", "--annotations", ann, "--image-root", tmp_path / "imgs"
    ).stdout
    assert (
        "2 images, 3 captions added" in out
        and "annotation for an unknown image: 1" in out
        and "missing image file: 1" in out
    )
    rows = CaptionCache(tmp_path / "cache").read_captions().to_pylist()
    one = sha256_file(tmp_path / "imgs" / "1.jpg")
    assert [r["text"] for r in sorted(rows, key=lambda r: r["sample"]) if r["image_sha256"] == one] == [
        "first by id",
        "second by id",
    ]
    (recipe,) = CaptionCache(tmp_path / "cache").recipes().values()
    assert recipe.recipe["format"] == "coco" and recipe.name == "captions_train"


def test_unusable_annotation_files_fail_with_one_line(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    not_coco = tmp_path / "x.json"
    not_coco.write_text("[1, 2]")
    only_missing = tmp_path / "m.jsonl"
    only_missing.write_text(json.dumps({"image": "nope.png", "captions": ["x"]}) + "\n")
    for path, needle in [
        (bad_json, "not valid JSON"),
        (not_coco, "expected COCO"),
        (tmp_path / "absent.jsonl", "no such file"),
        (only_missing, "no usable caption"),
    ]:
        proc = refused("caption", "--cache", tmp_path / "cache", "--annotations", path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


def test_an_import_is_usable_when_it_finds_a_caption_new_or_already_cached():
    """The rule `caption --annotations` refuses by: no caption added and none already cached."""
    inputs = [Path("a.jsonl"), Path("b.tar"), Path("c.tar"), Path("d.tar")]
    nothing = ImportReport("0" * 64, skipped=Counter({"missing image file": 2}))
    with pytest.raises(UserError) as caught:
        nothing.check_usable(inputs)
    assert (
        str(caught.value) == "--annotations a.jsonl b.tar c.tar: no usable caption (skipped: {'missing image file': 2})"
    )
    ImportReport("0" * 64, captions_added=1).check_usable(inputs)
    ImportReport("0" * 64, captions_already_cached=1).check_usable(inputs)


# ---- captions that sit beside the images: WebDataset shards, tables, hf: sources ---------------------------------


def _png(colour: str) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def _tar(path, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_shards_import_their_txt_and_json_captions_and_skip_bad_samples(tmp_path):
    shards = tmp_path / "shards"
    _tar(
        shards / "000000.tar",
        [
            ("s/0001.jpg", _png("red")),
            ("s/0001.txt", b"a red square\n\n  on grey  \n"),
            ("s/0002.png", _png("blue")),
            ("s/0002.json", json.dumps({"captions": ["blue one", "", 5]}).encode()),
            ("s/0003.txt", b"a caption without an image"),
            ("s/0004.png", _png("green")),
            ("s/0004.json", b"{broken"),
            ("s/0005.a.png", _png("white")),
            ("s/0005.a.json", json.dumps({"caption": "white, key with a dot"}).encode()),
        ],
    )
    _tar(shards / "more" / "000001.tar", [("0006.jpg", _png("black")), ("0006.txt", b"\xff\xfe not utf-8")])
    out = tcjepa("caption", "--annotations", shards, "--cache", tmp_path / "cache", "--recipe", "wds").stdout
    assert "3 images, 4 captions added" in out, out
    for reason in (
        "sample without an image: 1",
        "unparseable JSON caption: 1",
        "caption not valid UTF-8: 1",
        "empty caption: 1",
        "caption not a string: 1",
        "image without captions: 2",
    ):
        assert reason in out, (reason, out)
    cache = CaptionCache(tmp_path / "cache")
    rows = sorted(cache.read_captions().to_pylist(), key=lambda r: (r["source_id"], r["sample"]))
    assert [(r["source_id"], r["text"]) for r in rows] == [
        ("000000.tar::s/0001.jpg", "a red square"),
        ("000000.tar::s/0001.jpg", "on grey"),
        ("000000.tar::s/0002.png", "blue one"),
        ("000000.tar::s/0005.a.png", "white, key with a dot"),
    ]
    # Images are identified by content, with the source ids that `tcjepa caption` / `train` give them.
    from pipeline.core.recipes import sha256_bytes
    from pipeline.core.sources import iter_images

    by_source = {e.source_id: sha256_bytes(e.data) for e in iter_images([shards]) if e.data}
    assert all(by_source[r["source_id"]] == r["image_sha256"] for r in rows)
    again = tcjepa(
        "caption", "--annotations", shards / "000000.tar", shards / "more" / "000001.tar", "--cache", tmp_path / "cache"
    ).stdout
    assert "0 captions added, 4 already cached" in again and len(cache.recipes()) == 1


def test_parquet_and_datasets_tables_import_a_caption_column(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [_png(c) for c in ("red", "blue", "green")]
    table = pa.table({"img": images, "text": [["red", "a red one"], ["blue"], [""]], "caption": ["r", "b", "g"]})
    pq.write_table(table, tmp_path / "t.parquet")
    out = tcjepa(
        "caption",
        "--annotations",
        tmp_path / "t.parquet",
        "--caption-column",
        "text",
        "--image-column",
        "img",
        "--cache",
        tmp_path / "c1",
    ).stdout
    assert "2 images, 3 captions added" in out and "empty caption: 1" in out
    rows = CaptionCache(tmp_path / "c1").read_captions().to_pylist()
    assert sorted((r["source_id"], r["text"]) for r in rows) == [
        ("t.parquet::0", "a red one"),
        ("t.parquet::0", "red"),
        ("t.parquet::1", "blue"),
    ]
    # A datasets directory with a string caption column, and a missing --caption-column refused in one line.
    ds = datasets.Dataset.from_dict({"image": images, "caption": ["r", "b", "g"]}).cast_column(
        "image", datasets.Image()
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    out = tcjepa(
        "caption", "--annotations", tmp_path / "saved", "--caption-column", "caption", "--cache", tmp_path / "c2"
    ).stdout
    assert "3 images, 3 captions added" in out
    refusal = refused("caption", "--annotations", tmp_path / "saved", "--cache", tmp_path / "c3")
    assert refusal.returncode == 2 and "need --caption-column" in refusal.stderr
    wrong = refused(
        "caption",
        "--annotations",
        tmp_path / "t.parquet",
        "--caption-column",
        "nope",
        "--cache",
        tmp_path / "c3",
    )
    assert wrong.returncode == 2 and "has no column 'nope'" in wrong.stderr


def test_hf_sources_go_through_load_dataset_for_local_data_dirs_as_for_hub_ids(tmp_path):
    """`hf:DIR` opens an imagefolder (with metadata.jsonl captions) and a Parquet data dir through
    `datasets.load_dataset`, streamed in order and at random for training; the split can be named in the spec."""
    from pipeline.core.recipes import sha256_bytes
    from pipeline.core.sources import ImageReader, iter_images, list_images

    folder = tmp_path / "imagefolder" / "train"
    folder.mkdir(parents=True)
    meta = []
    for i, colour in enumerate(("red", "blue", "green")):
        (folder / f"{i}.png").write_bytes(_png(colour))
        meta.append(json.dumps({"file_name": f"{i}.png", "text": f"a {colour} square"}))
    (folder / "metadata.jsonl").write_text("\n".join(meta) + "\n")
    spec = f"hf:{tmp_path / 'imagefolder'}"
    streamed = list(iter_images([spec]))
    assert [e.source_id for e in streamed] == [f"{spec}[train]::{i}" for i in range(3)]
    refs = list_images([spec])
    reader = ImageReader()
    assert [r.source_id for r in refs] == [e.source_id for e in streamed]
    assert [sha256_bytes(reader.read(r)) for r in refs] == [sha256_bytes(e.data) for e in streamed]
    out = tcjepa("caption", "--annotations", spec, "--caption-column", "text", "--cache", tmp_path / "c").stdout
    assert "3 images, 3 captions added" in out
    # A Parquet data dir with a validation split, named in the spec or with --split.
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "pq" / "data"
    data.mkdir(parents=True)
    pq.write_table(
        pa.table({"image": [{"bytes": _png("white"), "path": None}], "caption": ["white"]}),
        data / "validation-00000-of-00001.parquet",
    )
    pq.write_table(
        pa.table({"image": [{"bytes": _png("black"), "path": None}], "caption": ["black"]}),
        data / "train-00000-of-00001.parquet",
    )
    named = list(iter_images([f"hf:{tmp_path / 'pq'}[validation]"]))
    flag = list(iter_images([f"hf:{tmp_path / 'pq'}"], split="validation"))
    assert [e.data for e in named] == [e.data for e in flag] == [_png("white")]
    missing = refused(
        "caption",
        "--annotations",
        f"hf:{tmp_path / 'nowhere'}",
        "--caption-column",
        "caption",
        "--cache",
        tmp_path / "c4",
    )
    assert missing.returncode == 2 and "datasets.load_dataset cannot open it" in missing.stderr
