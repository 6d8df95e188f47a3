"""What every benchmark shares: the environment, the repository root, the CLI in a subprocess, the final JSON line.

Imported first by each benchmark, so the hub is offline before transformers loads, and the library functions a
benchmark calls in its own process say what they say on stderr as under the CLI (`pipeline.core.logs`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.core import logs

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
logs.configure()


def tcjepa(*args: Any, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run `tcjepa ARGS` (`python -m pipeline`) from the repository root; exit with its stderr's tail when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)], cwd=ROOT, capture_output=True, text=True, **kwargs
    )
    if check and proc.returncode != 0:
        raise SystemExit(
            f"tcjepa {' '.join(map(str, args[:2]))} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return proc


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), in MiB.

    Not `ru_maxrss`: Linux carries that across exec, so a process that Python's subprocess spawned (vfork, then
    exec) reports at least its parent's peak, and a small worker started by a large pytest worker measures nothing.
    """
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return kib / 1024


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) again from what it holds now (Linux's `clear_refs` 5), so
    that a peak read later is the peak since this call."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def print_result(result: dict[str, Any]) -> None:
    """The benchmark's last line: one JSON object."""
    print(json.dumps(result), flush=True)


# ImageNet-like shapes: landscape, portrait, and a wider landscape.
PHOTO_SIZES = ((500, 375), (375, 500), (500, 333))


def write_jpegs(
    folder: Path, n: int, seed: int, sizes: tuple[tuple[int, int], ...] = PHOTO_SIZES, quality: int = 90
) -> list[Path]:
    """`n` photo-like JPEGs in `folder` (created): smooth random scenes with texture, taking `sizes` in turn."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    paths = []
    for i in range(n):
        width, height = sizes[i % len(sizes)]
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        scene = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
        texture = rng.normal(0, 12, (height, width, 1)) * rng.uniform(0.5, 1.5, (1, 1, 3))
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(np.clip(scene + texture, 0, 255).astype(np.uint8)).save(path, quality=quality)
        paths.append(path)
    return paths
