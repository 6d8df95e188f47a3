import json

from PIL import Image

from captioning.cache import CaptionCache
from pipeline.core.recipes import sha256_file
from tests.conftest import tcjepa


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
        proc = tcjepa("caption", "--cache", tmp_path / "cache", "--annotations", path, check=False)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
