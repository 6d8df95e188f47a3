"""Validation in chunks: the held-out images split across processes, each process's share run a per-rank training
batch at a time, the sums all-reduced. Memory does not depend on how many images are held out.

The figures are those of one batch of every validation image: the prediction loss with the images' own, shuffled
(each image gets the previous image's captions, across chunk and process boundaries) and no captions, the share of
positive patch–word cosines per layer, and RankMe of the target encoder's features. RankMe needs the features'
singular values; they are the square roots of the eigenvalues of the features' D×D Gram matrix, which sums over
chunks and processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.data import Batch, StepBatches
from train.metrics import effective_rank_from_gram
from train.predictor import TextBatch
from train.step import TrainStep, to_device, without_captions
from train.vit import VisionTransformer


@dataclass(frozen=True)
class Chunk:
    rows: slice  # rows of the validation set
    weight: float  # 0 for a chunk run only so that every process runs as many forwards (FSDP's are collective)


def chunks_of(n: int, chunk: int, rank: int, world: int) -> list[Chunk]:
    """This process's chunks of a validation set of `n` images: consecutive chunks of `chunk` rows dealt to the
    processes in turn, every process running the same number (one with none left reruns chunk 0, weighted 0)."""
    starts = list(range(0, n, chunk))
    rounds = math.ceil(len(starts) / world)
    out = []
    for r in range(rounds):
        c = r * world + rank
        if c < len(starts):
            out.append(Chunk(slice(starts[c], min(starts[c] + chunk, n)), 1.0))
        else:
            out.append(Chunk(slice(0, min(chunk, n)), 0.0))
    return out


def _shuffled(data: StepBatches, ids: np.ndarray, rows: slice, step: TrainStep, text: TextBatch) -> TextBatch:
    """The chunk's captions moved to the next image, the first row getting those of the image before it (the last
    image's before the first): the shuffled control, as one batch of every validation image would have it."""
    before = (rows.start - 1) % len(ids)
    first = step.text(to_device(data.validation_batch(ids, slice(before, before + 1)), step.device))
    assert first is not None, "the images before and in a chunk come from the same dataset"
    longest = max(first.tokens.shape[2], text.tokens.shape[2])
    tokens = [F.pad(t, (0, 0, 0, longest - t.shape[2])) for t in (first.tokens, text.tokens[:-1])]
    return TextBatch(torch.cat(tokens), torch.cat([first.lengths, text.lengths[:-1]]))


@torch.no_grad()
def validate_in_chunks(
    step: TrainStep, target: VisionTransformer, data: StepBatches, ids: np.ndarray, chunk: int, rank: int, world: int
) -> dict[str, Any]:
    """Validation figures of the images `ids`, this process running its chunks of `chunk` rows; every process of the
    group calls it (the sums are all-reduced) and gets the same figures."""
    device = step.device
    # rows, then Σ rows·loss for own / shuffled / no captions; then per layer Σ pairs·positive share, and Σ pairs
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    positive: torch.Tensor | None = None
    gram: torch.Tensor | None = None
    for part in chunks_of(len(ids), chunk, rank, world):
        batch: Batch = data.validation_batch(ids, part.rows)
        mb = to_device(batch, device)
        text = step.text(mb)
        rows = part.weight * len(mb)
        true = step.losses(step.model, mb, text)
        shuffled = _shuffled(data, ids, part.rows, step, text) if text is not None else None
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
