"""Import existing captions into the caption cache: our JSONL, COCO captions JSON, the captions that sit beside the
images in WebDataset tar shards (``.txt``, ``.json`` members), or a caption column of a Parquet / HF datasets table.

An import is a recipe of kind ``annotations`` keyed by its source (an annotation
file's sha256; the names and sizes of tar shards and tables), so importing the
same source twice adds nothing. Images are identified by the sha256 of their
bytes, as everywhere. Bad entries never stop an import: missing images, samples
without an image, empty or non-text captions, captions that are not valid UTF-8,
unparseable lines and broken JSON are counted, reported and skipped, and rows are
published only in whole shards.
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
from pipeline.core.recipes import sha256_bytes, sha256_file
from pipeline.core.sources import DEFAULT_SPLIT, describe_sources, iter_samples

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

    def check_usable(self, inputs: list[Path]) -> None:
        """Refuse an import that found no usable caption in `inputs` (none added, none already cached)."""
        if self.captions_added + self.captions_already_cached == 0:
            shown = " ".join(map(str, inputs[:3]))
            raise UserError(f"--annotations {shown}: no usable caption (skipped: {dict(self.skipped)})")


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


ANNOTATION_SUFFIXES = (".json", ".jsonl")


def import_captions(
    cache: CaptionCache,
    inputs: list[Path],
    image_root: Path | None = None,
    name: str | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
    split: str = DEFAULT_SPLIT,
) -> ImportReport:
    """Import one annotation file (JSONL, COCO JSON), or the captions beside the images of `inputs` (tar shards,
    folders of them, Parquet files, HF datasets, ``hf:`` sources; tables need `caption_column`)."""
    files = [Path(p) for p in inputs]
    annotation_files = [p for p in files if p.suffix.lower() in ANNOTATION_SUFFIXES]
    if annotation_files:
        if len(files) > 1:
            raise UserError(
                "--annotations: give one JSONL / COCO file, or image sources that hold captions (tar shards, "
                "tables), not both"
            )
        return import_annotations(cache, files[0], image_root, name)
    return import_from_sources(cache, files, name, caption_column, image_column, split)


def import_from_sources(
    cache: CaptionCache,
    inputs: list[Path],
    name: str | None = None,
    caption_column: str | None = None,
    image_column: str | None = None,
    split: str = DEFAULT_SPLIT,
) -> ImportReport:
    """Import the captions each sample of `inputs` holds beside its image, committing every ROWS_PER_SHARD rows."""
    recipe = {
        "kind": "annotations",
        "format": "samples",
        "sources": describe_sources(inputs, split),
        "caption_column": caption_column,
        "text_normalisation": "strip",
    }
    recipe_id = cache.add_recipe(recipe, name or Path(str(inputs[0])).stem)
    report = ImportReport(recipe_id)
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for sample in iter_samples(inputs, image_column, caption_column, split):
        for problem in sample.problems:
            report.skipped[problem] += 1
        texts = [t for t in (_clean_caption(c, report.skipped) for c in sample.captions) if t is not None]
        if sample.image is None:
            report.skipped["sample without an image"] += 1
            continue
        if not texts:
            report.skipped["image without captions"] += 1
            continue
        if sample.image.data is None:
            report.skipped["unreadable image"] += 1
            failures.append(
                {
                    "image_sha256": None,
                    "source_id": sample.image.source_id,
                    "recipe": recipe_id,
                    "reason": sample.image.error or "unreadable",
                }
            )
            continue
        digest = sha256_bytes(sample.image.data)
        report.images += 1
        rows.extend(
            caption_row(digest, sample.image.source_id, recipe_id, PROMPT_ID, k, text, FINISH_REASON)
            for k, text in enumerate(texts)
        )
        if len(rows) >= ROWS_PER_SHARD:
            _commit(cache, rows, failures, report)
            rows, failures = [], []
    _commit(cache, rows, failures, report)
    return report


def _commit(
    cache: CaptionCache, rows: list[dict[str, Any]], failures: list[dict[str, Any]], report: ImportReport
) -> None:
    if rows or failures:
        result = cache.commit(rows, failures)
        report.captions_added += result.captions_added
        report.captions_already_cached += result.captions_duplicate


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
    entries = _read_jsonl(path, report.skipped) if doc is None else _read_coco(doc, report.skipped)

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

    rows: list[dict[str, Any]] = []
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
