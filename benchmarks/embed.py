"""`tcjepa embed` throughput vs a naive loop that pads every batch to the maximum length.

A long-tailed mix of caption lengths (10–300 tokens) is written to a caption
cache; a random T5 encoder (`--d-model`, `--layers`) with the tiny project
tokenizer encodes it
  ours   run_embed: sort by length inside a window, token-budget batches, write the store
  naive  fixed-size batches in cache order, every batch padded to --max-length, no writing
Both compute in bfloat16 on the CPU. Prints one JSON line: real tokens/s of each,
the ratio, and the store's bytes per token on disk.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import print_result  # first: sets the offline environment


def make_captions(n: int, seed: int) -> list[str]:
    """Captions whose token lengths follow a clipped log-normal between ~10 and ~300."""
    from pipeline.devkit.synth import captions_for, draw_scene

    rng = np.random.default_rng(seed)
    words = " ".join(" ".join(captions_for(draw_scene(rng, 4), 4, rng)) for _ in range(50)).split()
    lengths = np.clip(rng.lognormal(3.6, 0.8, size=n), 6, 200).astype(int)
    out = []
    for i, length in enumerate(lengths):
        start = int(rng.integers(0, len(words) - length))
        out.append(f"{i} " + " ".join(words[start : start + length]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--captions", type=int, default=1500)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=320)
    ap.add_argument("--naive-batch", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import T5Config, T5EncoderModel

    from captioning.cache import CaptionCache, caption_row
    from embedding_cache.encode import load_tokenizer
    from embedding_cache.job import run_embed
    from embedding_cache.work import EmbedConfig
    from pipeline.devkit.tiny_t5 import build_t5_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = build_t5_tokenizer()
        torch.manual_seed(args.seed)
        config = T5Config(
            vocab_size=len(tokenizer),
            d_model=args.d_model,
            d_kv=64,
            d_ff=4 * args.d_model,
            num_layers=args.layers,
            num_heads=max(args.d_model // 64, 1),
            feed_forward_proj="gated-gelu",
        )
        T5EncoderModel(config).save_pretrained(tmp / "t5")
        tokenizer.save_pretrained(tmp / "t5")

        texts = make_captions(args.captions, args.seed)
        cache = CaptionCache.open_or_create(tmp / "cache")
        recipe = cache.add_recipe({"kind": "benchmark"})
        cache.commit(
            [caption_row(f"{i // 8:064x}", f"{i // 8}", recipe, "p", i % 8, t, "stop") for i, t in enumerate(texts)]
        )

        tok = load_tokenizer(str(tmp / "t5"))
        lengths = np.array(
            [min(len(x) + 1, args.max_length) for x in tok(texts, add_special_tokens=False)["input_ids"]]
        )

        report = run_embed(
            EmbedConfig(
                cache=tmp / "cache",
                store=tmp / "store",
                model=str(tmp / "t5"),
                max_length=args.max_length,
                token_budget=args.token_budget,
                device="cpu",
                progress=False,
            )
        )
        ours = report.tokens / report.seconds

        model = T5EncoderModel.from_pretrained(tmp / "t5", dtype=torch.bfloat16).eval()
        start = time.perf_counter()
        for i in range(0, len(texts), args.naive_batch):
            batch = tok(
                texts[i : i + args.naive_batch],
                padding="max_length",
                truncation=True,
                max_length=args.max_length,
                return_tensors="pt",
            )
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state.float()
            for row, n in zip(hidden, batch["attention_mask"].sum(1).tolist()):
                row[:n].half().numpy()
        naive = int(lengths.sum()) / (time.perf_counter() - start)

        store_bytes = sum(f.stat().st_size for f in (tmp / "store").rglob("*") if f.is_file())
        print_result(
            {
                "benchmark": "embed",
                "captions": args.captions,
                "tokens": int(lengths.sum()),
                "length_p50_p90_max": [
                    int(np.percentile(lengths, 50)),
                    int(np.percentile(lengths, 90)),
                    int(lengths.max()),
                ],
                "model": f"random T5 encoder d={args.d_model} layers={args.layers}, bf16, cpu",
                "ours_tokens_per_s": round(ours),
                "naive_padded_tokens_per_s": round(naive),
                "speedup": round(ours / naive, 2),
                "store_bytes_per_token": round(store_bytes / report.tokens, 1),
                "float16_bytes_per_token": 2 * args.d_model,
            }
        )


if __name__ == "__main__":
    main()
