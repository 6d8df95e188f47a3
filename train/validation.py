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

from train.data import Batch, StepBatches
from train.metrics import effective_rank_from_gram
from train.partitions import node_partitions
from train.predictor import TextBatch
from train.step import TrainStep, to_device, without_captions
from train.vit import VisionTransformer


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
    return TextBatch(torch.cat(tokens), torch.cat([first.lengths, text.lengths[:-1]]))


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
    for part in chunks_of(bounds if bounds is not None else [0, len(ids)], chunk, rank, world, nodes):
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
        if true.positive_fraction is not None and true.cosine_pairs is not None:
            pairs = part.weight * true.cosine_pairs.double()
            counted = torch.cat([true.positive_fraction.double() * pairs, pairs[None]])
            positive = counted if positive is None else positive + counted
        with torch.autocast(device.type, dtype=step.dtype, enabled=step.cfg.bf16):
            features = target(step.normalise(mb.images))
        flat = F.layer_norm(features.float(), features.shape[-1:]).reshape(-1, features.shape[-1]).double()
        contribution = part.weight * (flat.T @ flat)
        gram = contribution if gram is None else gram + contribution
    assert gram is not None, "a validation set has at least one image"
    if world > 1:
        for t in (sums, gram, *([positive] if positive is not None else [])):
            dist.all_reduce(t)
    n = float(sums[0])
    out: dict[str, Any] = {
        "val_loss_predict": float(sums[1]) / n,
        "val_loss_predict_shuffled": float(sums[2]) / n,
        "val_loss_predict_notext": float(sums[3]) / n,
    }
    if positive is not None:
        out["val_positive_cosine"] = [round(float(v), 5) for v in positive[:-1] / positive[-1].clamp_min(1)]
    out["val_rankme"] = effective_rank_from_gram(gram)
    return out
