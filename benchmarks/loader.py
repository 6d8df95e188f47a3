"""Caption read throughput: our memory-mapped reader vs raw np.memmap vs zarr's read path.

Builds a store of random float16 "token embeddings" with a long-tailed length
mix, then reads random training batches (images × captions per image) into one
packed `[tokens, d]` array three ways, over the same bytes, warm page cache:
  reader  EmbeddingReader.gather_packed (our shard-index memory maps)
  memmap  np.memmap of one flat copy of the tokens + offsets (the upper bound)
  zarr    zarr.Array slicing, one read per caption (zarr's own path)
Prints one JSON line with captions/s of each and the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from benchmarks.common import print_result  # first: sets the offline environment
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore, TokenLayout


def build_store(path: Path, n: int, d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.2, 0.6, size=n).astype(int), 5, 300)
    store = EmbeddingStore.open_or_create(path, {"kind": "benchmark", "d": d}, d)
    writer = store.new_segment(TokenLayout.for_bytes(d))
    block = rng.standard_normal((int(lengths.max()) + 1024, d)).astype(np.float16)
    for i, length in enumerate(lengths):
        key = i.to_bytes(8, "little") * 4
        start = int(rng.integers(0, 1024))
        writer.append(key, block[start : start + length])
    writer.finish()
    store.publish(writer)


def captions_per_s(read_batch, batches: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for rows in batches:
        read_batch(rows)
    return sum(len(r) for r in batches) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--captions", type=int, default=40_000)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--images-per-batch", type=int, default=256)
    ap.add_argument("--captions-per-image", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of reader and memmap; the median counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        build_store(path, args.captions, args.d_model, args.seed)
        reader = EmbeddingReader(path)
        (segment,) = reader.segment_ids
        group = zarr.open_group(str(path / "segments" / segment), mode="r")
        offsets = group["offsets"][:]
        ztokens = group["tokens"]
        flat = Path(tmp) / "flat.bin"
        group["tokens"][:].tofile(flat)
        raw = np.memmap(flat, dtype=np.float16, mode="r").reshape(-1, args.d_model)

        rng = np.random.default_rng(args.seed + 1)
        # each image's captions are adjacent in the store, as `tcjepa embed` writes them
        batches = []
        for _ in range(args.batches):
            first = rng.integers(0, args.captions - args.captions_per_image, size=args.images_per_batch)
            batches.append((first[:, None] + np.arange(args.captions_per_image)).reshape(-1))

        def packed(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            starts = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(offsets[rows + 1] - offsets[rows], out=starts[1:])
            return np.empty((int(starts[-1]), args.d_model), dtype=np.float16), starts

        def via_reader(rows: np.ndarray) -> None:
            reader.gather_packed(rows)

        def via_memmap(rows: np.ndarray) -> None:
            out, starts = packed(rows)
            for i, r in enumerate(rows):
                out[starts[i] : starts[i + 1]] = raw[offsets[r] : offsets[r + 1]]

        def via_zarr(rows: np.ndarray) -> None:
            out, starts = packed(rows)
            for i, r in enumerate(rows):
                out[starts[i] : starts[i + 1]] = ztokens[offsets[r] : offsets[r + 1]]

        for fn in (via_reader, via_memmap):  # warm the page cache
            for rows in batches:
                fn(rows)
        rounds = {"reader": [], "memmap": []}
        for _ in range(args.rounds):  # alternate, so both see the same machine state
            rounds["reader"].append(captions_per_s(via_reader, batches))
            rounds["memmap"].append(captions_per_s(via_memmap, batches))
        result = {
            "benchmark": "loader",
            "captions_in_store": args.captions,
            "d_model": args.d_model,
            "batch": f"{args.images_per_batch}x{args.captions_per_image}",
            "reader_captions_per_s": round(float(np.median(rounds["reader"]))),
            "memmap_captions_per_s": round(float(np.median(rounds["memmap"]))),
            "zarr_captions_per_s": round(captions_per_s(via_zarr, batches[:2])),
        }
        result["reader_vs_memmap"] = round(result["reader_captions_per_s"] / result["memmap_captions_per_s"], 3)
        result["reader_vs_zarr"] = round(result["reader_captions_per_s"] / result["zarr_captions_per_s"], 1)
        result["store_bytes_per_token"] = round(
            sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / int(offsets[-1]), 1
        )
        print_result(result)


if __name__ == "__main__":
    main()
