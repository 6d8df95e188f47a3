"""int8 stores against float16: fidelity, bytes on disk, reader throughput.

1. Real T5 output. `tcjepa synth` captions are embedded by `tcjepa embed` twice, with
   `--store-dtype float16` and `--store-dtype int8`, by each of: the tiny T5 trained on the
   captions (`tcjepa tiny-models --t5-corpus`, d = 64) and a random T5 at t5-base width (d = 768).
   Both runs batch alike, so T5's outputs are the same (checked: the int8 tokens equal the
   float16 store's vectors quantized again). Reported: the worst token cosine between the two
   stores (and what per-token absmax alone would give), the bytes on disk per token of each and
   their ratio, the pre-scaling the fit chose.
2. Planted outliers: Gaussian vectors with three channels 50/75/100× larger (as T5's are) at
   d = 1024 and 4096: the worst token cosine with per-token absmax alone and with the fitted
   pre-scaling, on vectors the fit did not see.
3. Reader: a store of random captions (long-tailed lengths, planted outlier channels) at
   `--d-model` in each codec; random training batches (images × captions per image) gathered
   with `gather_packed_raw` (what a trainer ships to the device), and int8's `gather_packed`
   (dequantized to float16 on the CPU); alternating rounds, the median counts. Also torch
   `dequantize` of one int8 batch on the CPU.

Prints one JSON line; `goals` holds the issue's targets (every token ≥ 0.999, int8 ≤ 0.55× bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import print_result, tcjepa  # first: sets the offline environment
from embedding_cache.codec import dequantize_numpy, fit_channel_scales, quantize_int8, token_cosines
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore
from embedding_cache.transform import fit_transform


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def random_t5(out: Path, tokenizer_from: Path, d_model: int, layers: int, seed: int) -> Path:
    """A random T5 encoder of width `d_model` with the tiny models' tokenizer."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=64,
        d_ff=4 * d_model,
        num_layers=layers,
        num_heads=max(d_model // 64, 1),
        feed_forward_proj="gated-gelu",
    )
    T5EncoderModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def compare_codecs(tmp: Path, cache: Path, model: Path, name: str) -> dict[str, Any]:
    """Embed `cache` with `model` into a float16 and an int8 store; their fidelity and size."""
    stores = {codec: tmp / f"{name}-{codec}" for codec in ("float16", "int8")}
    for codec, path in stores.items():
        tcjepa("embed", "--cache", cache, "--store", path, "--model", model, "--store-dtype", codec, "--no-progress")
    f16, i8 = EmbeddingReader(stores["float16"]), EmbeddingReader(stores["int8"])
    keys = np.concatenate([EmbeddingStore(stores["int8"]).read_keys(s) for s in i8.segment_ids])
    reference, _ = f16.gather_packed(f16.locate(keys))
    tokens, scales, _ = i8.gather_packed_raw(i8.locate(keys))
    again, _ = quantize_int8(reference, i8.channel_scales)
    cosines = token_cosines(reference, dequantize_numpy(tokens, scales, i8.channel_scales, np.float32))
    alone = token_cosines(reference, dequantize_numpy(*quantize_int8(reference, None), None, np.float32))
    n_tokens = len(reference)
    per_token = {codec: disk_bytes(path) / n_tokens for codec, path in stores.items()}
    fitted = EmbeddingStore(stores["int8"]).encoder["int8"]
    return {
        "d_model": f16.width,
        "captions": len(keys),
        "tokens": n_tokens,
        "same_t5_outputs": bool(np.array_equal(again, tokens)),
        "min_token_cosine": round(float(cosines.min()), 6),
        "p001_token_cosine": round(float(np.quantile(cosines, 0.001)), 6),
        "channel_alpha": fitted["channel_alpha"],
        "per_token_absmax_alone_min_cosine": round(float(alone.min()), 6),
        "float16_disk_bytes_per_token": round(per_token["float16"], 1),
        "int8_disk_bytes_per_token": round(per_token["int8"], 1),
        "int8_vs_float16_bytes": round(per_token["int8"] / per_token["float16"], 3),
    }


