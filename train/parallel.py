"""How the models run on many processes and fast on one: DDP, FSDP2 or HSDP around them, compiled blocks and blocks
whose activations are recomputed in the backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.core.errors import UserError
from train.config import TrainConfig
from train.dynamic_shapes import mark_dynamic, without_duck_sizing
from train.jepa import JEPA
from train.losses import EAGER_PASSES, RegulariserPasses, compiled_regulariser_passes
from train.packing import TokenLayout
from train.predictor import LayerCaptions, TokenCaptions
from train.runtime import processes_per_node
from train.vit import SelfAttention, VisionTransformer


def wrap_models(
    model: JEPA, target: VisionTransformer, cfg: TrainConfig, device: torch.device, compile_backend: str = "inductor"
) -> torch.nn.Module:
    """The module that trains: blocks compiled (by `compile_backend`) and/or checkpointed in place, then, in a process
    group, DDP around the JEPA, or FSDP2 sharding of the JEPA and the target alike (the same mesh, block by block, so
    the EMA is shard-local)."""
    if cfg.attention == "jagged":
        if cfg.compile and device.type != "cuda":
            raise UserError(
                "attention jagged cannot be compiled off CUDA (there SDPA runs nested rows through its math kernel, "
                "which torch.compile cannot trace): drop --compile or use --attention masked"
            )
        if cfg.checkpoint_activations:
            raise UserError(
                "attention jagged cannot be combined with checkpoint_activations (recomputing a block makes nested "
                "rows that checkpointing cannot compare with the first pass's): use --attention masked"
            )
    use_attention(model, cfg.attention)
    if cfg.compile:
        compile_blocks(model.encoder.blocks, model.predictor.blocks, target.blocks, backend=compile_backend)
    if cfg.checkpoint_activations:
        checkpoint_blocks(model.encoder.blocks, model.predictor.blocks)
    if not dist.is_initialized():
        return model
    if cfg.fsdp:
        shard(model, target, cfg, device)
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in, no copy out
        # Every parameter gets a gradient every step (a caption-less image is masked, not skipped); DDP's reducer
        # cannot skip the all-reduce of accumulated micro-batches (`no_sync`) with a static graph, though.
        static_graph=cfg.accum_steps == 1,
        bucket_cap_mb=cfg.ddp_bucket_mb,
        **_no_buffer_sync(),
    )


def use_attention(model: JEPA, attention: str) -> None:
    """Set how the context encoder's and the predictor's self-attention take packed tokens (`attention`: masked or
    jagged); before compiling, whose graphs read it. The target encoder sees whole images, never padding."""
    for module in (*model.encoder.modules(), *model.predictor.modules()):
        if isinstance(module, SelfAttention):
            module.jagged = attention == "jagged"


def _no_buffer_sync() -> dict[str, Any]:
    """No buffer broadcast before each forward (the only buffers are fixed position embeddings and normalisation
    constants): `forward_sync_buffers=False` where torch has it (2.13), `broadcast_buffers=False` before."""
    if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def shard(model: JEPA, target: VisionTransformer, cfg: TrainConfig, device: torch.device) -> None:
    """FSDP2 over every process (a 1-D mesh), or with `shard_within_node` HSDP: sharded across a node's processes and
    replicated across nodes (a 2-D mesh, nodes × processes per node). bf16 parameters in forward and backward when
    `bf16`, gradients reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if cfg.shard_within_node:
        per_node = processes_per_node(world)
        if world % per_node:
            raise UserError(f"shard_within_node: {world} processes are not whole nodes of {per_node}")
        mesh = init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    # Inputs are not cast: cast, every block would take and return the residual stream in bf16, where DDP (autocast
    # over float32 weights) keeps it in float32. Autocast does the casting for the matmuls in both.
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.bf16 else None, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for root, blocks in ((model, [*model.encoder.blocks, *model.predictor.blocks]), (target, list(target.blocks))):
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(root, mesh=mesh, mp_policy=policy)


def _mark_lengths_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` (a block's forward) called with its batch and sequence dims marked dynamic.

    Blocks are called as `block(x, layout, *rest)`: `x` `[B, L, d]`, or packed `[T, d]`; a `TokenLayout` (key mask
    `[B, L]`, slots `[T]`); in the predictor a layer's `LayerCaptions` (keys `[B, N, S, d]`: the batch and caption
    length S, the batch's longest rounded up to a multiple of 8, are dynamic; N is fixed) and the `TokenCaptions`
    (`[P, N]`). Marked dims get symbols of their own, so two that happen to be equal when a graph is traced (B·M = L
    on some step) are not taken to be equal later (`train.dynamic_shapes`).
    """

    def forward(x: torch.Tensor, layout: TokenLayout | None = None, *rest: Any) -> Any:
        mark_dynamic(x, *range(x.dim() - 1))
        if layout is not None:
            mark_dynamic(layout.key_mask, 0, 1)
            mark_dynamic(layout.slots, 0)
        for arg in rest:
            if isinstance(arg, LayerCaptions):
                mark_dynamic(arg.keys, 0, 2)
                mark_dynamic(arg.values, 0, 2)
                mark_dynamic(arg.attend, 0, 2)
            elif isinstance(arg, TokenCaptions):
                mark_dynamic(arg.rows, 0)
                mark_dynamic(arg.valid, 0)
                mark_dynamic(arg.keep, 0)
        return without_duck_sizing(compiled, x, layout, *rest)

    return forward


def compile_blocks(*stacks: nn.ModuleList, backend: str = "inductor") -> None:
    """torch.compile each block's forward (a whole graph, no break allowed), one graph shared by all blocks alike.
    `backend`: torch.compile's; the GPU check's CPU dry run takes `aot_eager` (Dynamo and AOTAutograd without
    inductor's code generation, which on a CPU writes C++ that no GPU runs).

    Shapes: the batch and sequence lengths (caption lengths too) are marked dynamic rather than padded to a few bucket
    sizes. Context, target and caption lengths change every step (block sizes are drawn per step; contexts and
    captions are padded only to the batch's longest, rounded up to a multiple of 8) and the validation batch has its
    own size: buckets would compile one graph per (context bucket, caption bucket, target size, batch size) and pad
    every step to its bucket, while marked dims compile one graph per block type and grad mode for the whole run.
    The price is CUDA graphs, which need static shapes; at ViT-B/16 and batches of 64+ per GPU the kernels are long
    enough that launch overhead is small.

    Only `forward` is compiled: module hooks (DDP, FSDP's all-gathers, activation checkpointing) stay outside the
    graph, and the state-dict keys do not change.
    """
    for blocks in stacks:
        for block in blocks:
            block.forward = _mark_lengths_dynamic(torch.compile(block.forward, fullgraph=True, backend=backend))


def regulariser_passes(cfg: TrainConfig, backend: str = "inductor") -> RegulariserPasses:
    """The text regularisers' passes over the cosine maps: compiled (by `backend`) where the blocks are, else eager.
    They run outside the blocks, on every layer's queries and keys at once, so they are compiled on their own."""
    return compiled_regulariser_passes(backend) if cfg.compile else EAGER_PASSES


def checkpoint_blocks(*stacks: nn.ModuleList) -> None:
    """Recompute each block's activations in the backward (torch.utils.checkpoint, non-reentrant) instead of keeping
    them. The blocks are wrapped in place; state-dict keys stay those of the unwrapped model (the wrapper strips its
    prefix on save and restores it on load)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for blocks in stacks:
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
