"""The named choices of a training run, in one torch-free place: the config validates against them, the models
are built from them, and the CLI lists them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViTSize:
    width: int
    depth: int
    heads: int
    mlp_ratio: float = 4.0  # the encoder's; the predictor's MLP ratio is always 4, as in I-JEPA
    predictor_depth: int = 6


# Widths, depths and heads of the I-JEPA reference; predictor depth by size (6 by default, 12 for L/H, 16 for g).
VIT_SIZES: dict[str, ViTSize] = {
    "vit_tiny": ViTSize(192, 12, 3),
    "vit_small": ViTSize(384, 12, 6),
    "vit_base": ViTSize(768, 12, 12),
    "vit_large": ViTSize(1024, 24, 16, predictor_depth=12),
    "vit_huge": ViTSize(1280, 32, 16, predictor_depth=12),
    "vit_giant": ViTSize(1408, 40, 16, mlp_ratio=48 / 11, predictor_depth=16),
}
MODELS = tuple(VIT_SIZES)
# none: I-JEPA; sequence: caption tokens appended to the predictor's input; cross: TC-JEPA's cross-attention.
CONDITIONING = ("none", "sequence", "cross")
# cross mode: max-pool over captions after each caption's MLP (the paper, literally), or before one shared MLP.
POOLING = ("after_mlp", "before_mlp")
# cross mode, the conditioner's form: paper: bias-free W_Q, W_K, W_V and no output projection (SPEC §1), so every
# update it adds depends on the words; mha: standard multi-head attention (biases and a biased output projection),
# which can lower the loss from the mere presence of captions (kept for the ablation and for runs made before).
CONDITIONERS = ("paper", "mha")
# The patch–word cosine of the regularisers: full: of the full projected query and key vectors (the formula);
# head_centred: per attention head, keys centred over each caption's words (what the softmax acts on).
REGULARISER_COSINES = ("full", "head_centred")
# norm: mean per-patch ‖ẑ − z‖₂ (the paper); mse: element-wise squared error; smooth_l1: I-JEPA's code.
LOSSES = ("norm", "mse", "smooth_l1")
# pad: every image keeps the context it sampled (rows padded, padding masked out of attention); cut: I-JEPA's cut of
# every context to the batch's smallest (drops 36–45% of the context at global batch 128–2048).
CONTEXT_EQUALISE = ("pad", "cut")
# Self-attention over packed contexts and (modes none and cross) predictor sequences: masked: rows padded to the
# longest, a key mask hiding the padding (SDPA's memory-efficient kernel on CUDA, as flash takes no mask); jagged:
# each row's real tokens alone as nested jagged tensors (flash's variable-length kernel on CUDA in bf16). The same
# values either way.
ATTENTION = ("masked", "jagged")
# cpu: DataLoader workers decode, crop and resize; gpu: nvJPEG decodes each batch's JPEGs on the CUDA device.
DECODERS = ("cpu", "gpu")
# --decode gpu, the crops' resize: per_image: torchvision's resize, a few kernels an image; batched: every crop of the
# batch at once, two batched matrix products with the same antialiased bilinear weights (a pixel may differ by 1).
DEVICE_RESIZE = ("per_image", "batched")
