"""The text regularisers alone, today's autograd Function beside the one it replaced: bytes moved and time.

Today (`train.losses`): every layer's cosine map from one batched GEMM, over each image's real words alone (the
padded ones left out, `image_words`), read once forward and once backward after recomputing it, in the GEMM's
dtype. Reference (`benchmarks/reference_regularisers.py`, issue 32's "today"): each
layer's map remade as float32 for every pass (two forward, three backward), ~10 elementwise passes over each.

Shapes: issue 32's ViT-B/16 `before_mlp` step per image (predictor 384 wide, depth 6; 648 conditioned tokens, the
last ~10% padding; N = 8 captions × 128 words, most 64–128 words long and one in six 16–63), for `--images` images
(`--tokens`, `--words` and `--depth` shrink it for tests);
queries and keys in bf16, as autocast hands them over. Forward and backward of 3·sparse + 5·consistency.

Bytes, per image:
  compiled  inductor's own count, for the compiled forward and backward graphs, of what each kernel reads and
            writes after fusion, the GEMMs included (`GraphLowering.count_bytes`, what the `inductor_metrics` log
            reports): the figure a GPU's memory traffic follows. Today's compiled figure adds the eager ops outside
            its two passes (the weights and the order of each image's words), which `--compile` leaves eager.
            Goal of issue 32
            point 1: ≤ 1/4 of the reference's bytes as the trainer ran it (eager).
  eager     every aten op's inputs plus outputs (a `TorchDispatchMode`; views not): the traffic if no operand stays
            in cache.
Time: the median of interleaved calls, eager and compiled, on one CPU thread (2-core machine shared with other
jobs: ratios, measured side by side, are the figures to read).

  python -m benchmarks.regularisers [--images 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from benchmarks.common import print_result  # first: sets the offline environment
from benchmarks.reference_regularisers import regularisers as reference_regularisers  # noqa: E402
from train.losses import (  # noqa: E402
    EAGER_PASSES,
    RegulariserPasses,
    TextRegularisers,
    compiled_regulariser_passes,
    text_regularisers,
)
from train.masks import padded_length  # noqa: E402

CAPTIONS, WIDTH = 8, 384
CPU = torch.device("cpu")
Regularisers = Callable[..., TextRegularisers]


@dataclass(frozen=True)
class Shape:
    images: int
    tokens: int = 648
    words: int = 128
    depth: int = 6  # predictor layers


def operands(
    shape: Shape, seed: int = 0, device: torch.device = CPU
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Queries `[B, I, d]` and keys `[B, N, S, d]` per layer (bf16 leaves on `device`), word mask, valid captions,
    real tokens."""
    images, tokens, words = shape.images, shape.tokens, shape.words
    g = torch.Generator().manual_seed(seed)
    short = torch.rand(images, CAPTIONS, generator=g) < 1 / 6
    lengths = torch.where(
        short,
        torch.randint(words // 8, words // 2, (images, CAPTIONS), generator=g),
        torch.randint(words // 2, words + 1, (images, CAPTIONS), generator=g),
    )
    word_mask = torch.arange(words) < lengths[..., None]
    token_valid = torch.arange(tokens) < int(0.9 * tokens)
    depth = shape.depth
    queries = [torch.randn(images, tokens, WIDTH, generator=g) for _ in range(depth)]
    keys = [torch.randn(images, CAPTIONS, words, WIDTH, generator=g) * word_mask[..., None] for _ in range(depth)]
    leaves = [x.to(device, torch.bfloat16).requires_grad_() for x in queries + keys]
    masks = (word_mask, lengths > 0, token_valid.expand(images, -1).contiguous())
    return leaves[:depth], leaves[depth:], tuple(m.to(device) for m in masks)


def over_real_words(queries, keys, word_mask, valid, token_valid, passes: RegulariserPasses = EAGER_PASSES):
    """Today's Function as the trainer calls it: the maps over each image's real words alone (`image_words`, which
    the trainer counts on the host from the lengths; here read off the mask, one sync)."""
    image_words = padded_length(int(word_mask.flatten(1).sum(1).max()))
    return text_regularisers(queries, keys, word_mask, valid, token_valid, passes=passes, image_words=image_words)


def forward_backward(regularisers: Regularisers, queries, keys, masks) -> torch.Tensor:
    """3·sparse + 5·consistency, and its gradients into the leaves."""
    regs = regularisers(queries, keys, *masks)
    loss = 3 * regs.sparse + 5 * regs.consistency
    loss.backward()
    return loss.detach()


class OpBytes(TorchDispatchMode):
    """Bytes of every aten op's tensor inputs and outputs (in-place ops: read and written; views, which move
    nothing, not counted), except while `paused`."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not (self.paused or view):
            self.bytes += sum(t.nbytes for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def eager_bytes(regularisers: Regularisers, shape: Shape, device: torch.device) -> int:
    inputs = operands(shape, device=device)
    with OpBytes() as counter:
        forward_backward(regularisers, *inputs)
    return counter.bytes


def uncounted_passes(counter: OpBytes, passes: RegulariserPasses = EAGER_PASSES) -> RegulariserPasses:
    """`passes` run with `counter` paused: what it counts is the ops outside them."""

    def paused(run: Callable[..., Any]) -> Callable[..., Any]:
        def uncounted(*args: object) -> Any:
            counter.paused = True
            try:
                return run(*args)
            finally:
                counter.paused = False

        return uncounted

    return RegulariserPasses(paused(passes.forward), paused(passes.backward))


def bytes_outside_the_passes(shape: Shape, device: torch.device) -> int:
    """Today's eager ops outside its two passes (the weights, the order of each image's words): under `--compile`
    they stay eager, so they count beside inductor's bytes of the compiled passes."""
    counter = OpBytes()
    inputs = operands(shape, device=device)
    with counter:
        forward_backward(partial(over_real_words, passes=uncounted_passes(counter)), *inputs)
    return counter.bytes


@contextmanager
def inductor_bytes() -> Iterator[Callable[[], int]]:
    """Inductor's count of what its kernels read and write after fusion, GEMMs included (`GraphLowering.count_bytes`),
    summed over the graphs compiled inside: it counts only while its `inductor_metrics` log is on (whose records are
    dropped here), and not for a graph the FX graph cache hands back (the cache is off inside)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    log = torch._logging.getArtifactLogger("torch._inductor.compile_fx", "inductor_metrics")
    level, dropped = log.level, lambda record: False
    log.setLevel(logging.INFO)  # this log alone, whatever TORCH_LOGS set for the others
    log.addFilter(dropped)
    metrics.reset()
    try:
        with inductor_config.patch(fx_graph_cache=False):
            yield lambda: metrics.num_bytes_accessed
    finally:
        log.removeFilter(dropped)
        log.setLevel(level)


class CountedPass:
    """A compiled regulariser pass that records, call by call, the images it ran on and inductor's bytes of any graph
    the call compiled."""

    def __init__(self, run: Callable[..., Any], counted: Callable[[], int]) -> None:
        self.run, self.counted = run, counted
        self.graphs: list[tuple[int, int]] = []  # (bytes, images it was compiled for)
        self.images: list[int] = []

    def __call__(self, queries: list, *rest: object) -> Any:
        before = self.counted()
        out = self.run(queries, *rest)
        if self.counted() > before:
            self.graphs.append((self.counted() - before, queries[0].shape[0]))
        self.images.append(queries[0].shape[0])
        return out

    def bytes(self) -> float:
        """The graph's bytes scaled from the images it was compiled for to every image it ran on (each image's maps
        are alike)."""
        if len(self.graphs) != 1:
            raise SystemExit(
                f"a regulariser pass compiled {len(self.graphs)} graphs in one call: cannot scale its bytes"
            )
        ((nbytes, compiled_for),) = self.graphs
        return nbytes * sum(self.images) / compiled_for


def compiled_pass_bytes(run: Callable[[RegulariserPasses], object], passes: RegulariserPasses) -> int:
    """`run` (the regularisers' forward and backward, or a whole step, given the passes), compiling `passes` cold:
    inductor's bytes of their graphs over every image. It counts a graph once, at the sizes of the chunk of images
    it was compiled for, so each pass's count is scaled to every chunk it ran on."""
    with inductor_bytes() as counted:
        counted_passes = [CountedPass(pass_, counted) for pass_ in passes]
        run(RegulariserPasses(*counted_passes))
    return round(sum(p.bytes() for p in counted_passes))


def compiled(name: str, shape: Shape, device: torch.device, backend: str) -> tuple[Callable[..., torch.Tensor], int]:
    """The reference compiled whole (the trainer never did), or today's with its passes compiled as under
    `--compile`, and inductor's count of the bytes of the graphs compiled by the first call (0 for another backend):
    today's scaled to every chunk of images its passes ran on."""
    if name == "reference":
        fn = torch.compile(reference_regularisers, fullgraph=True, dynamic=True, backend=backend)
    else:
        passes = compiled_regulariser_passes(backend)
        fn = partial(over_real_words, passes=passes)

    def run(queries, keys, masks) -> torch.Tensor:
        return forward_backward(fn, queries, keys, masks)

    if backend != "inductor":
        run(*operands(shape, device=device))
        return run, 0
    if name == "reference":
        with inductor_bytes() as counted:
            run(*operands(shape, device=device))
            nbytes = counted()
    else:
        inputs = operands(shape, device=device)
        nbytes = compiled_pass_bytes(lambda p: forward_backward(partial(over_real_words, passes=p), *inputs), passes)
    if not nbytes:
        raise SystemExit("inductor counted no bytes: the graphs came from a cache, or its count moved")
    return run, nbytes


def median_seconds(
    runs: dict[str, Callable[..., torch.Tensor]], shape: Shape, repeats: int, device: torch.device
) -> dict[str, float]:
    """Median seconds of each run's forward + backward (the device synchronised), the runs interleaved in rotating
    order."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            inputs = operands(shape, seed=r, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            runs[name](*inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(shape: Shape, repeats: int, device: torch.device = CPU, backend: str = "inductor") -> dict:
    """Both Functions, eager and compiled (by `backend`), side by side: bytes and time per image, and the ratios to
    the reference run eagerly (what the trainer ran before issue 32 point 1, compiled blocks or not)."""
    # Graphs compiled earlier in this process (the trainer's passes, by another of gpu_check's phases) would be
    # reused, and inductor would count no bytes: both Functions are compiled afresh here.
    torch._dynamo.reset()
    eager = {"reference": reference_regularisers, "today": over_real_words}
    loss = {name: float(forward_backward(fn, *operands(shape, device=device))) for name, fn in eager.items()}
    runs = {f"{name}_eager": partial(forward_backward, fn) for name, fn in eager.items()}
    nbytes = {f"{name}_eager": eager_bytes(fn, shape, device) for name, fn in eager.items()}
    for name in eager:
        runs[f"{name}_compiled"], nbytes[f"{name}_compiled"] = compiled(name, shape, device, backend)
    outside = bytes_outside_the_passes(shape, device)
    if nbytes["today_compiled"]:
        nbytes["today_compiled"] += outside
    seconds = median_seconds(runs, shape, repeats, device)
    baseline = "reference_eager"
    return {
        "shape": {**asdict(shape), "captions": CAPTIONS, "width": WIDTH},
        "device": device.type,
        "backend": backend,
        "loss": loss,
        "mib_per_image": {k: round(v / shape.images / 2**20, 1) for k, v in nbytes.items() if v},
        "today_compiled_mib_per_image_outside_the_passes": round(outside / shape.images / 2**20, 1),
        "ms_per_image": {k: round(v / shape.images * 1e3, 3) for k, v in seconds.items()},
        "bytes_over_reference_eager": {k: round(v / nbytes[baseline], 3) for k, v in nbytes.items() if v},
        "time_over_reference_eager": {k: round(v / seconds[baseline], 3) for k, v in seconds.items()},
        "goal_met": 0 < nbytes["today_compiled"] <= nbytes[baseline] / 4 if backend == "inductor" else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=Shape.tokens, help="conditioned tokens per image")
    parser.add_argument("--words", type=int, default=Shape.words, help="words per caption, padding included")
    parser.add_argument("--depth", type=int, default=Shape.depth, help="predictor layers")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = Shape(args.images, args.tokens, args.words, args.depth)
    print_result({"benchmark": "regularisers", **measure(shape, args.repeats)})


if __name__ == "__main__":
    main()