def planted(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, [3, d // 2, d - 5]] *= np.array([50.0, 75.0, 100.0], dtype=np.float32)
    return x.astype(np.float16)


def planted_outliers(d: int, n: int) -> dict[str, Any]:
    fit, held_out = planted(n, d, seed=0), planted(n, d, seed=1)
    tokens, scales = quantize_int8(held_out, None)
    alone = token_cosines(held_out, dequantize_numpy(tokens, scales, None, np.float32)).min()
    chosen = fit_channel_scales(fit.astype(np.float32))
    tokens, scales = quantize_int8(held_out, chosen.scales)
    fitted = token_cosines(held_out, dequantize_numpy(tokens, scales, chosen.scales, np.float32)).min()
    return {
        "per_token_absmax_min_cosine": round(float(alone), 6),
        "fitted_min_cosine": round(float(fitted), 6),
        "channel_alpha": chosen.alpha,
    }


def reader_throughput(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from embedding_cache.codec import dequantize

    rng = np.random.default_rng(args.seed)
    d = args.d_model
    lengths = np.clip(rng.lognormal(3.6, 0.6, size=args.captions).astype(int), 5, 128)
    block = planted(int(lengths.max()) + 1024, d, args.seed)
    starts = rng.integers(0, 1024, size=args.captions)
    readers = {}
    for codec in ("float16", "int8"):
        path = tmp / f"reader-{codec}"
        recipe: dict[str, Any] = {"kind": "benchmark", "d": d, "storage_dtype": codec}
        transform = None
        if codec == "int8":
            entries, transform = fit_transform(block[:4096], codec, None, captions=1)
            recipe.update(entries)
        store = EmbeddingStore.open_or_create(path, recipe, d, transform=transform)
        writer = store.new_segment()
        for i, (length, start) in enumerate(zip(lengths.tolist(), starts.tolist())):
            writer.append(i.to_bytes(8, "little") * 4, block[start : start + length])
        writer.finish()
        store.publish(writer)
        readers[codec] = EmbeddingReader(path)
    batches = []
    for _ in range(args.batches):
        first = rng.integers(0, args.captions - args.captions_per_image, size=args.images_per_batch)
        batches.append((first[:, None] + np.arange(args.captions_per_image)).reshape(-1))
    ways = {
        "float16_raw": lambda rows: readers["float16"].gather_packed_raw(rows),
        "int8_raw": lambda rows: readers["int8"].gather_packed_raw(rows),
        "int8_dequantized": lambda rows: readers["int8"].gather_packed(rows),
    }
    for way in ways.values():  # warm the page cache
        for rows in batches:
            way(rows)
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            for rows in batches:
                way(rows)
            rounds[name].append(sum(len(r) for r in batches) / (time.perf_counter() - start))
    speed = {name: float(np.median(v)) for name, v in rounds.items()}
    tokens, scales, _ = readers["int8"].gather_packed_raw(batches[0])
    channels = readers["int8"].channel_scales
    t, s = torch.from_numpy(tokens), torch.from_numpy(scales)
    c = None if channels is None else torch.from_numpy(channels)
    start = time.perf_counter()
    for _ in range(5):
        dequantize(t, s, c, torch.bfloat16)
    dequantize_ms = (time.perf_counter() - start) / 5 * 1000
    return {
        "d_model": d,
        "batch": f"{args.images_per_batch}x{args.captions_per_image}",
        "tokens_per_batch": len(tokens),
        **{f"{name}_captions_per_s": round(v) for name, v in speed.items()},
        "int8_raw_vs_float16_raw": round(speed["int8_raw"] / speed["float16_raw"], 2),
        "batch_mib_float16": round(len(tokens) * 2 * d / 2**20, 2),
        "batch_mib_int8": round((tokens.nbytes + scales.nbytes) / 2**20, 2),
        "torch_cpu_dequantize_ms_per_batch": round(dequantize_ms, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--images", type=int, default=200, help="synthetic images captioned for the T5 part")
    ap.add_argument("--t5-steps", type=int, default=800, help="training steps of the tiny T5")
    ap.add_argument(
        "--models",
        type=Path,
        help="tiny models already built by `tcjepa tiny-models --t5-corpus` on `tcjepa synth --n IMAGES --seed SEED` "
        "captions (default: build them, ~10 min on 2 busy cores)",
    )
    ap.add_argument("--wide-d-model", type=int, default=768, help="width of the random T5")
    ap.add_argument("--planted-tokens", type=int, default=8000)
    ap.add_argument("--captions", type=int, default=20_000, help="captions in each reader store")
    ap.add_argument("--d-model", type=int, default=1024, help="reader stores' width (t5-large)")
    ap.add_argument("--images-per-batch", type=int, default=128)
    ap.add_argument("--captions-per-image", type=int, default=8)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tcjepa("synth", "--out", tmp / "synth", "--n-images", args.images, "--seed", args.seed)
        tcjepa("caption", "--cache", tmp / "cache", "--annotations", tmp / "synth" / "captions.jsonl")
        models = args.models
        if models is None:
            models = tmp / "models"
            corpus = tmp / "synth" / "captions.jsonl"
            tcjepa("tiny-models", "--out", models, "--t5-corpus", corpus, "--t5-steps", args.t5_steps)
        wide = random_t5(tmp / "t5-wide", models / "t5", args.wide_d_model, 2, args.seed)
        t5 = {
            "tiny_t5_trained": compare_codecs(tmp, tmp / "cache", models / "t5", "tiny"),
            f"random_t5_d{args.wide_d_model}": compare_codecs(tmp, tmp / "cache", wide, "wide"),
        }
        print(json.dumps({"t5": t5}), file=sys.stderr, flush=True)  # each part as it ends, for a run cut short
        planted_cases = {f"d{d}": planted_outliers(d, args.planted_tokens) for d in (1024, 4096)}
        print(json.dumps({"planted_outliers": planted_cases}), file=sys.stderr, flush=True)
        reader = reader_throughput(tmp, args)
    result = {
        "benchmark": "store_codecs",
        "t5": t5,
        "planted_outliers": planted_cases,
        "reader": reader,
        "goals": {
            "every_token_cosine_ge_0.999": all(v["min_token_cosine"] >= 0.999 for v in t5.values())
            and all(v["fitted_min_cosine"] >= 0.999 for v in planted_cases.values()),
            "int8_bytes_le_0.55x_float16": all(v["int8_vs_float16_bytes"] <= 0.55 for v in t5.values()),
        },
    }
    print_result(result)


if __name__ == "__main__":
    main()
