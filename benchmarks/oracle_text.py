"""Diagnostic: how far does the ratio true/shuffled fall when the caption vectors bind perfectly?

Builds an embedding store whose entry for each caption of a `tcjepa synth` scene is one
token per object, one-hot (row, column, colour, shape), under the same caption keys the
cache holds, then trains `cross` on it with the given config and prints the validation
ratio val_loss_predict / val_loss_predict_shuffled at every validation, side by side with
a run on a real store when `--store` is given. The trainer cannot tell the stores apart,
so the gap between the two runs is what the caption encoder costs.

  python -m benchmarks.oracle_text --synth data --cache cache --store store \\
      --config configs/cpu_synth_cross.yaml --work /tmp/oracle
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, print_result, tcjepa  # first: sets the offline environment
from captioning.cache import CaptionCache
from embedding_cache.store import EmbeddingStore, TokenLayout
from pipeline.devkit import synth

WIDTH = 32  # 4 rows + 4 columns + 8 colours + 5 shapes = 21 one-hot slots, padded


def object_tokens(cells: np.ndarray, bound: bool = True) -> np.ndarray:
    """float16 tokens of a scene's objects: bound, one token per object, one-hot row, column, colour and shape together
    (`[objects, WIDTH]`); unbound, four tokens per object, one attribute each (`[4 × objects, WIDTH]`), a perfect
    bag of words."""
    rows = []
    shapes = len(synth.SHAPES)
    for r, c in zip(*np.nonzero(cells > 0)):
        colour, shape = divmod(int(cells[r, c]) - 1, shapes)
        slots = [r, 4 + c, 8 + colour, 16 + shape]
        for group in [slots] if bound else [[s] for s in slots]:
            v = np.zeros(WIDTH, dtype=np.float16)
            v[group] = 1
            rows.append(v)
    return np.stack(rows) if rows else np.zeros((1, WIDTH), dtype=np.float16)


def build_oracle_store(synth_dir: Path, cache: Path, out: Path, bound: bool = True) -> int:
    """Write the oracle store; returns how many captions it holds."""
    grid = json.loads((synth_dir / "labels.jsonl").read_text().splitlines()[0])["cells"]
    if len(grid) > 4 or len(grid[0]) > 4:
        raise SystemExit("the oracle encoding has slots for a 4×4 grid (tcjepa synth's default)")
    cells_of = {}
    for line in (synth_dir / "labels.jsonl").read_text().splitlines():
        row = json.loads(line)
        cells_of[hashlib.sha256((synth_dir / row["image"]).read_bytes()).hexdigest()] = np.array(row["cells"])
    table = CaptionCache.open_or_create(cache).read_captions(columns=["image_sha256", "text_sha256"])
    store = EmbeddingStore.open_or_create(
        out, {"kind": "oracle-one-hot-objects", "width": WIDTH, "bound": bound}, WIDTH
    )
    writer = store.new_segment(TokenLayout.for_bytes(WIDTH))
    seen: set[bytes] = set()
    for image, key in zip(table.column("image_sha256").to_pylist(), table.column("text_sha256").to_pylist()):
        key = bytes.fromhex(key) if isinstance(key, str) else key
        if key in seen or image not in cells_of:
            continue
        seen.add(key)
        writer.append(key, object_tokens(cells_of[image], bound))
    writer.finish()
    store.publish(writer)
    return len(seen)


def ratios(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: round(r["val_loss_predict"] / r["val_loss_predict_shuffled"], 4)
        for r in rows
        if "val_loss_predict" in r
    }


def train(synth_dir: Path, cache: Path, store: Path, config: Path, run: Path, extra: list[str]) -> dict[int, float]:
    tcjepa(
        "train",
        synth_dir / "images",
        "--cache",
        cache,
        "--store",
        store,
        "--out",
        run,
        "--config",
        config,
        "--no-progress",
        *extra,
    )
    return ratios(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synth", type=Path, required=True, help="A `tcjepa synth` directory.")
    parser.add_argument("--cache", type=Path, required=True, help="Caption cache with the scenes' captions imported.")
    parser.add_argument(
        "--store", type=Path, default=None, help="A real store of the same captions, to train on side by side."
    )
    parser.add_argument(
        "--config", type=Path, default=ROOT / "configs" / "cpu_synth_cross.yaml", help="Training config."
    )
    parser.add_argument("--work", type=Path, required=True, help="Directory for the oracle store and the runs.")
    parser.add_argument(
        "--unbound", action="store_true", help="One token per attribute instead of per object: a perfect bag of words."
    )
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="Extra `--set key=value` for both runs."
    )
    args = parser.parse_args()

    oracle = args.work / ("oracle-store-unbound" if args.unbound else "oracle-store")
    if not oracle.exists():
        print(
            f"oracle store: {build_oracle_store(args.synth, args.cache, oracle, bound=not args.unbound)} captions",
            file=sys.stderr,
        )
    extra = [x for kv in args.sets for x in ("--set", kv)]
    result = {
        "oracle": train(
            args.synth,
            args.cache,
            oracle,
            args.config,
            args.work / ("run-oracle-unbound" if args.unbound else "run-oracle"),
            extra,
        )
    }
    if args.store is not None:
        result["store"] = train(args.synth, args.cache, args.store, args.config, args.work / "run-store", extra)
    for name, curve in result.items():
        print(f"{name:>7}: " + "  ".join(f"{s}:{r:.3f}" for s, r in curve.items()), file=sys.stderr)
    last = {name: curve[max(curve)] for name, curve in result.items()}
    print_result(
        {
            "true_over_shuffled": result,
            "final": last,
            **({"final_store_over_oracle": round(last["store"] / last["oracle"], 4)} if "store" in last else {}),
        }
    )


if __name__ == "__main__":
    main()
