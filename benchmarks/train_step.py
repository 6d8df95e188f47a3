"""Training-step time of each conditioning mode next to its FLOPs: does the text conditioner cost only its arithmetic?

One full step, built as the trainer builds it (`build_models`, `compute_losses`,
AdamW over `param_groups`, `ema_update`), under bf16 autocast, on synthetic
tensors: random images, multi-block masks from `sample_masks`, and random
caption token embeddings, by default realistic ones: d_text 1024 (T5-large),
every caption padded to 128 words (the loader's max_words), most 64–128 words
long and one in six 16–63 (float16 → autocast dtype as the loader hands them
over). The same encoder, masks and captions serve every mode:

  none          plain I-JEPA (no text)
  none_cut      the same with I-JEPA's cut of every context to the batch's smallest (pad keeps each whole)
  cross1        TC-JEPA, N=1
  cross8        TC-JEPA, N=8, pool after_mlp (one MLP per caption)
  cross8_before TC-JEPA, N=8, pool before_mlp (one shared MLP)
  cross8_before_cut  the same with the cut
  none_rows, cross8_before_rows  none and cross8_before on padded rows with a key mask, every layer computing the
                padding, as the step ran before issue 32's packing (`train.packing`)
  cross8_mha, cross8_before_mha  cross8 and cross8_before with the multi-head conditioner (`--conditioner mha`:
                biases, an output projection), whatever `--conditioner` says: what the _ref modes compare with
  cross8_ref, cross8_before_ref  cross8 and cross8_before run by the cross-attention and regularisers as they were
                before issue 17 B (`benchmarks/reference_predictor.py`), in the multi-head form they had; compared
                with the _mha modes on the same weights and batch (the default, the paper's form, has no biases and
                no output projection)
  cross8_before_regref  cross8_before with the text regularisers as they were before issue 32 point 1
                (`benchmarks/reference_regularisers.py`: each layer's float32 map remade for every pass)
  cross8_before_regcompiled  cross8_before with the regularisers' two passes compiled by inductor, as `--compile`
                runs them (the rest of the step eager)
  cross8_before_noreg   cross8_before with no text regularisers at all: what the step costs without them, so that
                the difference to cross8_before (and to _regref) is the regularisers' share of the step
  sequence      N=8 captions' words appended to every predictor sequence (not run by default: with 8 captions of
                128 words every predictor sequence is ~1,000 tokens longer, about a minute a step here)

FLOPs: `torch.utils.flop_counter.FlopCounterMode` counts the first warm-up step
of each mode, on the shapes actually computed (padding included), backward
included as it runs (no input gradient for the patch embedding or the caption
K/V projection; SDPA's backward as 2.5× its forward; the regularisers'
recomputed cosine maps). The ratios use these counts (`--no-flop-counter`: the
analytic ones instead, 2·m·k·n per matmul of the forward, a step 3× the forward
of the context encoder and predictor plus 1× the target encoder; both are
reported). `useful_over_computed_flops`: the analytic count at each image's
real context and caption lengths over the count as the step computes it: the
real context patches and words packed through every per-token layer, attention
on rows padded to the batch's longest context (rounded up to a multiple of 8)
and to `--words` (the longest caption a batch here holds, rounded alike);
`useful_over_padded_flops`: the same over the count with every layer on the
padded rows, as before packing (and as the `_rows` modes still compute).

Memory autograd saves for backward: one more untimed step under
`torch.autograd.graph.saved_tensors_hooks`, each storage counted once (the
parameters not), split into what the text cross-attention saves (its modules,
the K/V projection and the regularisers) and the rest.

Each mode runs in its own fresh process (so one mode's peak memory cannot mask
another's). On the CPU all of them are started together and the driver steps
them one at a time, one step per mode per round in rotating order, so machine
noise falls on every mode alike; on CUDA they run one after another (each keeps
its own memory pool). s/step is the median of a mode's timed steps. Peak
memory: on CPU the process's peak RSS (VmHWM) during the steps above what it held before them,
on CUDA `torch.cuda.max_memory_allocated`. Prints progress to stderr and one
JSON line on stdout; `goal_met` holds issue 17's goals: cross8's time ratio to
`none` over its FLOP ratio ≤ 1.2, and the old cross-attention (`_ref`) saving
≥ 2× the bytes the new one (`_mha`, the same form) does (both pools).

The regularisers' share of the `cross8_before` step (with `cross8_before_noreg` among the modes): of its time,
1 - t(noreg) / t(mode), and of the bytes its aten ops read and write in one eager step (every op's tensor inputs
and outputs, views not, `benchmarks.regularisers.OpBytes`), B(mode) - B(noreg), for today's regularisers,
`cross8_before_regref`'s and `cross8_before_regcompiled`'s. Compiled, the passes' bytes are inductor's own count of
what its fused kernels read and write (counted as they compile, in an untimed step before the others), the ops
outside them counted as eager; `regularisers_goal_met`: compiled ≤ 1/4 of the reference's bytes (issue 32 point 1).
FLOPs and saved bytes of the compiled mode are counted with the passes eager (the same arithmetic and tensors).

CPU default (`--preset cpu_tiny`): tiny ViT (192 wide, depth 6, 3 heads, patch 8,
64×64 images), predictor 192 wide, depth 4, batch 64, one torch thread (see
PRESETS), ~10 minutes on 2 cores for either set of modes (`--modes references`: 675 s on 2026-12-06,
its inductor compile included).
`--profile MODE` prints torch.profiler's
top ops for one step of MODE instead. On a GPU (images/s and MFU against
--peak-tflops, default 989 = H100/H200 bf16 dense):
  python -m benchmarks.train_step --preset vit_b16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial

from benchmarks.common import ROOT, peak_rss_mb, print_result, reset_peak_rss  # first: sets the offline environment


@dataclass(frozen=True)
class Mode:
    conditioning: str
    captions: int
    pool: str = "after_mlp"
    context_equalise: str = "pad"
    reference: bool = False  # the cross-attention and regularisers as they were before issue 17 B
    conditioner: str | None = None  # the conditioner's form; None: --conditioner's
    # the text regularisers: "today", "compiled" (today's with its passes compiled, as under --compile), "reference"
    # (before issue 32 point 1) or "off"
    regularisers: str = "today"
    packed: bool = True  # padded contexts and words left out of the per-token layers; False: padded rows, masked


MODES: dict[str, Mode] = {
    "none": Mode("none", 0),
    "none_cut": Mode("none", 0, context_equalise="cut"),
    "none_rows": Mode("none", 0, packed=False),
    "sequence": Mode("sequence", 8),
    "cross1": Mode("cross", 1),
    "cross8": Mode("cross", 8, "after_mlp"),
    "cross8_before": Mode("cross", 8, "before_mlp"),
    "cross8_before_cut": Mode("cross", 8, "before_mlp", context_equalise="cut"),
    "cross8_before_rows": Mode("cross", 8, "before_mlp", packed=False),
    "cross8_mha": Mode("cross", 8, "after_mlp", conditioner="mha"),
    "cross8_before_mha": Mode("cross", 8, "before_mlp", conditioner="mha"),
    "cross8_ref": Mode("cross", 8, "after_mlp", reference=True, conditioner="mha"),
    "cross8_before_ref": Mode("cross", 8, "before_mlp", reference=True, conditioner="mha"),
    "cross8_before_regref": Mode("cross", 8, "before_mlp", regularisers="reference"),
    "cross8_before_regcompiled": Mode("cross", 8, "before_mlp", regularisers="compiled"),
    "cross8_before_noreg": Mode("cross", 8, "before_mlp", regularisers="off"),
}
# Named sets for --modes, each run as one interleaved group (on the CPU every mode's process alive at once, so a set
# is what fits in memory): the step and what packing and the cut change (the default), and the step beside the
# references (issue 17's cross-attention, issue 32's regularisers).
MODE_SETS = {
    "default": ["none", "none_cut", "none_rows", "cross1", "cross8", "cross8_before", "cross8_before_cut"]
    + ["cross8_before_rows"],
    "references": ["none", "cross8", "cross8_before", "cross8_before_regref", "cross8_before_regcompiled"]
    + ["cross8_before_noreg", "cross8_mha", "cross8_ref", "cross8_before_mha", "cross8_before_ref"],
}
# The regularisers' share of a cross step, by the step without them: today's, the reference's, today's compiled.
REGULARISER_SHARE_MODES = {
    "today": "cross8_before",
    "reference": "cross8_before_regref",
    "compiled": "cross8_before_regcompiled",
}
WITHOUT_REGULARISERS = "cross8_before_noreg"

PRESETS = {
    # What the prototype measured on 2 CPU cores: an 8×8 grid, so a smaller context block.
    # One torch thread: on 2 cores shared with other jobs, two OpenMP threads stall at every barrier
    # whenever a core is taken, and step times swing several-fold; one thread keeps the modes comparable.
    "cpu_tiny": dict(
        model="vit_tiny",
        width=192,
        depth=6,
        heads=3,
        patch_size=8,
        image_size=64,
        predictor_width=192,
        predictor_depth=4,
        batch=64,
        context_scale=(0.4, 0.6),
        min_context=10,
        device="cpu",
        steps=4,
        warmup=1,
        threads=1,
        text_dim=1024,
        words=128,
    ),
    # ViT-B/16 at 224 with the I-JEPA mask defaults; the predictor as `tcjepa train` builds it for vit_base.
    "vit_b16": dict(
        model="vit_base",
        width=None,
        depth=None,
        heads=None,
        patch_size=16,
        image_size=224,
        predictor_width=384,
        predictor_depth=None,
        batch=128,
        context_scale=(0.85, 1.0),
        min_context=10,
        device="cuda",
        steps=10,
        warmup=3,
        threads=0,
        text_dim=1024,
        words=128,
    ),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu_tiny", help="defaults for everything below")
    ap.add_argument(
        "--modes",
        default="default",
        help=f"a set ({', '.join(MODE_SETS)}) or a comma-separated subset of {', '.join(MODES)}",
    )
    ap.add_argument(
        "--conditioner",
        default="paper",
        choices=("paper", "mha"),
        help="the cross modes' conditioner form (the _mha and _ref modes are always mha, and compared together)",
    )
    ap.add_argument("--model", help="encoder size name (vit_tiny … vit_giant)")
    ap.add_argument("--width", type=int)
    ap.add_argument("--depth", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--patch-size", type=int)
    ap.add_argument("--image-size", type=int)
    ap.add_argument("--predictor-width", type=int)
    ap.add_argument("--predictor-depth", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context-scale", type=float, nargs=2)
    ap.add_argument("--min-context", type=int)
    ap.add_argument("--device")
    ap.add_argument("--steps", type=int, help="timed steps per mode (one per mode per round, rotating order)")
    ap.add_argument(
        "--warmup",
        type=int,
        help="untimed steps first, the first one under FlopCounterMode (they count for peak memory)",
    )
    ap.add_argument("--text-dim", type=int, help="caption word-embedding width (T5-large: 1024)")
    ap.add_argument("--words", type=int, help="the longest caption of the batch, which every caption is padded to")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 instead of bf16 autocast")
    ap.add_argument(
        "--mask-step",
        type=int,
        default=1,
        help="every step uses the masks sample_masks draws for this step (fixed shapes: exact FLOPs)",
    )
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU (989: H100/H200 bf16 dense)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (0: torch's default)")
    ap.add_argument(
        "--no-flop-counter", dest="flop_counter", action="store_false", help="skip the FlopCounterMode cross-check step"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--padding-only",
        metavar="DRAWS",
        type=int,
        help="instead: each mode's analytic FLOP shares (useful over computed, and over padded rows) at the preset's "
        "shapes, over DRAWS mask and caption-length draws; runs no step, so realistic shapes run on a laptop",
    )
    ap.add_argument(
        "--profile", metavar="MODE", help="instead: profile one step of MODE (torch.profiler), table to stderr"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.context_scale = tuple(args.context_scale)
    args.modes = ",".join(MODE_SETS.get(args.modes, [args.modes]))
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


def train_config(args: argparse.Namespace, mode: Mode):
    from train.config import TrainConfig

    return TrainConfig(
        model=args.model,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        patch_size=args.patch_size,
        image_size=args.image_size,
        predictor_width=args.predictor_width,
        predictor_depth=args.predictor_depth,
        conditioning=mode.conditioning,
        pool=mode.pool,
        conditioner=mode.conditioner or args.conditioner,
        captions_per_image=max(mode.captions, 1),
        batch_size=args.batch,
        context_scale=args.context_scale,
        min_context=args.min_context,
        context_equalise=mode.context_equalise,
        bf16=args.bf16,
        device=args.device,
        seed=args.seed,
    )


def caption_lengths(rng, batch: int, n: int, words: int):
    """Mostly `words`/2 to `words` words, one caption in six shorter (`words`/8 to `words`/2)."""
    import numpy as np

    lengths = rng.integers(words // 2, words + 1, size=(batch, n))
    short = rng.random((batch, n)) < 1 / 6
    return np.where(short, rng.integers(max(words // 8, 1), max(words // 2, 2), size=(batch, n)), lengths)


# ---- analytic FLOPs --------------------------------------------------------------------------------------------


def encoder_forward_flops(
    tokens: float, width: int, depth: int, mlp_hidden: int, patches: int, patch: int, rows: float | None = None
) -> float:
    """One image: the patch embedding over the whole grid, then `depth` blocks whose projections and MLP run on
    `tokens` tokens and whose attention runs on rows of `rows` (None: `tokens`; longer where the row is padded)."""
    rows = tokens if rows is None else rows
    embed = 2 * patches * 3 * patch * patch * width
    block = 2 * tokens * width * (3 * width + width + 2 * mlp_hidden) + 2 * 2 * rows * rows * width
    return embed + depth * block


def predictor_forward_flops(
    cfg,
    mode: Mode,
    enc_width: int,
    lc: float,
    lt: int,
    m: int,
    s: float,
    text_dim: int,
    depth: int,
    mlp_hidden: int,
    rows: tuple[float, float] | None = None,
) -> dict[str, float]:
    """One image's predictor forward by part: embed/proj, self-attention blocks, text conditioner. `lc` context
    tokens and `s` words per caption reach the per-token layers; attention runs on rows of `rows` = (context, words)
    (None: `(lc, s)`). The context is embedded as the encoder hands it over, padded."""
    lc_rows, s_rows = (lc, s) if rows is None else rows
    w = cfg.predictor_width
    n = mode.captions
    parts = {"embed_proj": 2 * lc_rows * enc_width * w + 2 * m * lt * w * enc_width}
    if mode.reference:  # the predictor as it was: every layer on the padded rows
        lc, s = lc_rows, s_rows
    t, t_rows = lc + lt, lc_rows + lt
    if mode.conditioning == "sequence":  # words in every sequence: nothing is packed
        parts["text_embed"] = 2 * n * s_rows * text_dim * w
        t = t_rows = t_rows + n * s_rows  # padding words are in the sequence too (masked, still computed)
    linear = 2 * t * w * (3 * w + w)
    attention = 2 * 2 * t_rows * t_rows * w
    mlp = 2 * t * w * 2 * mlp_hidden
    parts["blocks"] = depth * m * (linear + attention + mlp)
    if mode.conditioning == "cross":
        q, q_rows = m * t, m * t_rows  # one image's M sequences attend to its captions as one row
        cross = (
            2 * q * w * w  # q
            + 2 * 2 * n * s * text_dim * w  # k, v
            + 2 * 2 * q_rows * n * s_rows * w  # scores and weighted sums, all N captions
            + (2 * n * q * w * w if cfg.conditioner == "mha" else 0)  # the output projection, per caption (`mha`)
        )
        extra_mlp = (n - 1) * 2 * q * w * 2 * mlp_hidden if mode.pool == "after_mlp" else 0
        parts["cross_attention"] = depth * cross
        parts["per_caption_mlp"] = depth * extra_mlp
    return parts


def analytic_flops(
    cfg,
    mode: Mode,
    encoder,
    predictor,
    lc: float,
    lt: int,
    m: int,
    s: float,
    text_dim: int,
    rows: tuple[float, float] | None = None,
) -> dict:
    """A step's FLOPs, per image times the batch: `lc` context tokens and `s` words per caption reach the per-token
    layers, attention runs on rows of `rows` = (context, words) (None: `(lc, s)`, nothing padded)."""
    batch = cfg.batch_size
    patches = encoder.num_patches
    enc_hidden = encoder.blocks[0].mlp.fc1.out_features
    pred_hidden = predictor.blocks[0].mlp.fc1.out_features
    depth_e, depth_p = len(encoder.blocks), len(predictor.blocks)
    target = batch * encoder_forward_flops(patches, encoder.width, depth_e, enc_hidden, patches, cfg.patch_size)
    context = batch * encoder_forward_flops(
        lc, encoder.width, depth_e, enc_hidden, patches, cfg.patch_size, None if rows is None else rows[0]
    )
    pred_parts = predictor_forward_flops(cfg, mode, encoder.width, lc, lt, m, s, text_dim, depth_p, pred_hidden, rows)
    pred = batch * sum(pred_parts.values())
    return {
        "step": target + 3 * (context + pred),
        "forward": {
            "target_encoder": target,
            "context_encoder": context,
            **{f"predictor_{k}": batch * v for k, v in pred_parts.items()},
        },
    }


def useful_and_computed_flops(
    cfg, mode: Mode, encoder, predictor, lt: int, m: int, text_dim: int, context_lengths, words, rows: tuple[int, int]
) -> tuple[float, float, float]:
    """A step's FLOPs (useful, computed, padded), means over its images: at each image's real context length
    (`context_lengths`) and mean caption length (`words`); as the step computes them, the per-token layers on the
    real tokens (packed) and attention on rows padded to `rows` = (context, words); and as if every layer ran on the
    padded rows (before packing)."""
    count = partial(analytic_flops, cfg, mode, encoder, predictor, lt=lt, m=m, text_dim=text_dim)
    padded = count(lc=rows[0], s=rows[1])["step"]
    useful = computed = 0.0
    for lc, s in zip(context_lengths, words):
        useful += count(lc=float(lc), s=float(s))["step"]
        computed += count(lc=float(lc), s=float(s), rows=rows)["step"] if mode.packed else padded
    n = len(context_lengths)
    return useful / n, computed / n, padded


def padding_shares(args: argparse.Namespace, modes: list[str], draws: int) -> dict:
    """Each mode's useful FLOPs over those computed and over those of padded rows, at the preset's shapes, for `draws`
    batches of masks (`sample_masks`, steps 0…) and caption lengths (`caption_lengths`): the analytic counts alone."""
    import numpy as np

    from train.config import ModelConfig
    from train.data import mask_config
    from train.jepa import build_models
    from train.masks import padded_length, sample_masks

    result: dict = {"benchmark": "train_step_padding", "preset": args.preset, "batch": args.batch, "draws": draws}
    for name in modes:
        mode = MODES[name]
        cfg = train_config(args, mode)
        model, _ = build_models(ModelConfig.of(cfg), args.text_dim if mode.conditioning != "none" else None)
        shares = []
        for step in range(draws):
            masks = sample_masks(mask_config(cfg), model.encoder.grid, args.seed, step, cfg.batch_size)
            lengths = caption_lengths(np.random.default_rng([args.seed, step]), cfg.batch_size, 8, args.words)
            words = lengths[:, : mode.captions].mean(axis=1) if mode.captions else np.zeros(cfg.batch_size)
            rows = (masks.context.shape[1], padded_length(args.words) if mode.captions else 0)
            m, lt = masks.targets.shape[1:]
            useful, computed, padded = useful_and_computed_flops(
                cfg, mode, model.encoder, model.predictor, lt, m, args.text_dim, masks.context_lengths, words, rows
            )
            shares.append((useful / computed, useful / padded))
        computed_shares, padded_shares = zip(*shares)
        result[name] = {
            "useful_over_computed_flops": [round(min(computed_shares), 3), round(max(computed_shares), 3)],
            "useful_over_padded_flops": [round(min(padded_shares), 3), round(max(padded_shares), 3)],
        }
    return result


# ---- one mode, in its own process --------------------------------------------------------------------------------


def sdpa_cpu_mapping() -> dict:
    """FlopCounterMode knows the CUDA SDPA kernels but not the CPU flash one; count it with the same formulas."""
    import torch
    import torch.utils.flop_counter as fc

    def raw(formula):  # fc's formulas are already shape-wrapped; mark them so the counter does not wrap them twice
        def count(*args, **kwargs):
            return formula(*args, **kwargs)

        count._get_raw = True
        return count

    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: raw(fc.sdpa_flop),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: raw(fc.sdpa_backward_flop),
    }


@dataclass
class Setup:
    step: object  # (passes=EAGER_PASSES) -> None: one full training step, the regularisers' passes as given
    passes: object  # the mode's regularisers' passes (`RegulariserPasses`): eager, or compiled as under --compile
    model: object  # the JEPA being trained
    mode: Mode
    info: dict  # shapes, analytic FLOPs, parameter count
    cuda: bool


class SavedBytes:
    """What autograd keeps for backward over one step, in bytes by region, each storage counted once.

    A storage belongs to the region that saves it first: `cross_attention` while a text cross-attention module runs
    (the K/V projection included) or the text regularisers do, else `other`. Parameters are not counted (they exist
    anyway); their bf16 copies under autocast are. The regularisers are called from the losses' module, so they
    are wrapped there for the one measured step (and the wrapper must run in cross modes, or the count is refused).
    """

    def __init__(self) -> None:
        self.region = "other"
        self.storages: dict[int, tuple[int, str]] = {}
        self.regulariser_calls = 0

    def measure(self, job: Setup) -> dict:
        import torch

        import benchmarks.reference_predictor as reference
        import train.objective
        import train.predictor as lean

        owner = reference if job.mode.reference else train.objective
        regularisers = owner.text_regularisers
        parameters = {p.untyped_storage().data_ptr() for p in job.model.parameters()}
        cross_types = (lean.TextKeysValues, lean.TextCrossAttention, reference.ReferenceCrossAttention)
        handles = []
        for module in job.model.modules():
            if isinstance(module, cross_types):
                handles.append(module.register_forward_pre_hook(lambda *_: self.enter("cross_attention")))
                handles.append(module.register_forward_hook(lambda *_: self.enter("other")))

        def tagged(*args, **kwargs):
            self.regulariser_calls += 1
            self.enter("cross_attention")
            try:
                return regularisers(*args, **kwargs)
            finally:
                self.enter("other")

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                self.storages.setdefault(storage.data_ptr(), (storage.nbytes(), self.region))
            return tensor

        owner.text_regularisers = tagged
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                job.step()
        finally:
            owner.text_regularisers = regularisers
            for handle in handles:
                handle.remove()
        if job.mode.conditioning == "cross" and not self.regulariser_calls:
            raise SystemExit(f"{owner.__name__}.text_regularisers was not called: the saved bytes cannot be attributed")
        by_region = {"cross_attention": 0, "other": 0}
        for nbytes, region in self.storages.values():
            by_region[region] += nbytes
        return {"saved_bytes": sum(by_region.values()), "cross_attention_saved_bytes": by_region["cross_attention"]}

    def enter(self, region: str) -> None:
        self.region = region


def reference_text_regularisers(queries, keys, word_mask, valid, token_valid=None, **_):
    """The regularisers as they were before issue 32 point 1 (the full cosine, the only one they had)."""
    from benchmarks.reference_regularisers import regularisers

    return regularisers(queries, keys, word_mask, valid, token_valid)


def no_text_regularisers(queries, keys, word_mask, valid, token_valid=None, **_):
    """No regularisers: zero terms that reach no parameter, so the step is the cross step without them."""
    from train.losses import TextRegularisers

    zero = queries[0].new_zeros((), dtype=queries[0].dtype)
    return TextRegularisers(zero, zero, queries[0].new_zeros(len(queries)), zero)


REGULARISERS = {"reference": reference_text_regularisers, "off": no_text_regularisers}


def setup(args: argparse.Namespace, name: str) -> Setup:
    """Models, optimizer and the synthetic batch of one mode; the step exactly as the trainer runs it."""
    import numpy as np
    import torch

    import benchmarks.reference_predictor as reference
    import train.objective
    from train.config import ModelConfig
    from train.data import mask_config
    from train.jepa import build_models, ema_update
    from train.losses import EAGER_PASSES, RegulariserPasses, compiled_regulariser_passes
    from train.masks import padded_length, sample_masks
    from train.optim import param_groups
    from train.packing import TokenLayout
    from train.predictor import TextBatch

    if args.threads:
        torch.set_num_threads(args.threads)
    mode = MODES[name]
    cfg = train_config(args, mode)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    model, target = build_models(ModelConfig.of(cfg), args.text_dim if mode.conditioning != "none" else None)
    if mode.reference:  # the same weights in the old layout, run by the old code
        model.predictor = reference.ReferencePredictor.like(model.predictor, model.encoder.grid)
    compute_losses = reference.compute_losses if mode.reference else train.objective.compute_losses
    if mode.regularisers in REGULARISERS:  # this process runs this one mode: the objective's call is replaced for good
        train.objective.text_regularisers = REGULARISERS[mode.regularisers]
    model.to(device)
    target.to(device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.text_lr_scale), lr=cfg.lr, betas=cfg.betas)
    for group in optimizer.param_groups:
        group["weight_decay"] = cfg.weight_decay[0] if group["decay"] else 0.0
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32

    # The same synthetic batch in every mode: images, masks, and (for text modes) the first N captions of 8.
    rng = np.random.default_rng(args.seed)
    grid = model.encoder.grid
    masks = sample_masks(mask_config(cfg), grid, args.seed, args.mask_step, cfg.batch_size)
    images = torch.from_numpy(
        rng.standard_normal((cfg.batch_size, 3, cfg.image_size, cfg.image_size), dtype=np.float32)
    )
    lengths8 = caption_lengths(rng, cfg.batch_size, 8, args.words)
    text = None
    s = 0
    if mode.conditioning != "none":
        lengths = lengths8[:, : mode.captions]
        s = padded_length(args.words)  # the batch's longest caption (`--words` long), rounded as the trainer rounds it
        tokens = rng.standard_normal((cfg.batch_size, mode.captions, s, args.text_dim)).astype(np.float16)
        tokens *= (np.arange(s) < lengths[..., None])[..., None]
        words = int(lengths.sum()) if mode.packed else None  # counted: the K/V projection runs on real words
        # and the regularisers' maps on each image's real words (as the trainer counts them, on the host)
        image_words = padded_length(int(lengths.sum(axis=1).max())) if mode.packed else None
        text = TextBatch(torch.from_numpy(tokens), torch.from_numpy(lengths.astype(np.int64)), words, image_words)
        text = text.to(device, dtype=dtype)
    images = images.to(device)
    context = torch.from_numpy(masks.context).to(device)
    valid = masks.context_valid()
    # Padded contexts packed, as the trainer packs them (`train.packing`), or (`_rows` modes) only masked; none to
    # pack where no row is padded.
    context_layout = None
    if not valid.all():
        key_mask = torch.from_numpy(valid).to(device)
        context_layout = TokenLayout.of(key_mask, int(valid.sum())) if mode.packed else TokenLayout(key_mask)
    targets = torch.from_numpy(masks.targets).to(device)
    lc, (m, lt) = context.shape[1], targets.shape[1:]

    def step(passes: RegulariserPasses = EAGER_PASSES) -> None:
        passed = {} if mode.reference else {"regulariser_passes": passes}  # the reference: its own regularisers
        with torch.autocast(device.type, dtype=dtype, enabled=cfg.bf16):
            losses = compute_losses(model, target, images, context, targets, text, cfg, context_layout, **passed)
        optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        optimizer.step()
        ema_update(target, model.encoder, 0.996)

    # Useful FLOPs: the count at each image's real context length and mean caption length, averaged over images (what
    # the step would cost if no row carried padding), over the count as the step computes it (packed: attention alone
    # on padded rows) and over the count with every layer on padded rows (as before packing).
    words = lengths8[:, : mode.captions].mean(axis=1) if mode.conditioning != "none" else np.zeros(cfg.batch_size)
    useful, computed, padded = useful_and_computed_flops(
        cfg, mode, model.encoder, model.predictor, lt, m, args.text_dim, masks.context_lengths, words, (lc, s)
    )
    mean_lc, mean_s = (float(masks.context_lengths.mean()), float(words.mean())) if mode.packed else (lc, s)
    flops = analytic_flops(cfg, mode, model.encoder, model.predictor, mean_lc, lt, m, mean_s, args.text_dim, (lc, s))
    info = {
        "lc": lc,
        "lt": lt,
        "m": m,
        "s": s,
        "flops": flops,
        "useful_over_computed": float(useful / computed),
        "useful_over_padded": float(useful / padded),
        "params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
    }
    passes = EAGER_PASSES
    if mode.regularisers == "compiled":
        passes = compiled_regulariser_passes("inductor")
        from benchmarks.regularisers import compiled_pass_bytes

        info["regulariser_pass_bytes"] = compiled_pass_bytes(step, passes)
    return Setup(step, passes, model, mode, info, cuda)


def run_mode(args: argparse.Namespace, name: str) -> None:
    """The worker: set up one mode, then obey the driver's commands on stdin."""
    import torch

    job = setup(args, name)
    step, cuda = job.step, job.cuda

    def timed_step() -> dict:
        if cuda:
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        step(job.passes)
        if cuda:
            torch.cuda.synchronize()
        return {"time": time.perf_counter() - start, "cpu": time.process_time() - cpu}

    def counted_step() -> int:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False, custom_mapping=sdpa_cpu_mapping())
        with counter:
            step()
        return counter.get_total_flops()

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    reset_peak_rss()  # set-up's peak (and the compile of `_regcompiled`'s passes) is not the steps'
    base_rss_mb = peak_rss_mb()
    reply({"ready": name, **job.info})
    # Commands from the driver, one a line: "step" (timed), "warmup", "count" (FlopCounterMode), "done".
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            reply(timed_step())
        elif command == "warmup":
            step(job.passes)
            reply({})
        elif command == "count":
            reply({"flops_counter": counted_step()})
        elif command == "saved":
            reply(SavedBytes().measure(job))
        elif command == "bytes":
            from benchmarks.regularisers import OpBytes, uncounted_passes

            counter = OpBytes()
            compiled = job.mode.regularisers == "compiled"
            with counter:  # compiled: the eager ops alone, and the passes' bytes as inductor counted them
                step(uncounted_passes(counter) if compiled else job.passes)
            reply({"step_bytes": counter.bytes + job.info.get("regulariser_pass_bytes", 0)})
        elif command == "done":
            out = {}
            if cuda:
                out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                out["peak_increase_mib"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
            else:
                out["peak_increase_mib"] = peak_rss_mb() - base_rss_mb
            reply(out)
            return
        else:
            raise SystemExit(f"unknown command {command!r}")


def profile(args: argparse.Namespace, name: str, rows: int = 30) -> None:
    """One step of `name` under torch.profiler after the warm-up steps: the top ops by self time, to stderr."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    job = setup(args, name)
    for _ in range(max(args.warmup, 1)):
        job.step(job.passes)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if job.cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        job.step(job.passes)
    key = "self_device_time_total" if job.cuda else "self_cpu_time_total"
    log(prof.key_averages().table(sort_by=key, row_limit=rows))
    log(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows))


def reply(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Worker:
    """One mode in its own process, driven a step at a time."""

    def __init__(self, name: str) -> None:
        self.name = name
        cmd = [sys.executable, "-m", "benchmarks.train_step", *sys.argv[1:], "--worker", name]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"mode {self.name} died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> dict:
        out = self.ask("done")
        self.proc.wait()
        return out


# ---- the driver -------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.worker:
        run_mode(args, args.worker)
        return
    if args.profile:
        profile(args, args.profile)
        return
    if args.padding_only:
        print_result(padding_shares(args, args.modes.split(","), args.padding_only))
        return
    modes = args.modes.split(",")
    started = time.perf_counter()
    info: dict[str, dict] = {}
    times: dict[str, list[float]] = {name: [] for name in modes}
    cpu_times: dict[str, list[float]] = {name: [] for name in modes}

    def drive(group: list[str]) -> None:
        """Start `group`'s workers together, then run their steps interleaved, rotating the order every round."""
        workers = {name: Worker(name) for name in group}
        try:
            for name, w in workers.items():
                info[name] = w.ask(None)
            for i in range(args.warmup):
                for name, w in workers.items():
                    if i == 0 and args.flop_counter:
                        info[name]["flops_counter"] = w.ask("count")["flops_counter"]
                    else:
                        w.ask("warmup")
            for name, w in workers.items():  # one more untimed step: what autograd saves for backward
                info[name].update(w.ask("saved"))
                if name in (*REGULARISER_SHARE_MODES.values(), WITHOUT_REGULARISERS) and WITHOUT_REGULARISERS in modes:
                    info[name].update(w.ask("bytes"))  # and one more: the bytes its ops move
            log(f"warm: {', '.join(group)} ({time.perf_counter() - started:.0f} s)")
            for r in range(args.steps):
                order = group[r % len(group) :] + group[: r % len(group)]
                for name in order:
                    measured = workers[name].ask("step")
                    times[name].append(measured["time"])
                    cpu_times[name].append(measured["cpu"])
                log(f"step {r + 1}/{args.steps}: " + "  ".join(f"{n} {times[n][-1]:.2f}s" for n in group))
            for name, w in workers.items():
                info[name].update(w.close())
        finally:
            for w in workers.values():
                if w.proc.poll() is None:
                    w.proc.kill()

    if args.device.startswith("cuda"):
        for name in modes:  # one process at a time: each keeps its own CUDA memory pool
            drive([name])
    else:
        drive(modes)  # all alive at once, stepping in turn: machine noise falls on every mode alike

    first = info[modes[0]]
    result: dict = {
        "benchmark": "train_step",
        "device": args.device,
        "torch_threads": first["threads"] if not args.device.startswith("cuda") else None,
        "setting": (
            f"{args.model} {args.image_size}px/{args.patch_size}, batch {args.batch}, predictor "
            f"{args.predictor_width} wide depth {args.predictor_depth or 'default'}, "
            f"{'bf16' if args.bf16 else 'fp32'} autocast, d_text {args.text_dim}"
        ),
        "shapes": {
            "context_tokens": first["lc"],
            "target_blocks": first["m"],
            "target_tokens": first["lt"],
            "caption_words_padded": max((info[n]["s"] for n in modes if MODES[n].captions), default=None),
        },
        "steps_per_mode": f"{args.steps} timed (interleaved across modes) + {args.warmup} warmup",
    }
    per_mode = {}
    medians, cpu_medians, flops = {}, {}, {}
    counted = args.flop_counter  # FlopCounterMode on what each step computes; else the analytic count
    result["flops_from"] = "FlopCounterMode" if counted else "analytic"
    for name in modes:
        medians[name] = statistics.median(times[name])
        cpu_medians[name] = statistics.median(cpu_times[name])
        flops[name] = info[name]["flops_counter"] if counted else info[name]["flops"]["step"]
        entry = {
            "s_per_step": round(medians[name], 4),
            "s_per_step_all": [round(t, 3) for t in times[name]],
            "gflops_per_step": round(flops[name] / 1e9, 2),
            "gflops_per_step_analytic": round(info[name]["flops"]["step"] / 1e9, 2),
            "useful_over_computed_flops": round(info[name]["useful_over_computed"], 3),
            "useful_over_padded_flops": round(info[name]["useful_over_padded"], 3),
            "images_per_s": round(args.batch / medians[name], 1),
            "achieved_tflops": round(flops[name] / medians[name] / 1e12, 4),
            "saved_mib": round(info[name]["saved_bytes"] / 2**20, 1),
            "cross_attention_saved_mib": round(info[name]["cross_attention_saved_bytes"] / 2**20, 1),
        }
        if not args.device.startswith("cuda"):
            entry["process_cpu_s_per_step"] = round(cpu_medians[name], 4)
        if args.device.startswith("cuda"):
            entry["mfu"] = round(flops[name] / medians[name] / (args.peak_tflops * 1e12), 4)
            entry["peak_mem_mib"] = round(info[name]["peak_mib"])
        else:
            entry["peak_rss_increase_mib"] = round(info[name]["peak_increase_mib"])
        entry["forward_gflops"] = {k: round(v / 1e9, 2) for k, v in info[name]["flops"]["forward"].items()}
        per_mode[name] = entry
    result["modes"] = per_mode
    if "none" in modes:
        for name in modes:
            if name == "none":
                continue
            time_ratio = medians[name] / medians["none"]
            flop_ratio = flops[name] / flops["none"]
            result[f"{name}_vs_none_time"] = round(time_ratio, 3)
            result[f"{name}_vs_none_flops"] = round(flop_ratio, 3)
            result[f"{name}_time_ratio_over_flop_ratio"] = round(time_ratio / flop_ratio, 3)
            if not args.device.startswith("cuda"):
                # Process CPU time (all threads): less sensitive than wall time to other jobs taking the cores.
                result[f"{name}_cpu_time_ratio_over_flop_ratio"] = round(
                    cpu_medians[name] / cpu_medians["none"] / flop_ratio, 3
                )
        if "cross8" in modes:
            result["time_ratio_over_flop_ratio"] = result["cross8_time_ratio_over_flop_ratio"]
    goals = []
    if "cross8" in modes and "none" in modes:
        goals.append(result["time_ratio_over_flop_ratio"] <= 1.2)
    for plain in ("cross8", "cross8_before"):  # the lean cross-attention against the old, same weights and batch
        lean, ref = f"{plain}_mha", f"{plain}_ref"
        if lean in modes and ref in modes:
            saved_ratio = info[ref]["cross_attention_saved_bytes"] / max(info[lean]["cross_attention_saved_bytes"], 1)
            result[f"{lean}_cross_attention_saved_ref_over_lean"] = round(saved_ratio, 2)
            result[f"{lean}_saved_ref_over_lean"] = round(info[ref]["saved_bytes"] / info[lean]["saved_bytes"], 2)
            result[f"{lean}_time_lean_over_ref"] = round(medians[lean] / medians[ref], 3)
            if not args.device.startswith("cuda"):
                result[f"{lean}_cpu_time_lean_over_ref"] = round(cpu_medians[lean] / cpu_medians[ref], 3)
            goals.append(saved_ratio >= 2)
    if goals:
        result["goal_met"] = all(goals)
    if WITHOUT_REGULARISERS in modes:
        shares = {}
        without = WITHOUT_REGULARISERS
        for key, name in REGULARISER_SHARE_MODES.items():
            if name not in modes:
                continue
            moved = info[name]["step_bytes"] - info[without]["step_bytes"]
            shares[key] = {
                "time_share": round(1 - medians[without] / medians[name], 3),
                "mib_per_step": round(moved / 2**20, 1),
                "bytes_share": round(moved / info[name]["step_bytes"], 3),
            }
            if not args.device.startswith("cuda"):
                shares[key]["cpu_time_share"] = round(1 - cpu_medians[without] / cpu_medians[name], 3)
        result["cross8_before_regularisers"] = shares
        for key in ("today", "compiled"):
            if key in shares and "reference" in shares:
                result[f"cross8_before_regularisers_bytes_{key}_over_reference"] = round(
                    shares[key]["mib_per_step"] / shares["reference"]["mib_per_step"], 3
                )
        if "cross8_before_regularisers_bytes_compiled_over_reference" in result:  # issue 32 point 1's goal
            result["regularisers_goal_met"] = result["cross8_before_regularisers_bytes_compiled_over_reference"] <= 0.25
    for packed in ("none", "cross8_before"):  # the step packed against the step on padded rows, side by side
        if packed in modes and f"{packed}_rows" in modes:
            rows = f"{packed}_rows"
            result[f"{packed}_packed_vs_rows_time"] = round(medians[packed] / medians[rows], 3)
            result[f"{packed}_packed_vs_rows_flops"] = round(flops[packed] / flops[rows], 3)
            if not args.device.startswith("cuda"):
                result[f"{packed}_packed_vs_rows_cpu_time"] = round(cpu_medians[packed] / cpu_medians[rows], 3)
    for padded in ("none", "cross8_before"):  # what keeping every context patch (pad) costs against I-JEPA's cut
        if padded in modes and f"{padded}_cut" in modes:
            cut = f"{padded}_cut"
            result[f"{padded}_pad_vs_cut_time"] = round(medians[padded] / medians[cut], 3)
            result[f"{padded}_pad_vs_cut_context_tokens"] = round(info[padded]["lc"] / info[cut]["lc"], 3)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print_result(result)


if __name__ == "__main__":
    main()
