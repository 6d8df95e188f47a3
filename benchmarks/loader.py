"""The input pipeline's throughput: caption reads, and whole training batches per core.

Caption reads: builds a store of random float16 "token embeddings" with a long-tailed
length mix, then reads random training batches (images × captions per image) into one
packed `[tokens, d]` array three ways, over the same bytes, warm page cache:
  reader  EmbeddingReader.gather_packed (our shard-index memory maps)
  memmap  np.memmap of one flat copy of the tokens + offsets (the upper bound)
  zarr    zarr.Array slicing, one read per caption (zarr's own path)

End to end: generated ImageNet-like JPEGs (~500×375, quality 90) and N captions of
`--words` tokens each at width `--d-text`, in a float16 and an int8 store; a DataLoader
worker makes 224-px training batches (`StepBatches`: header-first crops, draft-mode
decode, antialiased bilinear, packed captions in shared memory) and, alternating with
it in the same run, a reference of the path it replaced (full decode, bicubic, a sha256
per read, captions padded in the worker's memory and copied into shared memory when
handed over). Images per CPU-second of the worker process (all its threads, the
hand-over's copies included) is the per-core rate; the median over rounds counts.

Prints one JSON line with captions/s of each reader, the per-core images/s of each
loader and their ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import zarr
from PIL import Image

from benchmarks.common import print_result, write_jpegs  # first: sets the offline environment
from embedding_cache.reader import EmbeddingReader, Spans, StoreKeys
from embedding_cache.store import EmbeddingStore, TokenLayout
from embedding_cache.transform import fit_transform
from pipeline.core.images import decode
from pipeline.core.recipes import text_key
from pipeline.core.refs import ImageRef
from pipeline.core.sources import ImageReader
from train.config import TrainConfig
from train.data import Batch, StepBatches, crop_box, image_policy
from train.data_index import TrainIndex
from train.masks import Masks


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


def caption_reads(args: argparse.Namespace) -> dict[str, Any]:
    """Captions/s of our reader, a raw memmap and zarr over one store."""
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
        return result


def jpeg_images(folder: Path, n: int, seed: int) -> list[ImageRef]:
    """`n` ImageNet-like JPEGs (quality 90): smooth random scenes with texture, 500×375, some portrait or 500×333."""
    return [ImageRef(path.name, "file", str(path)) for path in write_jpegs(folder, n, seed)]


def text_store(path: Path, codec: str, keys: list[bytes], words: int, d: int, seed: int) -> None:
    """A store of `keys`, each `words` random token vectors of width `d` with T5-like loud channels."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((len(keys) * words, d)).astype(np.float32)
    vectors[:, [3, d // 2, d - 5]] *= 50.0
    recipe: dict[str, Any] = {"kind": "benchmark", "d": d, "storage_dtype": codec}
    transform = None
    if codec == "int8":
        entries, transform = fit_transform(vectors[:8192], "int8", None, captions=len(keys))
        recipe.update(entries)
    store = EmbeddingStore.open_or_create(path, recipe, d, transform=transform)
    writer = store.new_segment()
    for i, key in enumerate(keys):
        writer.append(key, vectors[i * words : (i + 1) * words].astype(np.float16))
    writer.finish()
    store.publish(writer)


class ReferenceBatches(StepBatches):
    """The loader as it was: every image decoded whole and resized bicubic, its sha256 checked on every read, the
    captions zero-padded (and int8 dequantized) in the worker, all in private memory, so handing the batch over
    copies it into shared memory."""

    def make_batch(
        self, ids: np.ndarray, rngs: Sequence[np.random.Generator | None], masks: Masks, pool: np.ndarray
    ) -> Batch:
        size = self.cfg.image_size
        reader, policy = ImageReader(), image_policy(size)
        images = np.empty((len(ids), 3, size, size), dtype=np.uint8)
        for k, (i, rng) in enumerate(zip(ids.tolist(), rngs)):
            data = reader.read(self.index.refs[i])
            if hashlib.sha256(data).hexdigest() != self.index.sha256[i]:
                raise RuntimeError("changed")
            im, _ = decode(data, policy)
            assert im is not None and rng is not None
            box = crop_box(rng, im.width, im.height, self.cfg.crop_scale, self.cfg.crop_ratio)
            out = im.resize((size, size), Image.Resampling.BICUBIC, box=box)
            images[k] = np.asarray(out, dtype=np.uint8).transpose(2, 0, 1)
        if self._store is None:
            self._store = EmbeddingReader(self.cfg.text_store)
        assert self.caption_spans is not None
        n, offsets, spans = self.cfg.captions_per_image, self.index.caption_offsets, self.caption_spans
        chosen = []  # every image of the benchmark has exactly n captions
        for i, rng in zip(ids.tolist(), rngs):
            picks = np.arange(offsets[i], offsets[i + 1])
            if len(picks) > n and rng is not None:
                picks = picks[np.sort(rng.choice(len(picks), n, replace=False))]
            chosen.append(picks[:n])
        rows = np.concatenate(chosen)
        picked = Spans(spans.segment[rows], spans.start[rows], spans.length[rows])
        padded, lengths = self._store.gather_spans_padded(picked, max_len=self.cfg.max_words)
        return Batch(
            torch.from_numpy(images),
            torch.from_numpy(masks.context),
            torch.from_numpy(masks.context_lengths),
            torch.from_numpy(masks.targets),
            torch.from_numpy(padded).view(len(ids), n, *padded.shape[1:]),
            torch.from_numpy(lengths).view(len(ids), n),
            0,
        )


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of process `pid` so far: on Linux each thread's run time in ns (schedstat), since
    the clock ticks psutil counts in (10 ms) can count none for a few small batches; elsewhere psutil's."""
    tasks = Path(f"/proc/{pid}/task")
    if (tasks / str(pid) / "schedstat").exists():
        nanoseconds = 0
        for task in tasks.iterdir():
            try:
                nanoseconds += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                continue
        return nanoseconds / 1e9
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def images_per_core_s(dataset: StepBatches, batches: int, first_step: int) -> float:
    """Images per CPU-second of one DataLoader worker making `batches` batches (after one to warm up).

    One task in flight (prefetch 1): when a batch arrives the worker has just begun the next, so its CPU time from
    then until the last batch arrives (when it is idle) is that of exactly `batches` batches, hand-over included.
    Each batch is released on arrival, as the trainer releases it once it is on the device.
    """
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=range(first_step, first_step + batches + 1),
        num_workers=1,
        prefetch_factor=1,
    )
    it = iter(loader)
    next(it).release()
    worker = it._workers[0].pid  # type: ignore[attr-defined]
    before = _cpu_seconds(worker)
    for _ in range(batches):
        next(it).release()  # as the trainer does once the batch is on the device
    cpu = _cpu_seconds(worker) - before
    del it
    return batches * dataset.local / cpu


def end_to_end(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Per-core images/s of the loader and of the reference, side by side, for a float16 and an int8 store."""
    refs = jpeg_images(tmp / "images", args.images, args.seed)
    shas = [hashlib.sha256(Path(r.path).read_bytes()).hexdigest() for r in refs]
    rng = np.random.default_rng(args.seed)
    distinct = [text_key(f"caption {i}") for i in range(args.distinct_captions)]
    n = args.captions_per_image
    picks = np.stack([rng.choice(len(distinct), n, replace=False) for _ in refs])
    keys = np.frombuffer(b"".join(distinct[j] for j in picks.reshape(-1)), dtype=np.uint8).reshape(-1, 32)
    out: dict[str, Any] = {
        "jpeg_kb_mean": round(float(np.mean([Path(r.path).stat().st_size for r in refs])) / 1024, 1),
        "e2e_batch": f"{args.images_per_step}x{n}x{args.words}x{args.d_text}",
    }
    for codec in ("float16", "int8"):
        store = tmp / f"store-{codec}"
        text_store(store, codec, distinct, args.words, args.d_text, args.seed)
        segments, spans = StoreKeys(EmbeddingStore(store)).spans(keys)  # resolved once, as `build_index` does
        offsets = np.arange(len(refs) + 1, dtype=np.int64) * n
        index = TrainIndex(refs, shas, offsets, keys, [], {n: len(refs)}, segments=segments, spans=spans)
        cfg = TrainConfig(
            images=[str(tmp / "images")],
            cache="unused",
            store=str(store),
            image_size=224,
            patch_size=16,
            batch_size=args.images_per_step,
            steps=10**6,
            captions_per_image=n,
            max_words=args.words,
            seed=args.seed,
        )
        ours = StepBatches(index, np.arange(len(refs)), cfg, (14, 14))
        reference = ReferenceBatches(index, np.arange(len(refs)), cfg, (14, 14))
        rates: dict[str, list[float]] = {"loader": [], "reference": []}
        for r in range(args.e2e_rounds):  # alternate, so both see the same machine state
            first = r * (args.e2e_batches + 1)
            rates["loader"].append(images_per_core_s(ours, args.e2e_batches, first))
            rates["reference"].append(images_per_core_s(reference, args.e2e_batches, first))
        loader, ref = float(np.median(rates["loader"])), float(np.median(rates["reference"]))
        out[f"{codec}_loader_images_per_core_s"] = round(loader, 1)
        out[f"{codec}_reference_images_per_core_s"] = round(ref, 1)
        out[f"{codec}_loader_vs_reference"] = round(loader / ref, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--captions", type=int, default=40_000)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--images-per-batch", type=int, default=256)
    ap.add_argument("--captions-per-image", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of reader and memmap; the median counts")
    ap.add_argument("--images", type=int, default=48, help="end to end: generated JPEGs")
    ap.add_argument("--distinct-captions", type=int, default=96, help="end to end: captions in each store")
    ap.add_argument("--words", type=int, default=128, help="end to end: tokens per caption (all kept: max_words)")
    ap.add_argument("--d-text", type=int, default=1024, help="end to end: token width (t5-large)")
    ap.add_argument("--images-per-step", type=int, default=16, help="end to end: images per batch")
    ap.add_argument("--e2e-batches", type=int, default=10, help="end to end: batches timed per round")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="end to end: alternating rounds; the median counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"benchmark": "loader", **end_to_end(args, Path(tmp)), **caption_reads(args)}
    print_result(result)


if __name__ == "__main__":
    main()
