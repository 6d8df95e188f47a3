"""`tcjepa viz`: where a trained predictor grounds caption words, and where the text helps.

Two pictures in one PNG, for one image and its captions:
- for the top words (by peak similarity), a heat map over the image of the
  patch–word cosine the regularisers shape, averaged over the predictor's layers,
  seen from the predictor's query token at each position (context = whole image);
- the per-patch prediction error with the captions as given, with each caption's
  words shuffled (the same bag of words, the binding destroyed), and with no text,
  averaged over many masks drawn as in training.

The captions are encoded with the T5 whose recipe made the run's store; the model
directory is checked against that recipe, so the vectors match what training saw.
This command loads a text model; `tcjepa train` never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from evaluation.features import load_run
from evaluation.preprocess import resize_whole
from pipeline.core.errors import UserError
from pipeline.core.images import decode
from train.config import ModelConfig, TrainConfig
from train.data import image_policy, mask_config, normalise
from train.jepa import JEPA, build_models
from train.losses import target_features
from train.masks import sample_masks
from train.packing import TokenLayout
from train.predictor import TextBatch
from train.vit import VisionTransformer

MASK_DRAWS = 64
TOP_WORDS = 8


@dataclass
class EncodedCaptions:
    tokens: torch.Tensor  # float32 [1, N, S, d]
    lengths: torch.Tensor  # int64 [1, N]
    words: list[list[str]]  # per caption, its words
    word_of_token: list[np.ndarray]  # per caption, int [S_i]: index of each token's word (-1: EOS)


def encode_captions(groups: list[list[str]], text_model: Path, store: Path) -> list[EncodedCaptions]:
    """T5 token embeddings of each group of captions, made exactly as `tcjepa embed` made the store's (one model
    load)."""
    from embedding_cache.encode import T5Encoder, load_tokenizer, recipe_like, tokenize
    from embedding_cache.store import EmbeddingStore
    from embedding_cache.transform import requested
    from pipeline.core.recipes import recipe_hash

    stored = EmbeddingStore(store)
    recipe = stored.encoder
    if recipe_hash(recipe_like(str(text_model), recipe)) != recipe_hash(requested(recipe)):
        raise UserError(
            f"--text-model {text_model} is not the encoder that made {store} (recipe {recipe.get('model')!r}); "
            "pass the same T5 directory given to `tcjepa embed`"
        )
    tokenizer = load_tokenizer(str(text_model))
    encoder = T5Encoder.load(str(text_model), "cpu", recipe["compute_dtype"])
    out = []
    for captions in groups:
        words = [text.split() for text in captions]
        texts = [" ".join(w) for w in words]  # single spaces, so word i starts at starts[i]
        ids, _ = tokenize(tokenizer, texts, recipe["max_length"], recipe["eos"])
        word_of_token = []
        for text, split, row in zip(texts, words, ids):
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            starts = np.cumsum([0] + [len(w) + 1 for w in split[:-1]])
            # Each token belongs to the word that holds its last character; the EOS (if any) to none.
            owner = [int(np.searchsorted(starts, max(e - 1, 0), side="right") - 1) for _, e in offsets]
            word_of_token.append(np.array((owner + [-1] * len(row))[: len(row)]))
        # What the trainer read: T5's vectors through the store's projection and codec (int8 rounding included).
        arrays = [stored.transform.roundtrip(a.astype(np.float32)) for a in encoder.encode(ids)]
        tokens = torch.zeros(1, len(arrays), max(len(a) for a in arrays), arrays[0].shape[1])
        for i, a in enumerate(arrays):
            tokens[0, i, : len(a)] = torch.from_numpy(a.astype(np.float32))
        out.append(EncodedCaptions(tokens, torch.tensor([[len(a) for a in arrays]]), words, word_of_token))
    return out


def _shuffle_words(captions: list[str], seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.permutation(c.split()).tolist()) for c in captions]


def load_image(path: Path, size: int) -> tuple[np.ndarray, torch.Tensor]:
    """(the resized RGB image `[S, S, 3]` uint8, the normalised tensor `[1, 3, S, S]`)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"--image {path}: cannot be read ({exc.strerror or exc})") from None
    im, why = decode(data, image_policy(size))
    if im is None:
        raise UserError(f"--image {path}: not a usable image ({why})")
    pixels = resize_whole(im, size)
    return pixels, normalise(torch.from_numpy(pixels.transpose(2, 0, 1).copy())[None])


def word_similarity(model: JEPA, image: torch.Tensor, text: TextBatch, grid: tuple[int, int]) -> torch.Tensor:
    """float `[N, S, L]`: layer-mean cosine between each caption token and the query token at each patch."""
    n = grid[0] * grid[1]
    everything = torch.arange(n)[None]
    out = model(image, everything, everything[:, None], text)
    cos = torch.stack(out.cosines).mean(0)[0, n:]  # [L, N, S]: the query tokens (context first, then targets)
    return cos.permute(1, 2, 0)


