"""Learning curves: each probe's figure at every step a run kept, drawn against its floors.

A probe read once, at the end, cannot tell a run that never learned from one that learned and forgot; the curve
shows when learning starts, if it does, and where it stands against the random-init encoder and raw pixels.
Written beside the reports as `NAME[.context].curves.png` and `.curves.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from evaluation.protocol import FLOORS
from evaluation.summary import floor_figures, probe_figures
from pipeline.core.fsutil import atomic_write_bytes


def curve_table(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, each probe figure per step, and each floor's figures (from the report that measured them)."""
    steps = [int(r["step"]) for r in reports]
    figures = [probe_figures(r["probes"]) for r in reports]
    names = sorted({name for f in figures for name in f})
    measured = next((r for r in reports if all(floor in r for floor in FLOORS)), reports[0])
    return {
        "encoder": reports[0].get("encoder", "target"),
        "steps": steps,
        "probes": {name: [f.get(name, math.nan) for f in figures] for name in names},
        "floors": floor_figures(measured),
    }


def plot_learning_curves(reports: list[dict[str, Any]], base: Path) -> Path:
    """Draw `curve_table(reports)`, one panel per probe figure, floors as dashed lines, into `base` with the
    suffixes `.curves.png` and `.curves.json` (for `base` `RUN/eval/NAME.json`); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = curve_table(reports)
    atomic_write_bytes(base.with_suffix(".curves.json"), (json.dumps(table, indent=1) + "\n").encode())
    names = list(table["probes"])
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        ax.plot(table["steps"], table["probes"][name], marker="o", label=f"{table['encoder']} encoder")
        for (floor, values), style in zip(table["floors"].items(), ("--", ":", "-.")):
            if name in values:
                ax.axhline(values[name], linestyle=style, color="grey", label=floor)
        ax.set_title(name)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    out = base.with_suffix(".curves.png")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out)
    return out
