"""`tcjepa tiny-models`: the tiny T5 and tiny Qwen2-VL that tests, the demo and benchmarks use.

Both are built from nothing (no hub) and loaded only through
``from_pretrained(dir)``, the same path real checkpoints take. With a caption
corpus the T5 is first trained with span corruption on it and phrase tagging on
fresh synth scenes (`pipeline.devkit.tiny_t5`); a random T5 passes captions on as a bag
of words. What training does and does not change is
measured by `tiny_t5.binding_score` and `tiny_t5.probe_accuracy` (docs/cli.md,
"tcjepa tiny-models").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

T5_STEPS = 250  # phrase tagging right on 0.998 of held-out phrase tokens, probe colour-from-position 1.0 (docs/cli.md)


def read_caption_corpus(path: Path) -> list[str]:
    """All captions of a `captions.jsonl` (`{"image", "captions": [...]}` per line)."""
    if not Path(path).is_file():
        raise UserError(f"--t5-corpus {path}: no such file")
    texts: list[str] = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(
                f'--t5-corpus {path}: line {line_no} is not JSON; expected {{"image": ..., "captions": [...]}} per line'
            ) from None
        texts.extend(c.strip() for c in entry.get("captions", []) if isinstance(c, str) and c.strip())
    if not texts:
        raise UserError(f"--t5-corpus {path}: no captions found")
    return texts


def build_tiny_models(
    out: Path, t5_corpus: Path | None = None, t5_steps: int = T5_STEPS, seed: int = 0, t5_phrase_tags: bool = True
) -> dict[str, Any]:
    """Write `out/t5` and `out/vlm`; returns what was built (and the T5's binding score when trained)."""
    from pipeline.devkit.tiny_t5 import binding_score, build_tiny_t5, probe_accuracy
    from pipeline.devkit.tiny_vlm import build_tiny_vlm

    if t5_steps < 0:
        raise UserError(f"--t5-steps must be >= 0 (got {t5_steps})")
    out = Path(out)
    corpus = read_caption_corpus(t5_corpus) if t5_corpus is not None else None
    t5 = build_tiny_t5(out / "t5", corpus, steps=t5_steps if corpus else 0, seed=seed, phrase_tags=t5_phrase_tags)
    build_tiny_vlm(out / "vlm", seed=seed)
    stats: dict[str, Any] = {"t5": str(out / "t5"), "vlm": str(out / "vlm"), "t5_training": t5}
    stats["t5_binding_score"] = round(binding_score(out / "t5"), 4)
    if corpus:
        stats["t5_probe_accuracy"] = {k: round(v, 4) for k, v in probe_accuracy(out / "t5").items()}
    return stats