def patch_errors(
    model: JEPA,
    target: VisionTransformer,
    image: torch.Tensor,
    texts: dict[str, TextBatch | None],
    cfg: TrainConfig,
    grid: tuple[int, int],
    draws: int = MASK_DRAWS,
) -> dict[str, np.ndarray]:
    """Mean squared prediction error at each patch (over the masks that made it a target), per caption condition."""
    features = target(image)
    masks = sample_masks(mask_config(cfg), grid, cfg.seed, 0, draws)
    ctx = torch.from_numpy(masks.context)
    ctx_layout = TokenLayout.of(torch.from_numpy(masks.context_valid()))
    tgt = torch.from_numpy(masks.targets)
    images = image.expand(draws, -1, -1, -1)
    truth = target_features(features.expand(draws, -1, -1), tgt)
    out = {}
    for name, text in texts.items():
        batch = (
            None if text is None else TextBatch(text.tokens.expand(draws, -1, -1, -1), text.lengths.expand(draws, -1))
        )
        pred = model(images, ctx, tgt, batch, ctx_layout).prediction
        err = ((pred - truth) ** 2).mean(-1).flatten()
        total = torch.zeros(grid[0] * grid[1]).index_add_(0, tgt.flatten(), err)
        count = torch.zeros(grid[0] * grid[1]).index_add_(0, tgt.flatten(), torch.ones_like(err))
        out[name] = (total / count.clamp(min=1)).masked_fill(count == 0, float("nan")).view(grid).numpy()
    return out


def _word_maps(sim: torch.Tensor, enc: EncodedCaptions, top: int) -> list[tuple[str, np.ndarray]]:
    """(word, `[L]` map) of the `top` distinct words with the highest peak similarity (tokens of a word averaged)."""
    best: dict[str, np.ndarray] = {}
    for c, (words, owner) in enumerate(zip(enc.words, enc.word_of_token)):
        for w, word in enumerate(words):
            tokens = np.flatnonzero(owner == w)
            if len(tokens) == 0:
                continue
            m = sim[c, tokens].mean(0).numpy()
            key = word.strip(".,;:").lower()
            if key not in best or m.max() > best[key].max():
                best[key] = m
    return sorted(best.items(), key=lambda kv: -kv[1].max())[:top]


def render(run: Path, image_path: Path, captions: list[str], text_model: Path, out: Path, top: int = TOP_WORDS) -> dict:
    """Draw the PNG; returns the mean error per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not captions:
        raise UserError("--captions: give at least one caption")
    trained = load_run(run)
    state, cfg = trained.state, trained.config
    if cfg.conditioning != "cross":
        raise UserError(
            f"{run} was trained with --conditioning {cfg.conditioning}; viz needs a cross-mode run (it shows the "
            "cross-attention)"
        )
    if cfg.store is None:
        raise UserError(f"{run}'s config names no embedding store")
    enc, shuffled = encode_captions([captions, _shuffle_words(captions, cfg.seed)], text_model, Path(cfg.store))
    model, target = build_models(ModelConfig.of(cfg), enc.tokens.shape[-1])
    model.load_state_dict(state["model"])
    target.load_state_dict(state["target"])
    model.eval()
    target.eval()
    grid = model.encoder.grid
    pixels, image = load_image(image_path, cfg.image_size)
    with torch.no_grad():
        text = TextBatch(enc.tokens, enc.lengths)
        sim = word_similarity(model, image, text, grid)
        errors = patch_errors(
            model,
            target,
            image,
            {"captions": text, "words shuffled": TextBatch(shuffled.tokens, shuffled.lengths), "no text": None},
            cfg,
            grid,
        )
    maps = _word_maps(sim, enc, top)

    cols = max(len(maps), 4)
    fig, axes = plt.subplots(2, cols, figsize=(2.2 * cols, 4.8), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    size = cfg.image_size
    extent = (0, size, size, 0)
    for ax, (word, m) in zip(axes[0], maps):
        ax.imshow(pixels)
        ax.imshow(m.reshape(grid), cmap="magma", alpha=0.6, extent=extent, interpolation="nearest")
        ax.set_title(f"{word} ({m.max():+.2f})", fontsize=9)
    axes[1, 0].imshow(pixels)
    axes[1, 0].set_title("image", fontsize=9)
    finite = np.concatenate([e[np.isfinite(e)] for e in errors.values()])
    vmax = float(finite.max()) if finite.size else 1.0
    means = {name: float(np.nanmean(e)) for name, e in errors.items()}
    for ax, (name, e) in zip(axes[1, 1:], errors.items()):
        ax.imshow(pixels)
        ax.imshow(e, cmap="viridis", alpha=0.7, extent=extent, interpolation="nearest", vmin=0, vmax=vmax)
        ax.set_title(f"error, {name}: {means[name]:.3f}", fontsize=9)
    fig.suptitle(
        f"{Path(image_path).name}: patch–word cosine (top row), prediction error (bottom row); step {state['step']}",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {
        "out": str(out),
        "step": int(state["step"]),
        "mean_error": means,
        "top_words": [{"word": w, "peak_cosine": round(float(m.max()), 4)} for w, m in maps],
    }
