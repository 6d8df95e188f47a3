"""The training step in one process (test_step, test_compile): a tiny float32 model, synthetic batches, the
trainer's step on the CPU, and comparing the models two ways of stepping leave."""

from __future__ import annotations

from typing import Any

from train.config import TrainConfig

STEP_TEXT_DIM = 16
STEP_GRID = (8, 8)
# A tiny model for steps on synthetic batches, float32 so that ways of computing the same update agree to rounding.
STEP_CONFIG = TrainConfig(
    model="vit_tiny",
    image_size=64,
    patch_size=8,
    depth=2,
    width=64,
    heads=2,
    predictor_width=32,
    predictor_depth=2,
    predictor_heads=2,
    captions_per_image=3,
    max_words=10,
    min_context=4,
    batch_size=8,
    bf16=False,
    grad_clip=1.0,
    cache="unused",
    store="unused",
)


def step_batch(step: int, cfg: TrainConfig = STEP_CONFIG) -> Any:
    """A synthetic batch of `cfg`'s shapes; 40% of its images without any caption, so that micro-batches differ in
    how many images the regularisers average."""
    from benchmarks.gpu_check import synthetic_batch

    return synthetic_batch(cfg, STEP_GRID, step, STEP_TEXT_DIM, missing=0.4)


def train_steps(cfg: TrainConfig, model: Any, target: Any, batches: list) -> list:
    """The loss parts of one optimizer step per batch, taken by the trainer's step on the CPU."""
    import torch

    from train.optim import make_optimizer
    from train.step import TrainStep, on_device

    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    step = TrainStep(model, model, target, optimizer, cfg, torch.device("cpu"))
    return [step(micro, 0.99) for _, micro in on_device(batches, torch.device("cpu"), cfg.accum_steps)]


def assert_same_models(a: Any, b: Any, rtol: float, atol: float) -> None:
    """Every entry of two models' state dicts agrees within `atol` plus `rtol` of that tensor's largest magnitude.

    Relative to the tensor, not to each element: AdamW divides by the root of the squared gradients, so an element
    whose gradient is near zero moves by up to the learning rate on float32 rounding noise alone."""
    import torch

    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        scale = float(y.abs().max()) if y.is_floating_point() and y.numel() else 0.0
        torch.testing.assert_close(x, y, rtol=0.0, atol=atol + rtol * scale, msg=name)
