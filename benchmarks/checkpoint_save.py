"""How long a sharded checkpoint holds the training loop: written in the foreground against in the background.

One process in a gloo group of its own (a rank of an FSDP run, as far as DCP is concerned): a model of `--params`
parameters (4/5 in its encoder, 1/5 in its predictor, as ViT-B/16's TC-JEPA roughly), an EMA target the encoder's
size and AdamW state, saved `--repeats` times each way, alternating, by the trainer's `Checkpointer` into run
directories on the same disk:
- foreground (every save, before the saves went to the background): the encoders gathered and written as
  safetensors, then every shard, then `latest.json`, all before the loop goes on;
- gathering (every save, before only the last gathered the encoders): the encoders as before, then the shards
  copied to host memory and the loop goes on while a thread writes them; `wait` (the next save, the end of the run)
  publishes them;
- background (every save but a run's last, today): the shards alone, as in `gathering`.
Medians of the seconds the loop is held each way, and of the background save's whole time. One JSON line.

  python -m benchmarks.checkpoint_save --params 100000000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import print_result
from train.checkpoint import Checkpointer


class _Model(torch.nn.Module):
    """`params` parameters in `tensors` square-ish matrices, `encoder_share` of them under `encoder` (the checkpoint
    also writes the encoder as safetensors), the rest under `predictor`."""

    def __init__(self, params: int, tensors: int, encoder_share: float = 0.8) -> None:
        super().__init__()
        side = max(1, int((params / tensors) ** 0.5))
        encoder = max(1, round(tensors * encoder_share))
        self.encoder = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(side, side)) for _ in range(encoder)])
        self.predictor = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(side, side)) for _ in range(tensors - encoder)]
        )


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # its state (two moments per parameter) exists, as in a run
    return optimizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        dist.init_process_group("gloo", init_method=f"file://{root / 'group'}", rank=0, world_size=1)
        try:
            model = _Model(args.params, args.tensors)
            target = _Model(args.params * 4 // 5, args.tensors * 4 // 5, encoder_share=1.0)
            ways = ("foreground", "gathering", "background")
            savers = {}
            for way in ways:
                (root / way).mkdir()
                savers[way] = Checkpointer(root / way, model, target, _optimizer(model), main=True)
            savers["foreground"]._group = lambda: None  # type: ignore[method-assign]  # no gloo group: DCP's save
            held: dict[str, list[float]] = {way: [] for way in ways}
            written = []
            for step in range(1, args.repeats + 1):
                for way, saver in savers.items():
                    start = time.perf_counter()
                    saver.save(step, {}, sharded=True, keep=1, every_keep=0, last=way != "background")
                    held[way].append(time.perf_counter() - start)
                    saver.wait()
                    if way == "background":
                        written.append(time.perf_counter() - start)
        finally:
            dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())  # the target's and the optimizer's come on top
    result = {
        "benchmark": "checkpoint_save",
        "params": params,
        "bytes_written_per_save": (params * 3 + sum(p.numel() for p in target.parameters())) * 4,
        "repeats": args.repeats,
        **{f"{way}_held_s": round(statistics.median(held[way]), 3) for way in ways},
        "background_written_s": round(statistics.median(written), 3),
        "loop_held_ratio": round(statistics.median(held["background"]) / statistics.median(held["foreground"]), 3),
        "loop_held_over_gathering": round(
            statistics.median(held["background"]) / statistics.median(held["gathering"]), 3
        ),
    }
    print_result(result)


if __name__ == "__main__":
    main()
