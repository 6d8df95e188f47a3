"""One optimisation step on the device, apart from the data path: copies in, micro-batches, backward, AdamW, EMA.

No image decoding or embedding store here (torch and the model modules only; torchvision only for a batch whose JPEGs
are decoded on the device), so `benchmarks/gpu_check.py` drives the very step the trainer runs on synthetic tensors.

Captions arrive packed (every caption's tokens back to back, float16 or int8 with scales) and are dequantized and
padded on the device: the host copies only real tokens, 2–8× fewer bytes than a padded batch.

Nothing in a step waits for the device: the loss parts are summed on the device and read (one sync) only when the
loop logs; the normalisation constants are buffers; copies come from pinned memory on a side stream (CUDA), a step
ahead of the compute that needs them.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from train.config import TrainConfig
from train.data import Normalise
from train.jepa import JEPA, ema_update
from train.losses import EAGER_PASSES, RegulariserPasses, sigreg_directions
from train.masks import padded_length
from train.objective import StepLosses, compute_losses
from train.packing import TokenLayout
from train.predictor import TextBatch
from train.vit import VisionTransformer

if TYPE_CHECKING:
    from train.data import Batch


@dataclass
class DeviceBatch:
    """A micro-batch on the device: uint8 images, captions padded there as float16 (converted by the step)."""

    images: torch.Tensor  # uint8 [b, 3, H, W]
    context: torch.Tensor  # int64 [b, Lc]
    context_lengths: torch.Tensor  # int64 [b]
    targets: torch.Tensor  # int64 [b, M, Lt]
    tokens: torch.Tensor | None  # float16 [b, N, S, d_text]
    lengths: torch.Tensor | None  # int64 [b, N]
    images_with_text: int  # counted on the host: the regularisers' denominator
    context_tokens: int  # real context patches, counted on the host: the packed length (`train.packing`)
    words: int  # real caption words, counted on the host: the K/V projection's packed length
    replaced: int = 0  # rows whose JPEG no decoder could read (`--decode gpu`): another row's pixels, no captions
    image_words: int | None = None  # the most real words of one image, rounded up to 8, on the host (`TextBatch`)

    def __len__(self) -> int:
        return self.images.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.images, self.context, self.context_lengths, self.targets, self.tokens, self.lengths)
            if t is not None
        ]


def to_device(batch: Batch, device: torch.device) -> DeviceBatch:
    """`batch` copied to `device` (asynchronous when it is pinned, the DataLoader's doing on CUDA); its packed
    captions padded there, and JPEGs it carries (`--decode gpu`) decoded there."""

    def move(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device, non_blocking=True)
        # On the CPU `to` is no copy: what is in a worker's shared buffer is copied out, for the worker reuses it.
        return moved.clone() if moved.data_ptr() == t.data_ptr() and t.is_shared() else moved

    images = move(batch.images)
    unread: list[int] = []
    if batch.encoded is not None:
        from train.images import decode_on_device

        unread = decode_on_device(images, batch.encoded)
    images_with_text = batch.images_with_text()
    words = 0
    image_words = None
    tokens = lengths = None
    if batch.tokens is not None and batch.lengths is not None:
        longest = padded_length(max(int(batch.lengths.max()) if batch.lengths.numel() else 0, 1))  # on the host
        scales, channel_scales = batch.scales, batch.channel_scales
        lengths = move(batch.lengths)
        tokens = pad_packed(  # read only to be padded into new memory: moved without `move`'s CPU copy
            batch.tokens.to(device, non_blocking=True),
            None if scales is None else scales.to(device, non_blocking=True),
            None if channel_scales is None else channel_scales.to(device, non_blocking=True),
            lengths,
            longest,
        )
        words = int(batch.lengths.sum())
        if unread:  # the row's pixels are another image's: its captions would describe the wrong one
            images_with_text -= int((batch.lengths[unread].sum(dim=1) > 0).sum())
            words -= int(batch.lengths[unread].sum())
            lengths = lengths.clone()  # on the CPU `move` hands back the host batch's own tensor
            lengths[unread] = 0
        per_image = batch.lengths.sum(dim=1)
        per_image[unread] = 0
        image_words = padded_length(max(int(per_image.max()) if per_image.numel() else 0, 1))
    return DeviceBatch(
        images,
        move(batch.context),
        move(batch.context_lengths),
        move(batch.targets),
        tokens,
        lengths,
        images_with_text,
        int(batch.context_lengths.sum()),
        words,
        len(unread),
        image_words,
    )


def pad_packed(
    tokens: torch.Tensor,
    scales: torch.Tensor | None,
    channel_scales: torch.Tensor | None,
    lengths: torch.Tensor,
    longest: int,
) -> torch.Tensor:
    """float16 `[b, N, longest, d]`, zero-padded, from packed tokens `[sum of lengths, d]` (float16, or int8 with
    `scales` and `channel_scales`) and their `lengths` `[b, N]`, all on one device. No step waits for the host: the
    token count is the tensor's length, and every index is computed where the tokens are."""
    from embedding_cache.codec import dequantize

    b, n = lengths.shape
    flat = lengths.reshape(-1)
    values = dequantize(tokens, scales, channel_scales, dtype=torch.float16)
    out = torch.zeros(b * n * longest, tokens.shape[-1], dtype=torch.float16, device=tokens.device)
    slot = torch.repeat_interleave(torch.arange(b * n, device=tokens.device), flat, output_size=tokens.shape[0])
    starts = torch.cumsum(flat, 0) - flat
    where = slot * longest + torch.arange(tokens.shape[0], device=tokens.device) - starts[slot]
    out.index_copy_(0, where, values)
    return out.view(b, n, longest, tokens.shape[-1])


def micro_batches(batch: Batch, k: int) -> list[Batch]:
    """The step's batch as `k` micro-batches of consecutive rows: together exactly the batch's rows, each with the
    masks drawn for its rows of the global batch (only padding is dropped)."""
    size = len(batch) // k
    return [batch.rows(i * size, (i + 1) * size) for i in range(k)]


def on_device(
    batches: Iterable[Batch], device: torch.device, k: int
) -> Generator[tuple[Batch, list[DeviceBatch]], None, None]:
    """Each batch with its `k` micro-batches on `device`. While step s runs, a thread of its own takes batch s + 1
    from `batches` (the DataLoader), queues its copies (on CUDA on a side stream, so they overlap the step's
    compute) and decodes its JPEGs (`--decode gpu`, which waits on the host for those copies): the trainer's thread
    never waits for the loader, a copy or nvJPEG while the device has work. On CPU the same with plain copies."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    source = iter(batches)

    def fetch() -> tuple[Batch, list[DeviceBatch], torch.cuda.Event | None] | None:
        if stream is not None:
            torch.cuda.set_device(device)  # per thread: this one's would otherwise be GPU 0 on every rank
        batch = next(source, None)
        return None if batch is None else _copy(batch, device, k, stream)

    fetcher = ThreadPoolExecutor(1, thread_name_prefix="tcjepa-batches")
    upcoming = fetcher.submit(fetch)
    try:
        while (pending := upcoming.result()) is not None:
            upcoming = fetcher.submit(fetch)
            yield _ready(pending, device)
    finally:
        # Not waited for: closed early (a stop, an error), the fetch under way may be waiting on the loader, which
        # ends when its owner ends the workers, after this.
        fetcher.shutdown(wait=False, cancel_futures=True)


def _copy(
    batch: Batch, device: torch.device, k: int, stream: torch.cuda.Stream | None
) -> tuple[Batch, list[DeviceBatch], torch.cuda.Event | None]:
    """The micro-batches on the device; the worker's caption buffer is then released (the captions were padded into
    new memory on the CPU; on CUDA they come from pinned copies, or a pageable buffer is read before `to` returns)."""
    if stream is None:
        micro = [to_device(mb, device) for mb in micro_batches(batch, k)]
        batch.release()
        return batch, micro, None
    with torch.cuda.stream(stream):
        micro = [to_device(mb, device) for mb in micro_batches(batch, k)]
        done = torch.cuda.Event()
        done.record(stream)
    batch.release()
    return batch, micro, done


def _ready(
    pending: tuple[Batch, list[DeviceBatch], torch.cuda.Event | None], device: torch.device
) -> tuple[Batch, list[DeviceBatch]]:
    """The compute stream waits for the copies (on the device, not the host), and the memory they were made in is
    not reused before the compute stream is done with it."""
    batch, micro, done = pending
    if done is not None:
        compute = torch.cuda.current_stream(device)
        compute.wait_event(done)
        for mb in micro:
            for t in mb.tensors():
                t.record_stream(compute)
    return batch, micro


def without_captions(text: TextBatch) -> TextBatch:
    """The same batch with every caption marked missing: the unconditioned prediction, through the same graph (a
    compiled predictor is not traced again for text=None)."""
    return TextBatch(text.tokens, torch.zeros_like(text.lengths), words=0, image_words=padded_length(1))


@contextmanager
def _reduce_gradients(module: nn.Module, now: bool) -> Iterator[None]:
    """Gradient reduction across processes in this backward (`now`) or deferred to the step's last micro-batch:
    DDP skips its all-reduce; FSDP still reduce-scatters (sharded gradients keep the memory low) and, in HSDP,
    defers the all-reduce across nodes."""
    from torch.distributed.fsdp import FSDPModule

    if now:
        yield
    elif isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_all_reduce(False)
        try:
            yield
        finally:
            module.set_requires_all_reduce(True)
    else:
        yield


class TrainStep:
    """The trainer's step: `step(micro_batches, momentum)` does forward and backward of every micro-batch, one AdamW
    update and the EMA of the target encoder; it returns the step's loss parts (total, predict, sparse, consistency,
    sigreg)
    and the gradient norm as a tensor on the device, never read here."""

    def __init__(
        self,
        model: JEPA,
        module: nn.Module,
        target: VisionTransformer,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        device: torch.device,
        regulariser_passes: RegulariserPasses = EAGER_PASSES,
    ) -> None:
        self.model = model  # the JEPA itself: its parameters and encoder (EMA source)
        self.module = module  # what runs forward and backward: the model, or its DDP wrapper
        self.target = target
        self.optimizer = optimizer
        self.cfg = cfg
        self.device = device
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        self.normalise = Normalise().to(device)
        self.masked = cfg.context_equalise == "pad"  # cut: rows are never padded, attention needs no mask
        self.regulariser_passes = regulariser_passes  # compiled where the blocks are (`train.parallel`)

    def text(self, mb: DeviceBatch) -> TextBatch | None:
        """The micro-batch's captions in the compute dtype, padded to the batch's longest (rounded up to a multiple of
        8): compiled blocks take the caption length as a dynamic dim, so it is never padded to max_words."""
        if mb.tokens is None or mb.lengths is None:
            return None
        tokens = mb.tokens.to(self.dtype)
        # A fresh tensor, not a view of the loader's: a compiled graph guards on whether its inputs are views, and
        # the shuffled and caption-less controls of validation are not.
        return TextBatch(tokens, mb.lengths.clone(), mb.words, mb.image_words)

    def losses(
        self, module: nn.Module, mb: DeviceBatch, text: TextBatch | None, directions: torch.Tensor | None = None
    ) -> StepLosses:
        """`mb`'s losses through `module` with captions `text` (the batch's own, shuffled ones, or none); with SIGReg's
        `directions`, its term too (training only: validation reports the prediction loss)."""
        layout = None
        if self.masked:
            valid = torch.arange(mb.context.shape[1], device=mb.context.device) < mb.context_lengths[:, None]
            layout = TokenLayout.of(valid, mb.context_tokens)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.cfg.bf16):
            return compute_losses(
                module,
                self.target,
                self.normalise(mb.images),
                mb.context,
                mb.targets,
                text,
                self.cfg,
                layout,
                directions,
                self.regulariser_passes,
            )

    def _text_shares(self, micro: list[DeviceBatch]) -> list[torch.Tensor | float]:
        """Each micro-batch's weight for the regularisers: its images with captions over the global batch's, times
        the number of processes (gradients and logged losses are averaged over them). Every process's rows then
        count as in one batch, however many captioned images each has. The global count is summed on the device
        (no wait for it here)."""
        mine = [mb.images_with_text for mb in micro]
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [n / max(sum(mine), 1) for n in mine]
        total = torch.full((), float(sum(mine)), device=self.device)  # a fill, not a copy from the host
        dist.all_reduce(total)
        scale = dist.get_world_size() / total.clamp_min(1)
        return [n * scale for n in mine]

    def __call__(self, micro: list[DeviceBatch], momentum: float, step: int = 0) -> torch.Tensor:
        """One optimiser step (`step`: the run's step, which draws SIGReg's directions); returns the loss parts
        (total, predict, sparse, consistency, sigreg) and the gradient norm before clipping, on the device."""
        images = sum(len(mb) for mb in micro)
        text_shares = self._text_shares(micro)
        parts = torch.zeros(5, device=self.device)
        directions = None
        if self.cfg.sigreg > 0:
            width = self.model.encoder.width
            directions = sigreg_directions(width, self.cfg.sigreg_directions, self.cfg.seed, step, self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for i, (mb, text_share) in enumerate(zip(micro, text_shares)):
            with _reduce_gradients(self.module, now=i == len(micro) - 1):
                losses = self.losses(self.module, mb, self.text(mb), directions)
                share = losses.weighted(len(mb) / images, text_share, self.cfg)
                with record_function("backward"):  # on CUDA the kernels run on autograd's thread, outside it
                    share.total.backward()
            sig = share.sigreg if share.sigreg is not None else share.predict.new_zeros(())
            parts += torch.stack([share.total, share.predict, share.sparse, share.consistency, sig]).detach().float()
        norm = nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.grad_clip, norm)
        with record_function("optimizer"):
            self.optimizer.step()
        reshard = getattr(self.target, "reshard", None)
        if reshard is not None:  # FSDP: the target's forward left its full parameters; the EMA works on shards
            reshard()
        with record_function("ema"):
            ema_update(self.target, self.model.encoder, momentum)
        return torch.cat([parts, whole(norm).reshape(1).float()])


def whole(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor. Under FSDP2 the gradients are shards (DTensors), and the norm they give
    is a DTensor that clipping takes as it is; made whole, every process holds the global norm, as under DDP."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def choose_cuda_kernels() -> None:
    """TF32 for float32 matmuls and convolutions on CUDA (all of them without `bf16`, and those autocast keeps in
    float32 with it), and no cuDNN attention: our attentions take a key mask whose length changes every step, and
    cuDNN's SDPA builds a plan per new shape. On an H200 a compiled ViT-B/16 step on fresh masks took 100 ms with it
    and 39 ms with the kernel SDPA falls back to (docs/development.md, "On a GPU")."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)
