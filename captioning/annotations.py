"""Import existing captions (our JSONL, COCO captions JSON) into the caption cache.

An import is a recipe of kind ``annotations`` keyed by the source file's sha256,
so importing the same file twice adds nothing. Bad entries never stop an
import: missing image files, empty or whitespace captions, captions that are not
valid UTF-8 and unparseable lines are counted, reported and skipped, and rows
are published only in whole shards.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.cache import CaptionCache, caption_row
from pipeline.core.errors import UserError
from pipeline.core.recipes import sha256_file

PROMPT_ID = "annotation"
FINISH_REASON = "annotation"
ROWS_PER_SHARD = 500_000


@dataclass
class ImportReport:
    recipe: str
    images: int = 0
    captions_added: int = 0
    captions_already_cached: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        return (
            f"recipe {self.recipe[:12]}: {self.images} images, {self.captions_added} captions added, "
            f"{self.captions_already_cached} already cached; skipped: {skipped}"
        )


def _clean_caption(value: Any, skipped: Counter) -> str | None:
    """The caption text with outer whitespace removed, or None (counted) when unusable."""
    if not isinstance(value, str):
        skipped["caption not a string"] += 1
        return None
    text = value.strip()
    if not text:
        skipped["empty caption"] += 1
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        skipped["caption not valid UTF-8"] += 1
        return None
    return text


def _read_jsonl(path: Path, skipped: Counter) -> Iterator[tuple[str, list[Any]]]:
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw.decode("utf-8", errors="surrogateescape"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                skipped["unparseable line"] += 1
                continue
            if not isinstance(entry, dict) or not isinstance(entry.get("image"), str):
                skipped["entry without an image path"] += 1
                continue
            captions = entry.get("captions", entry.get("caption", []))
            yield entry["image"], captions if isinstance(captions, list) else [captions]


def _read_coco(doc: dict[str, Any], skipped: Counter) -> Iterator[tuple[str, list[Any]]]:
    files = {}
    for image in doc.get("images", []):
        if isinstance(image, dict) and "id" in image and isinstance(image.get("file_name"), str):
            files[image["id"]] = image["file_name"]
        else:
            skipped["image entry without id/file_name"] += 1
    by_image: dict[Any, list[tuple[Any, Any]]] = {}
    for ann in doc.get("annotations", []):
        if not isinstance(ann, dict) or ann.get("image_id") not in files:
            skipped["annotation for an unknown image"] += 1
            continue
        by_image.setdefault(ann["image_id"], []).append((ann.get("id", 0), ann.get("caption")))
    for image_id, anns in by_image.items():
        anns.sort(key=lambda a: (str(type(a[0])), a[0]))
        yield files[image_id], [caption for _, caption in anns]


def _detect_format(path: Path) -> tuple[str, dict[str, Any] | None]:
    """("jsonl", None) or ("coco", parsed document)."""
    if path.suffix.lower() == ".jsonl":
        return "jsonl", None
    try:
        doc = json.loads(path.read_bytes().decode("utf-8", errors="surrogateescape"))
    except json.JSONDecodeError as exc:
        if path.suffix.lower() == ".json":
            raise UserError(
                f"--annotations {path}: not valid JSON ({exc.msg} at line {exc.lineno}); expected COCO captions JSON "
                "or JSONL"
            ) from None
        return "jsonl", None
    if isinstance(doc, dict) and "images" in doc and "annotations" in doc:
        return "coco", doc
    raise UserError(
        f"--annotations {path}: JSON without 'images' and 'annotations'; expected COCO captions JSON, or JSONL lines "
        f'{{"image": ..., "captions": [...]}}'
    )


def import_annotations(
    cache: CaptionCache, path: Path, image_root: Path | None = None, name: str | None = None
) -> ImportReport:
    """Import `path` (JSONL or COCO JSON) into `cache`; image paths resolve against `image_root`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--annotations {path}: no such file")
    image_root = Path(image_root) if image_root is not None else path.parent
    if not image_root.is_dir():
        raise UserError(f"--image-root {image_root}: no such directory")
    fmt, doc = _detect_format(path)
    recipe = {"kind": "annotations", "format": fmt, "source_sha256": sha256_file(path), "text_normalisation": "strip"}
    recipe_id = cache.add_recipe(recipe, name or path.stem)
    report = ImportReport(recipe_id)
    entries = _read_jsonl(path, report.skipped) if fmt == "jsonl" else _read_coco(doc, report.skipped)

    captions_by_image: dict[str, tuple[str, list[str]]] = {}
    image_hashes: dict[str, str | None] = {}
    failures = []
    for rel, raw_captions in entries:
        if rel not in image_hashes:
            image_path = image_root / rel
            try:
                image_hashes[rel] = sha256_file(image_path) if image_path.is_file() else None
            except OSError:
                image_hashes[rel] = None
            if image_hashes[rel] is None:
                report.skipped["missing image file"] += 1
                failures.append(
                    {
                        "image_sha256": None,
                        "source_id": rel,
                        "recipe": recipe_id,
                        "reason": "missing or unreadable image file",
                    }
                )
        digest = image_hashes[rel]
        if digest is None:
            continue
        texts = [t for t in (_clean_caption(c, report.skipped) for c in raw_captions) if t is not None]
        captions_by_image.setdefault(digest, (rel, []))[1].extend(texts)

    rows = []
    for digest, (rel, texts) in captions_by_image.items():
        if texts:
            report.images += 1
        rows.extend(
            caption_row(digest, rel, recipe_id, PROMPT_ID, i, text, FINISH_REASON) for i, text in enumerate(texts)
        )
    for start in range(0, max(len(rows), 1), ROWS_PER_SHARD):
        result = cache.commit(rows[start : start + ROWS_PER_SHARD], failures if start == 0 else None)
        report.captions_added += result.captions_added
        report.captions_already_cached += result.captions_duplicate
    return report
