"""The predictor and text conditioner: each equation of SPEC §1 against a hand-written version, and the wiring test."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from train.losses import prediction_loss, target_features, text_regularisers
from train.predictor import Predictor, PredictorBlock, TextBatch, TextCrossAttention


def _text(b: int, n: int, s: int, d: int, seed: int = 0, lengths: torch.Tensor | None = None) -> TextBatch:
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, s + 1, (b, n), generator=g)
    tokens = torch.randn(b, n, s, d, generator=g)
    tokens = tokens * (torch.arange(s) < lengths[..., None])[..., None]
    return TextBatch(tokens, lengths)


def test_cross_attention_matches_per_caption_softmax_and_full_vector_cosine():
    torch.manual_seed(0)
    attn = TextCrossAttention(dim=16, text_dim=8, heads=4)
    x = torch.randn(3, 5, 16)
    text = _text(3, 2, 6, 8)
    out, cosine = attn(x, text)
    q = attn.q(x)
    for b in range(3):
        for n in range(2):
            k_len = int(text.lengths[b, n])
            words = text.tokens[b, n, :k_len]
            k, v = attn.k(words), attn.v(words)
            heads = []
            for h in range(4):
                sl = slice(4 * h, 4 * h + 4)
                weights = torch.softmax(q[b, :, sl] @ k[:, sl].T / 2.0, dim=-1)  # 1/sqrt(d_head=4)
                heads.append(weights @ v[:, sl])
            expected = attn.proj(torch.cat(heads, dim=-1))
            torch.testing.assert_close(out[b, n], expected, atol=1e-5, rtol=1e-5)
            expected_cos = F.cosine_similarity(q[b][:, None, :], k[None, :, :], dim=-1)
            torch.testing.assert_close(cosine[b, :, n, :k_len], expected_cos, atol=1e-5, rtol=1e-5)


def test_padding_words_do_not_change_the_output():
    torch.manual_seed(0)
    attn = TextCrossAttention(16, 8, 2)
    x = torch.randn(2, 4, 16)
    text = _text(2, 3, 5, 8)
    noisy = text.tokens + 100.0 * (~text.word_mask)[..., None]
    out_a, _ = attn(x, text)
    out_b, _ = attn(x, TextBatch(noisy, text.lengths))
    torch.testing.assert_close(out_a, out_b)


@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_block_max_pools_over_present_captions(pool):
    torch.manual_seed(0)
    block = PredictorBlock(16, 2, 2.0, text_dim=8, pool=pool)
    m, t = 2, 3
    x = torch.randn(2 * m, t, 16)
    lengths = torch.tensor([[3, 0, 2], [0, 0, 0]])  # image 0: captions 0 and 2; image 1: none
    text = _text(2, 3, 4, 8, lengths=lengths)
    got, _ = block(x, None, text, m)
    # By hand: self-attention, then per caption x + cross_n (+ MLP), max over present captions.
    h = x + block.attn(block.norm1(x))
    per_image = h.reshape(2, m * t, 16)
    out, _ = block.cross(block.norm_cross(per_image), text)
    mlp = lambda z: z + block.mlp(block.norm2(z))  # noqa: E731
    versions = [per_image[0] + out[0, 0], per_image[0] + out[0, 2]]
    if pool == "after_mlp":
        expected0 = torch.maximum(mlp(versions[0]), mlp(versions[1]))
    else:
        expected0 = mlp(torch.maximum(versions[0], versions[1]))
    expected1 = mlp(per_image[1])  # no caption: the unconditioned path
    torch.testing.assert_close(got.reshape(2, m * t, 16)[0], expected0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.reshape(2, m * t, 16)[1], expected1, atol=1e-5, rtol=1e-5)
    unconditioned, _ = block(x, None, None, m)
    torch.testing.assert_close(
        got.reshape(2, m * t, 16)[1], unconditioned.reshape(2, m * t, 16)[1], atol=1e-5, rtol=1e-5
    )


def test_regularisers_by_hand():
    # L=2 layers, B=1 image, I=2 tokens, N=2 captions (the second missing), S=3 words (2 valid in caption 0).
    c1 = torch.tensor([[[[0.5, -0.2, 0.9], [0.0, 0.0, 0.0]], [[0.1, 0.3, 0.7], [0.0, 0.0, 0.0]]]])
    c2 = torch.tensor([[[[0.1, 0.4, 0.9], [0.0, 0.0, 0.0]], [[-0.5, 0.3, 0.7], [0.0, 0.0, 0.0]]]])
    word_mask = torch.tensor([[[True, True, False], [False, False, False]]])
    valid = torch.tensor([[True, False]])
    regs = text_regularisers([c1, c2], word_mask, valid)
    # Token 0: O1 = [0.5, 0], O2 = [0.1, 0.4]; token 1: O1 = [0.1, 0.3], O2 = [0, 0.3] (third word is padding).
    sparse = ((0.5 + 0.5) / 2 + (0.4 + 0.3) / 2) / 2
    # Token 0: mean [0.3, 0.2]; |O1-mean| = 0.2+0.2, |O2-mean| = 0.2+0.2 → 0.4. Token 1: mean [0.05, 0.3] → 0.05, 0.05
    # → 0.05.
    consistency = (0.4 + 0.05) / 2
    assert math.isclose(float(regs.sparse), sparse, rel_tol=1e-6)
    assert math.isclose(float(regs.consistency), consistency, rel_tol=1e-6)
    # Positive share per layer over valid words: layer 1: 0.5, -0.2, 0.1, 0.3 → 3/4; layer 2: 0.1, 0.4, -0.5, 0.3 → 3/4.
    torch.testing.assert_close(regs.positive_fraction, torch.tensor([0.75, 0.75]))


def test_regulariser_gradients_reach_the_conditioner():
    torch.manual_seed(0)
    pred = Predictor(encoder_width=32, grid=(4, 4), width=32, depth=2, heads=2, conditioning="cross", text_dim=8)
    context_idx = torch.arange(6).repeat(2, 1)
    target_idx = torch.arange(8, 12).view(1, 1, 4).repeat(2, 2, 1)
    text = _text(2, 3, 5, 8)
    out = pred(torch.randn(2, 6, 32), context_idx, target_idx, text)
    regs = text_regularisers(out.cosines, text.word_mask, text.valid)
    for term in (regs.sparse, regs.consistency):
        pred.zero_grad()
        term.backward(retain_graph=True)
        for name in ("blocks.0.cross.q.weight", "blocks.0.cross.k.weight", "blocks.1.cross.k.weight"):
            grad = dict(pred.named_parameters())[name].grad
            assert grad is not None and grad.abs().sum() > 0, name


def test_target_features_and_prediction_loss():
    feats = torch.randn(2, 16, 8) * 3 + 1
    idx = torch.tensor([[[0, 1], [5, 6]], [[2, 3], [15, 14]]])
    got = target_features(feats, idx)
    normed = (feats - feats.mean(-1, keepdim=True)) / torch.sqrt(feats.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(got[1, 1, 0], normed[1, 15])
    pred = torch.zeros_like(got)
    assert math.isclose(float(prediction_loss(pred, got, "mse")), float((got**2).mean()), rel_tol=1e-6)
    per_patch = got.pow(2).sum(-1).sqrt()  # the paper's: mean over patches of the unsquared L2 norm
    assert math.isclose(float(prediction_loss(pred, got, "norm")), float(per_patch.mean()), rel_tol=1e-6)
    assert math.isclose(float(prediction_loss(pred, got)), float(per_patch.mean()), rel_tol=1e-6)
    d = got.abs()
    smooth = torch.where(d < 1, 0.5 * d**2, d - 0.5).mean()
    assert math.isclose(float(prediction_loss(pred, got, "smooth_l1")), float(smooth), rel_tol=1e-6)


# ---- the wiring test: targets that only the caption can predict ------------------------------------------------


def _wiring_batch(g: torch.Generator, words: torch.Tensor, colours: torch.Tensor, b: int = 32):
    """Context features are noise; every target patch's feature is the image's colour vector; captions name the
    colour."""
    n_colours, fillers = colours.shape[0], words.shape[0] - colours.shape[0]
    colour = torch.randint(0, n_colours, (b,), generator=g)
    ids = n_colours + torch.randint(0, fillers, (b, 2, 6), generator=g)
    slot = torch.randint(0, 6, (b, 2), generator=g)
    ids.scatter_(2, slot[..., None], colour[:, None, None].expand(b, 2, 1))
    text = TextBatch(words[ids], torch.full((b, 2), 6))
    context = torch.randn(b, 6, 32, generator=g)
    target = F.layer_norm(colours[colour], (32,))[:, None, None, :].expand(b, 2, 4, 32)
    return context, text, target


def _train_predictor(conditioning: str, steps: int = 250) -> tuple[float, float, float]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    words = torch.randn(28, 16, generator=g)  # 8 colour words + 20 fillers, fixed "T5 outputs"
    colours = torch.randn(8, 32, generator=g)
    pred = Predictor(
        encoder_width=32,
        grid=(4, 4),
        width=64,
        depth=2,
        heads=2,
        conditioning=conditioning,
        text_dim=16 if conditioning != "none" else None,
    )
    opt = torch.optim.AdamW(pred.parameters(), lr=2e-3)
    context_idx = torch.arange(6).repeat(32, 1)
    target_idx = torch.tensor([[8, 9, 12, 13], [10, 11, 14, 15]]).repeat(32, 1, 1)
    for _ in range(steps):
        context, text, target = _wiring_batch(g, words, colours)
        loss = prediction_loss(pred(context, context_idx, target_idx, text).prediction, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        context, text, target = _wiring_batch(torch.Generator().manual_seed(99), words, colours)
        true = prediction_loss(pred(context, context_idx, target_idx, text).prediction, target)
        swapped = TextBatch(text.tokens.roll(1, 0), text.lengths)
        shuffled = prediction_loss(pred(context, context_idx, target_idx, swapped).prediction, target)
        notext = prediction_loss(pred(context, context_idx, target_idx, None).prediction, target)
    return float(true), float(shuffled), float(notext)


@pytest.mark.parametrize("conditioning", ["cross", "sequence"])
def test_wiring_text_reaches_the_prediction(conditioning):
    true, shuffled, notext = _train_predictor(conditioning)
    assert true <= 0.3 * shuffled and true <= 0.3 * notext, (true, shuffled, notext)


def test_wiring_none_cannot_use_text():
    true, _, _ = _train_predictor("none")
    # The best a text-blind predictor can do is the mean colour vector: about 7/8 of the unit variance.
    assert true > 0.6, true


@pytest.mark.parametrize("broadcast", [False, True])
def test_residual_max_equals_autograd_masked_max(broadcast):
    """The fused caption pool gives amax's values and gradients, ties and dropped captions included."""
    from train.predictor import residual_max

    torch.manual_seed(0)
    x = torch.randn(3, 1 if broadcast else 4, 5, 6, dtype=torch.float64, requires_grad=True)
    update = torch.randn(3, 4, 5, 6, dtype=torch.float64)
    update[0, 1] = update[0, 2]  # a tie between two captions
    if not broadcast:
        x.data[0, 1] = x.data[0, 2]
    update.requires_grad_(True)
    keep = torch.tensor([[True, True, True, False], [False, True, False, False], [True, True, True, True]])
    reference = (x + update).masked_fill(~keep[:, :, None, None], float("-inf")).amax(dim=1)
    weights = torch.randn_like(reference)
    grads_ref = torch.autograd.grad((reference * weights).sum(), (x, update))
    fused = residual_max(x, update, keep)
    grads = torch.autograd.grad((fused * weights).sum(), (x, update))
    torch.testing.assert_close(fused, reference)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want)
