"""Schedules as pure functions of the step: resuming at step s needs no replay.

Each schedule is a small frozen dataclass; `schedule(step)` gives its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from `start` to `peak` over `warmup` steps, then cosine from `peak` to `final` at `total`."""

    start: float
    peak: float
    final: float
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.start + (self.peak - self.start) * step / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.final + 0.5 * (self.peak - self.final) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Cosine:
    """Half-cosine from `start` (step 0) to `end` (step `total` and after)."""

    start: float
    end: float
    total: int

    def __call__(self, step: int) -> float:
        progress = min(step / max(self.total, 1), 1.0)
        return self.end + 0.5 * (self.start - self.end) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Linear:
    """Straight line from `start` (step 0) to `end` (step `total` and after)."""

    start: float
    end: float
    total: int

    def __call__(self, step: int) -> float:
        progress = min(step / max(self.total, 1), 1.0)
        return self.start + (self.end - self.start) * progress
