"""Validation in chunks: the held-out images split across processes, each process's share run a per-rank training
batch at a time, the sums all-reduced. Memory does not depend on how many images are held out.

The held-out images are laid out partition by partition (`train.partitions`), and a node's processes run only its
partitions' images, so validating reads nothing outside the node's partitions; no chunk spans two partitions.

The figures are those of one batch of every validation image: the prediction loss with the images' own, shuffled
(each image gets the previous image's captions in its partition, across chunk and process boundaries, the first the
partition's last image's) and no captions, the share of
positive patch–word cosines per layer, and RankMe of the target encoder's features. RankMe needs the features'
singular values; they are the square roots of the eigenvalues of the features' D×D Gram matrix, which sums over
chunks and processes.

Two shortcuts are measured beside them. Position alone predicts much of a target on small, regular data: the
position-only loss is what a predictor that outputs, at each target position, that position's mean target feature
over the other validation images (leave-one-out) reaches, with the run's loss; and RankMe with each position's mean
removed (the Gram matrix less Σ_p s_p s_pᵀ / n, s_p the features' sum at position p) is the rank of what varies
between images rather than between positions; `val_position_share` is the share of the features' variance those
means explain. The position-only loss needs those means first: a second pass of the
target encoder over the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.config import resolved_predictor_heads
from train.data import Batch, StepBatches
from train.losses import cosine_histogram, gather_positions, histogram_quantiles, prediction_loss
from train.masks import padded_length
from train.metrics import effective_rank_from_gram
from train.partitions import node_partitions
from train.predictor import TextBatch
from train.step import TrainStep, to_device, without_captions
from train.vit import VisionTransformer

# The regularisers' patch–word cosines before rectification, per layer: these quantiles of their distribution.
COSINE_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclass(frozen=True)
class Chunk:
    rows: slice  # rows of the validation set
    weight: float  # 0 for a chunk run only so that every process runs as many forwards (FSDP's are collective)
    within: slice  # the rows of the chunk's partition


def _node_chunks(bounds: Sequence[int], parts: range, chunk: int) -> list[Chunk]:
    return [
        Chunk(slice(start, min(start + chunk, bounds[p + 1])), 1.0, slice(bounds[p], bounds[p + 1]))
        for p in parts
        for start in range(bounds[p], bounds[p + 1], chunk)
    ]


def chunks_of(bounds: Sequence[int], chunk: int, rank: int, world: int, nodes: int = 1) -> list[Chunk]:
    """This process's chunks of a validation set laid out by partition (partition p's rows are
    `bounds[p]:bounds[p+1]`): chunks of at most `chunk` rows within a partition, those of a node's partitions dealt
    to its processes in turn. Every process runs as many chunks as the busiest (one with none left reruns its node's
    first chunk, or with none at all the first one, weighted 0)."""
    count, per_node = len(bounds) - 1, world // nodes
    by_node = [_node_chunks(bounds, node_partitions(node, nodes, count), chunk) for node in range(nodes)]
    rounds = max(math.ceil(len(c) / per_node) for c in by_node)
    mine, local = by_node[rank // per_node], rank % per_node
    filler = mine[0] if mine else next(c for c in by_node if c)[0]
    out = []
    for r in range(rounds):
        c = r * per_node + local
        out.append(mine[c] if c < len(mine) else Chunk(filler.rows, 0.0, filler.within))
    return out


def _shuffled(data: StepBatches, ids: np.ndarray, part: Chunk, step: TrainStep, text: TextBatch) -> TextBatch:
    """The chunk's captions moved to the next image, the first row getting those of the image before it in its
    partition (the partition's last image's before its first): the shuffled control, as one batch of every
    validation image would have it."""
    within = part.within
    before = within.start + (part.rows.start - 1 - within.start) % (within.stop - within.start)
    first = step.text(to_device(data.validation_batch(ids, slice(before, before + 1), within), step.device))
    assert first is not None, "the images before and in a chunk come from the same dataset"
    longest = max(first.tokens.shape[2], text.tokens.shape[2])
    tokens = [F.pad(t, (0, 0, 0, longest - t.shape[2])) for t in (first.tokens, text.tokens[:-1])]
    lengths = torch.cat([first.lengths, text.lengths[:-1]])
    # counted for the packed K/V projection and the regularisers as the step counts its own (one sync a chunk, in
    # validation alone)
    per_image = lengths.sum(dim=1).tolist()
    words = None if first.words is None or text.words is None else sum(per_image)
    image_words = None if text.image_words is None else padded_length(max(max(per_image, default=0), 1))
    return TextBatch(torch.cat(tokens), lengths, words, image_words)


@torch.no_grad()
def validate_in_chunks(
    step: TrainStep,
    target: VisionTransformer,
    data: StepBatches,
    ids: np.ndarray,
    chunk: int,
    rank: int,
    world: int,
    bounds: Sequence[int] | None = None,
    nodes: int = 1,
) -> dict[str, Any]:
    """Validation figures of the images `ids` (by partition, `bounds`; default one), this process running its chunks
    of `chunk` rows; every process of the group calls it (the sums are all-reduced) and gets the same figures."""
    device = step.device
    # rows, then Σ rows·loss for own / shuffled / no captions; then per layer Σ pairs·positive share, and Σ pairs
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    positive: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    position_sums: torch.Tensor | None = None  # [L, D]: Σ over images of the layer-normed target features
    histogram: torch.Tensor | None = None  # [layers, bins]: the regularisers' patch–word cosines
    parts = chunks_of(bounds if bounds is not None else [0, len(ids)], chunk, rank, world, nodes)
    for part in parts:
        batch: Batch = data.validation_batch(ids, part.rows, part.within)
        mb = to_device(batch, device)
        text = step.text(mb)
        rows = part.weight * len(mb)
        true = step.losses(step.model, mb, text)
        shuffled = _shuffled(data, ids, part, step, text) if text is not None else None
        notext = without_captions(text) if text is not None else None
        losses = [true.predict, step.losses(step.model, mb, shuffled).predict]
        losses.append(step.losses(step.model, mb, notext).predict)
        sums += torch.stack([torch.ones((), device=device), *[loss.double() for loss in losses]]) * rows
        if true.positive_fraction is not None and true.cosine_pairs is not None and text is not None:
            pairs = part.weight * true.cosine_pairs.double()
            counted = torch.cat([true.positive_fraction.double() * pairs, pairs[None]])
            positive = counted if positive is None else positive + counted
            assert true.output is not None
            cfg = step.cfg
            spread = part.weight * cosine_histogram(
                true.output.queries,
                true.output.keys,
                text.word_mask,
                true.output.token_valid,
                cfg.regulariser_cosine,
                resolved_predictor_heads(cfg),
            )
            histogram = spread if histogram is None else histogram + spread
        normed = _normed_targets(step, target, mb).double()
        flat = normed.reshape(-1, normed.shape[-1])
        contribution = part.weight * (flat.T @ flat)
        gram = contribution if gram is None else gram + contribution
        position = part.weight * normed.sum(dim=0)
        position_sums = position if position_sums is None else position_sums + position
    assert gram is not None and position_sums is not None, "a validation set has at least one image"
    if world > 1:
        for t in (sums, gram, position_sums, *(t for t in (positive, histogram) if t is not None)):
            dist.all_reduce(t)
    n = float(sums[0])
    out: dict[str, Any] = {
        "val_loss_predict": float(sums[1]) / n,
        "val_loss_predict_shuffled": float(sums[2]) / n,
        "val_loss_predict_notext": float(sums[3]) / n,
        "val_loss_position_only": _position_only_loss(step, target, data, ids, parts, position_sums, n, world),
    }
    if positive is not None:
        out["val_positive_cosine"] = [round(float(v), 5) for v in positive[:-1] / positive[-1].clamp_min(1)]
    if histogram is not None:
        out["val_cosine_quantiles"] = histogram_quantiles(histogram, COSINE_QUANTILES)
    out["val_rankme"] = effective_rank_from_gram(gram)
    out["val_rankme_centred"] = effective_rank_from_gram(gram - position_sums.T @ position_sums / n)
    out["val_position_share"] = position_share(gram, position_sums, n)
    return out


def position_share(gram: torch.Tensor, position_sums: torch.Tensor, images: float) -> float:
    """The share of the features' variance that each position's mean over the images explains: 1 − (variance
    around each position's mean) / (variance around the overall mean), from the Gram matrix over every token and
    the per-position sums `[L, D]` over `images` images."""
    total_sum = position_sums.sum(dim=0)
    tokens = images * position_sums.shape[0]
    around_overall = torch.trace(gram) - total_sum @ total_sum / tokens
    around_positions = torch.trace(gram) - (position_sums * position_sums).sum() / images
    return float(1 - around_positions / around_overall.clamp_min(1e-12))


def _normed_targets(step: TrainStep, target: VisionTransformer, mb: Any) -> torch.Tensor:
    """float32 `[b, L, D]`: the target encoder's layer-normed features of a micro-batch's images (the targets)."""
    with torch.autocast(step.device.type, dtype=step.dtype, enabled=step.cfg.bf16):
        features = target(step.normalise(mb.images))
    return F.layer_norm(features.float(), features.shape[-1:])


def _position_only_loss(
    step: TrainStep,
    target: VisionTransformer,
    data: StepBatches,
    ids: np.ndarray,
    parts: list[Chunk],
    position_sums: torch.Tensor,
    n: float,
    world: int,
) -> float:
    """The run's loss of predicting each target patch by its position's mean over the other validation images (the
    image's own features left out of the mean), over the same targets as the prediction loss."""
    total = torch.zeros(2, dtype=torch.float64, device=step.device)
    for part in parts:
        mb = to_device(data.validation_batch(ids, part.rows, part.within), step.device)
        normed = _normed_targets(step, target, mb)
        means = (position_sums[None] - normed.double()) / max(n - 1, 1.0) if n > 1 else position_sums[None] / n
        predicted, actual = (gather_positions(t, mb.targets) for t in (means.float(), normed))
        loss = prediction_loss(predicted, actual, step.cfg.loss)
        total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=step.device)]) * (
            part.weight * len(mb)
        )
    if world > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))
