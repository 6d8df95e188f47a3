"""The predictor and text conditioner: each equation of SPEC §1 against a hand-written version, and the wiring test."""

from __future__ import annotations

import functools
import math
import re
import statistics

import pytest
import torch
import torch.nn.functional as F

from benchmarks.reference_predictor import ReferencePredictor, split_text_keys_values
from benchmarks.reference_predictor import text_regularisers as reference_regularisers
from train.losses import (
    COSINE_BINS,
    cosine_histogram,
    histogram_quantiles,
    patch_word_cosine,
    prediction_loss,
    target_features,
    text_regularisers,
)
from train.packing import TokenLayout
from train.predictor import Predictor, PredictorBlock, TextBatch, TextCrossAttention, TextKeysValues, TokenCaptions


def _text(b: int, n: int, s: int, d: int, seed: int = 0, lengths: torch.Tensor | None = None) -> TextBatch:
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, s + 1, (b, n), generator=g)
    tokens = torch.randn(b, n, s, d, generator=g)
    tokens = tokens * (torch.arange(s) < lengths[..., None])[..., None]
    return TextBatch(tokens, lengths)


def _cross(attn: TextCrossAttention, x: torch.Tensor, captions, valid: torch.Tensor):
    """`attn` on rows `x` `[B, Q, d]` of every image's tokens: each caption's update as `[B, N, Q, d]`, and the
    queries."""
    b, nq, d = x.shape
    out, q = attn(x.reshape(b * nq, d), captions, TokenCaptions.of(None, valid, nq))
    return out.view(b, nq, -1, d).transpose(1, 2), q


@pytest.mark.parametrize("form", ["paper", "mha"])
def test_cross_attention_matches_per_caption_softmax_and_full_vector_cosine(form):
    """Per (image, caption), by hand: q = W_Q x, K = W_K t, V = W_V t, per head softmax(q·K/√d_h)·V, heads side by
    side; `paper` has no biases and no output projection, `mha` biases and a biased projection."""
    torch.manual_seed(0)
    attn = TextCrossAttention(dim=16, heads=4, form=form)
    keys_values = TextKeysValues(text_dim=8, dim=16, depth=2, bias=form == "mha")
    x = torch.randn(3, 5, 16)
    text = _text(3, 2, 6, 8)
    captions = keys_values(text)[1]  # the second layer's: rows 32..63 of the fused projection
    out, q = _cross(attn, x, captions, text.valid)
    cosine = patch_word_cosine(q, captions.keys).view(3, 5, 2, 6)
    weight, bias = keys_values.kv.weight, keys_values.kv.bias
    if form == "paper":
        assert bias is None and attn.q.bias is None and attn.proj is None
        torch.testing.assert_close(q, x @ attn.q.weight.T)
    else:
        torch.testing.assert_close(q, x @ attn.q.weight.T + attn.q.bias)
    for b in range(3):
        for n in range(2):
            k_len = int(text.lengths[b, n])
            words = text.tokens[b, n, :k_len]
            k, v = words @ weight[32:48].T, words @ weight[48:64].T
            if bias is not None:
                k, v = k + bias[32:48], v + bias[48:64]
            heads = []
            for h in range(4):
                sl = slice(4 * h, 4 * h + 4)
                weights = torch.softmax(q[b, :, sl] @ k[:, sl].T / 2.0, dim=-1)  # 1/sqrt(d_head=4)
                heads.append(weights @ v[:, sl])
            expected = torch.cat(heads, dim=-1)
            if attn.proj is not None:
                expected = attn.proj(expected)
            torch.testing.assert_close(out[b, n], expected, atol=1e-5, rtol=1e-5)
            expected_cos = F.cosine_similarity(q[b][:, None, :], k[None, :, :], dim=-1)
            torch.testing.assert_close(cosine[b, :, n, :k_len], expected_cos, atol=1e-5, rtol=1e-5)


def test_the_paper_conditioner_has_no_content_free_path():
    """With the paper's form, a predictor whose conditioner reads words that are all zero predicts exactly as with
    no captions: nothing it adds can come from the mere presence of text. The multi-head form's biases add an offset
    (the signature of every `cross` run of the text experiment: |true − shuffled| ~0 while |true − no text| > 0)."""
    context_idx, target_idx = torch.arange(6).repeat(2, 1), torch.tensor([[[8, 9], [12, 13]]]).repeat(2, 1, 1)
    context = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    silent = TextBatch(torch.zeros(2, 1, 4, 8), torch.tensor([[4], [2]]))
    for form, content_free in (("paper", False), ("mha", True)):
        torch.manual_seed(0)
        pred = Predictor(16, (4, 4), width=16, depth=2, heads=2, conditioning="cross", text_dim=8, conditioner=form)
        with torch.no_grad():
            for name, p in pred.named_parameters():
                if name.endswith("bias") and ".cross." in name:
                    p.normal_()  # biases as training would leave them
            with_words = pred(context, context_idx, target_idx, silent).prediction
            without = pred(context, context_idx, target_idx, None).prediction
        assert (not torch.allclose(with_words, without, atol=1e-4)) == content_free, form


def test_padding_words_do_not_change_the_output():
    torch.manual_seed(0)
    attn = TextCrossAttention(16, 2)
    keys_values = TextKeysValues(8, 16, 1)
    x = torch.randn(2, 4, 16)
    text = _text(2, 3, 5, 8)
    noisy = text.tokens + 100.0 * (~text.word_mask)[..., None]
    out_a, _ = _cross(attn, x, keys_values(text)[0], text.valid)
    out_b, _ = _cross(attn, x, keys_values(TextBatch(noisy, text.lengths))[0], text.valid)
    torch.testing.assert_close(out_a, out_b)


def test_a_caption_without_words_gives_no_nan():
    """An image's missing caption attends to its padding (its output is discarded), never to nothing."""
    torch.manual_seed(0)
    pred = Predictor(encoder_width=16, grid=(4, 4), width=16, depth=2, heads=2, conditioning="cross", text_dim=8)
    text = _text(2, 2, 3, 8, lengths=torch.tensor([[0, 2], [0, 0]]))
    out = pred(
        torch.randn(2, 5, 16), torch.arange(5).repeat(2, 1), torch.arange(8, 12).view(1, 1, 4).repeat(2, 1, 1), text
    )
    regs = text_regularisers(out.queries, out.keys, text.word_mask, text.valid)
    (out.prediction.sum() + regs.sparse + regs.consistency).backward()
    assert torch.isfinite(out.prediction).all()
    assert all(torch.isfinite(p.grad).all() for p in pred.parameters() if p.grad is not None)


@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_block_max_pools_over_present_captions(pool):
    torch.manual_seed(0)
    block = PredictorBlock(16, 2, 2.0, cross=True, pool=pool)
    m, t = 2, 3
    x = torch.randn(2 * m, t, 16)
    lengths = torch.tensor([[3, 0, 2], [0, 0, 0]])  # image 0: captions 0 and 2; image 1: none
    text = _text(2, 3, 4, 8, lengths=lengths)
    captions = TextKeysValues(8, 16, 1)(text)[0]
    got, _ = block(x, None, captions, TokenCaptions.of(None, text.valid, m * t))
    # By hand: self-attention, then per caption x + cross_n (+ MLP), max over present captions.
    h = x + block.attn(block.norm1(x))
    per_image = h.reshape(2, m * t, 16)
    out, _ = _cross(block.cross, block.norm_cross(per_image), captions, text.valid)
    mlp = lambda z: z + block.mlp(block.norm2(z))  # noqa: E731
    versions = [per_image[0] + out[0, 0], per_image[0] + out[0, 2]]
    if pool == "after_mlp":
        expected0 = torch.maximum(mlp(versions[0]), mlp(versions[1]))
    else:
        expected0 = mlp(torch.maximum(versions[0], versions[1]))
    expected1 = mlp(per_image[1])  # no caption: the unconditioned path
    torch.testing.assert_close(got.reshape(2, m * t, 16)[0], expected0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.reshape(2, m * t, 16)[1], expected1, atol=1e-5, rtol=1e-5)
    unconditioned, _ = block(x, None, None, None)
    torch.testing.assert_close(
        got.reshape(2, m * t, 16)[1], unconditioned.reshape(2, m * t, 16)[1], atol=1e-5, rtol=1e-5
    )


def _query(cosines: tuple[float, float], scale: float) -> torch.Tensor:
    """A query whose cosines with the unit words e0, e1 are `cosines`, 0.2 with e2 and e3, of norm `scale`."""
    c0, c1 = cosines
    return scale * torch.tensor([c0, c1, 0.2, 0.2, math.sqrt(1 - c0**2 - c1**2 - 0.08)])


def test_regularisers_by_hand():
    # L=2 layers, B=1 image, I=2 tokens, N=2 captions (the second missing), S=3 words (2 valid in caption 0).
    # Caption 0's words are e0, e1 and (padding) e2; the missing caption's are e3: both have cosine 0.2 > 0 with
    # every query, and count for nothing. Queries and keys are not unit vectors: the cosine divides their norms out.
    keys = torch.zeros(1, 2, 3, 5)
    keys[0, 0, 0, 0], keys[0, 0, 1, 1], keys[0, 0, 2, 2], keys[0, 1, :, 3] = 0.5, 2.0, 1.0, 3.0
    q1 = torch.stack([_query((0.5, -0.2), 3.0), _query((0.1, 0.3), 0.1)])[None]
    q2 = torch.stack([_query((0.1, 0.4), 1.0), _query((-0.5, 0.3), 7.0)])[None]
    word_mask = torch.tensor([[[True, True, False], [False, False, False]]])
    valid = torch.tensor([[True, False]])
    regs = text_regularisers([q1, q2], [keys, 2 * keys], word_mask, valid)
    # Token 0: O1 = [0.5, 0], O2 = [0.1, 0.4]; token 1: O1 = [0.1, 0.3], O2 = [0, 0.3] (third word is padding).
    sparse = ((0.5 + 0.5) / 2 + (0.4 + 0.3) / 2) / 2
    # Token 0: mean [0.3, 0.2]; |O1-mean| = 0.2+0.2, |O2-mean| = 0.2+0.2 → 0.4. Token 1: mean [0.05, 0.3] → 0.05, 0.05
    # → 0.05.
    consistency = (0.4 + 0.05) / 2
    assert math.isclose(float(regs.sparse), sparse, rel_tol=1e-6)
    assert math.isclose(float(regs.consistency), consistency, rel_tol=1e-6)
    # Positive share per layer over valid words: layer 1: 0.5, -0.2, 0.1, 0.3 → 3/4; layer 2: 0.1, 0.4, -0.5, 0.3 → 3/4.
    torch.testing.assert_close(regs.positive_fraction, torch.tensor([0.75, 0.75]))


def test_the_cosine_histogram_counts_valid_pairs_and_gives_their_quantiles():
    """Queries built as in `test_regularisers_by_hand`, with cosines 0.505, -0.195, 0.105, 0.305 with the valid
    words (padding and the missing caption, at cosine 0.2, not counted), land in their bins of 0.01; quantiles are
    read off the histogram."""
    keys = torch.zeros(1, 2, 3, 5)
    keys[0, 0, 0, 0], keys[0, 0, 1, 1], keys[0, 0, 2, 2], keys[0, 1, :, 3] = 0.5, 2.0, 1.0, 3.0
    q1 = torch.stack([_query((0.505, -0.195), 3.0), _query((0.105, 0.305), 0.1)])[None]
    word_mask = torch.tensor([[[True, True, False], [False, False, False]]])
    histogram = cosine_histogram([q1], [keys], word_mask)
    assert histogram.shape == (1, COSINE_BINS) and float(histogram.sum()) == 4
    assert sorted(int(b) for b in torch.nonzero(histogram[0]).flatten()) == [80, 110, 130, 150]
    assert histogram_quantiles(histogram, (0.25, 0.5, 1.0)) == [[-0.19, 0.11, 0.51]]


def test_head_centred_regularisers_by_hand():
    """`head_centred`: per head, the cosine of the query with each valid word's key less the caption's mean key;
    rectified, summed over words, averaged over layers, tokens, present captions, heads and images with text."""
    g = torch.Generator().manual_seed(2)
    b, i, n, s, d, heads, depth = 2, 3, 2, 4, 8, 2, 2
    word_mask = torch.tensor([[[True, True, True, False], [False] * 4], [[True, True, False, False], [True] * 4]])
    valid = word_mask.any(-1)
    queries = [torch.randn(b, i, d, generator=g) for _ in range(depth)]
    keys = [torch.randn(b, n, s, d, generator=g) for _ in range(depth)]
    regs = text_regularisers(queries, keys, word_mask, valid, cosine="head_centred", heads=heads)
    per_image_sparse, per_image_consistency, positive, pairs = [], [], 0, 0
    for image in range(b):
        sparse_c, consistency_c = [], []
        for caption in range(n):
            if not valid[image, caption]:
                continue
            length = int(word_mask[image, caption].sum())
            for h in range(heads):
                ch = slice(h * d // heads, (h + 1) * d // heads)
                maps = []
                for q, k in zip(queries, keys):
                    words = k[image, caption, :length, ch]
                    centred = words - words.mean(0)
                    cos = F.cosine_similarity(q[image, :, None, ch], centred[None], dim=-1)  # [I, S]
                    positive += int((cos > 0).sum())
                    pairs += cos.numel()
                    maps.append(cos.clamp_min(0))
                stacked = torch.stack(maps)  # [L, I, S]
                sparse_c.append(stacked.sum(-1).mean(0).mean())
                consistency_c.append((stacked - stacked.mean(0)).abs().sum(-1).mean(0).mean())
        per_image_sparse.append(torch.stack(sparse_c).mean())
        per_image_consistency.append(torch.stack(consistency_c).mean())
    torch.testing.assert_close(regs.sparse, torch.stack(per_image_sparse).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(regs.consistency, torch.stack(per_image_consistency).mean(), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(regs.positive_fraction.mean()), positive / pairs, rel_tol=1e-6)


def test_a_shift_shared_by_a_captions_words_cannot_silence_the_head_centred_regularisers():
    """Adding one vector to every key of a caption leaves each softmax as it was. It can drive every full cosine
    negative (the regularisers then have no gradient: "dead"), not the head-centred ones."""
    g = torch.Generator().manual_seed(4)
    common = torch.randn(8, generator=g)
    queries = [common + 0.3 * torch.randn(1, 5, 8, generator=g)]  # queries that share a direction, as LN + W_Q give
    keys = [torch.randn(1, 1, 6, 8, generator=g)]
    word_mask, valid = torch.ones(1, 1, 6, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool)
    shift = -20.0 * common[None]  # against that direction
    shifted = [keys[0] + shift[:, None, None]]
    full = text_regularisers(queries, shifted, word_mask, valid)
    assert float(full.positive_fraction.max()) == 0.0 and float(full.sparse) == 0.0
    before = text_regularisers(queries, keys, word_mask, valid, cosine="head_centred", heads=2)
    after = text_regularisers(queries, shifted, word_mask, valid, cosine="head_centred", heads=2)
    torch.testing.assert_close(after.sparse, before.sparse)
    assert float(after.positive_fraction.min()) > 0.2 and float(after.sparse) > 0


def _regulariser_operands(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple]:
    """Three layers' queries and keys (leaves) of three images: padded tokens, padded words, a missing caption, an
    image without text, a zero query and a zero word."""
    g = torch.Generator().manual_seed(7)
    b, i, n, s, d, depth = 3, 5, 2, 4, 6, 3
    queries = [torch.randn(b, i, d, generator=g) for _ in range(depth)]
    keys = [torch.randn(b, n, s, d, generator=g) for _ in range(depth)]
    queries[1][0, 2] = 0
    keys[2][2, 0, 1] = 0
    lengths = torch.tensor([[4, 0], [0, 0], [2, 3]])
    word_mask = torch.arange(s) < lengths[..., None]
    token_valid = torch.arange(i) < torch.tensor([5, 3, 4])[:, None]
    leaves = [x.to(dtype).requires_grad_() for x in queries + keys]
    return leaves[:depth], leaves[depth:], (word_mask, lengths > 0, token_valid)


def _regulariser_results(regularisers, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sparse, consistency and positive share, and the float32 gradients of 3·sparse + 5·consistency."""
    queries, keys, masks = _regulariser_operands(dtype)
    regs = regularisers(queries, keys, *masks)
    (3 * regs.sparse + 5 * regs.consistency).backward()
    terms = [regs.sparse.detach(), regs.consistency.detach(), regs.positive_fraction]
    return terms, [x.grad.float() for x in queries + keys]


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one chunk", "an image a chunk"])
def test_regularisers_from_all_layers_at_once_equal_the_per_layer_recomputation(monkeypatch, chunk_bytes):
    """Today's Function (one batched GEMM for every layer's map, one pass each way, images in chunks when eager)
    against the one it replaced (`benchmarks/reference_regularisers.py`): terms, positive share and every gradient
    in float32; under bf16 both within rounding of the float32 result, the new never much further from it."""
    from benchmarks.reference_regularisers import regularisers as per_layer_regularisers
    from train import losses

    if chunk_bytes is not None:
        monkeypatch.setattr(losses, "MAP_CHUNK_BYTES", chunk_bytes)
    exact_terms, exact_grads = _regulariser_results(per_layer_regularisers, torch.float32)
    got_terms, got_grads = _regulariser_results(text_regularisers, torch.float32)
    for got, want in zip(got_terms, exact_terms):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    for got, want in zip(got_grads, exact_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(exact_grads[1][0, 2].abs().sum()) == 0, "a zero query gets no gradient"

    old_terms, old_grads = _regulariser_results(per_layer_regularisers, torch.bfloat16)
    new_terms, new_grads = _regulariser_results(text_regularisers, torch.bfloat16)
    for new, old, exact in zip(new_terms[:2], old_terms[:2], exact_terms[:2]):
        assert abs(float(new - exact)) <= 3e-3 * float(exact), (float(new), float(old), float(exact))
    torch.testing.assert_close(new_terms[2], old_terms[2], rtol=0, atol=0.03)
    for new, old, exact in zip(new_grads, old_grads, exact_grads):
        assert _relative_error(new, exact) < 1.25 * _relative_error(old, exact) + 1e-2


@pytest.mark.parametrize("images", [1, 2, 3, 5, 7, 8, 64, 129])
def test_the_regularisers_chunks_cover_every_image_under_the_budget_and_never_one_beside_more(monkeypatch, images):
    """The images whose maps are made together: consecutive, all of them, none over the budget (one image a chunk
    when one is over it), and never a chunk of one image beside larger ones, which a compiled pass would compile a
    second graph for."""
    from train import losses

    depth, tokens, captions, words, width = 2, 5, 3, 4, 8
    queries = [torch.empty(images, tokens, width, device="meta")] * depth
    keys = [torch.empty(images, captions, words, width, device="meta")] * depth
    per_image = depth * tokens * captions * words * 12  # every layer's float32 map and two temporaries of its size
    for budget in (0.5, 1, 1.5, 2, 2.5, 3, 7, 1000):  # in images
        monkeypatch.setattr(losses, "MAP_CHUNK_BYTES", int(budget * per_image))
        chunks = losses._chunks((*queries, *keys))
        sizes = [c.stop - c.start for c in chunks]
        assert [c.start for c in chunks] == [0, *[c.stop for c in chunks[:-1]]] and chunks[-1].stop == images
        assert max(sizes) <= max(1, budget), (budget, sizes)
        assert 1 not in sizes or set(sizes) == {1}, (budget, sizes)
        fewest = -(-images // max(1, int(budget)))  # the fewest chunks under the budget
        assert len(sizes) == (images if 2 * fewest > images else fewest), (budget, sizes)


@pytest.mark.parametrize("cosine", ["full", "head_centred"])
def test_regularisers_over_each_image_s_real_words_alone_equal_those_over_every_padded_word(cosine):
    """`image_words`: each image's real words gathered to the front and the maps only that wide (5 here, the most
    an image has, of N·S = 8): the same terms, positive share, pairs and gradients (zero on padded words)."""
    from train.losses import RegulariserWeights, real_words_first

    queries, keys, (word_mask, valid, token_valid) = _regulariser_operands(torch.float32)
    weights = RegulariserWeights.of(word_mask, valid, token_valid, queries[0].shape[1])
    order, packed = real_words_first(weights, 5)
    assert order.shape == (3, 5) and float(packed.word_mask.sum()) == float(weights.word_mask.sum())
    assert order[2].tolist() == [0, 1, 4, 5, 6], "image 2's words: 2 of caption 0, then 3 of caption 1"
    results = []
    for image_words in (None, 5):
        queries, keys, masks = _regulariser_operands(torch.float32)
        regs = text_regularisers(queries, keys, *masks, cosine=cosine, heads=2, image_words=image_words)
        (3 * regs.sparse + 5 * regs.consistency).backward()
        terms = [regs.sparse.detach(), regs.consistency.detach(), regs.positive_fraction, regs.pairs]
        results.append((terms, [x.grad for x in queries + keys]))
    (terms, grads), (packed_terms, packed_grads) = results
    for got, want in zip(packed_terms, terms):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(packed_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert float(grads[3][0, 1].abs().sum()) == 0, "the missing caption's words get no gradient"


def test_the_regularisers_of_a_batch_of_no_images_are_zero():
    queries, keys = [torch.zeros(0, 5, 6, requires_grad=True)], [torch.zeros(0, 2, 4, 6, requires_grad=True)]
    regs = text_regularisers(queries, keys, torch.zeros(0, 2, 4, dtype=torch.bool), torch.zeros(0, 2, dtype=torch.bool))
    (regs.sparse + regs.consistency).backward()
    assert float(regs.sparse) == float(regs.consistency) == 0 and queries[0].grad.shape == (0, 5, 6)


@pytest.mark.slow
def test_the_compiled_regulariser_passes_equal_the_eager_ones():
    """`--compile` runs the passes through inductor (C++ kernels on the CPU): the same terms and gradients, three times
    over operands of other lengths, one graph per pass (dynamic lengths: no recompile). The first has as many target
    tokens as the width: compiled with every dim dynamic, as the passes once were, duck sizing gave the two one symbol
    and the next lengths compiled each pass again (4 graphs). The backward runs on a thread of its own, as autograd's
    engine runs it on CUDA: the backward pass is compiled and called there."""
    import threading

    import torch._dynamo.utils

    from train.losses import compiled_regulariser_passes

    torch._dynamo.reset()  # graphs compiled earlier in this process would not be counted
    torch._dynamo.utils.counters.clear()
    compiled = compiled_regulariser_passes("inductor")
    for tokens in (6, 5, 8):  # the width is 6 and the words 2 x 4 (`_regulariser_operands`)
        results = []
        for passes in (None, compiled):
            regularisers = text_regularisers if passes is None else functools.partial(text_regularisers, passes=passes)
            queries, keys, masks = _regulariser_operands(torch.float32)
            queries = [torch.cat([q, q[:, : tokens - 5]], dim=1).detach().requires_grad_() for q in queries]
            masks = (*masks[:2], torch.cat([masks[2], masks[2][:, : tokens - 5]], dim=1))
            regs = regularisers(queries, keys, *masks)
            backward = threading.Thread(target=(3 * regs.sparse + 5 * regs.consistency).backward)
            backward.start()
            backward.join()
            results.append([regs.sparse, regs.consistency, regs.positive_fraction, *(x.grad for x in queries + keys)])
        for got, want in zip(*reversed(results)):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, dict(torch._dynamo.utils.counters["stats"])


def test_regulariser_gradients_reach_the_conditioner():
    torch.manual_seed(0)
    pred = Predictor(encoder_width=32, grid=(4, 4), width=32, depth=2, heads=2, conditioning="cross", text_dim=8)
    context_idx = torch.arange(6).repeat(2, 1)
    target_idx = torch.arange(8, 12).view(1, 1, 4).repeat(2, 2, 1)
    text = _text(2, 3, 5, 8)
    out = pred(torch.randn(2, 6, 32), context_idx, target_idx, text)
    regs = text_regularisers(out.queries, out.keys, text.word_mask, text.valid)
    for term in (regs.sparse, regs.consistency):
        pred.zero_grad()
        term.backward(retain_graph=True)
        for name in ("blocks.0.cross.q.weight", "blocks.1.cross.q.weight"):
            grad = dict(pred.named_parameters())[name].grad
            assert grad is not None and grad.abs().sum() > 0, name
        keys_values = pred.cross.kv.weight.grad.view(2, 2, 32, 8)  # [layer, k or v, d, d_text]
        assert (keys_values[:, 0].abs().sum(dim=(1, 2)) > 0).all(), "each layer's keys get a gradient"
        assert (keys_values[-1, 1] == 0).all(), "the last layer's values reach no cosine"


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


def _train_predictor(conditioning: str, steps: int = 150) -> tuple[float, float, float]:
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
        true = prediction_loss(pred(context, context_idx, target_idx, text).prediction, target, "mse")
        swapped = TextBatch(text.tokens.roll(1, 0), text.lengths)
        shuffled = prediction_loss(pred(context, context_idx, target_idx, swapped).prediction, target, "mse")
        notext = prediction_loss(pred(context, context_idx, target_idx, None).prediction, target, "mse")
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


# ---- initialisation and shapes that follow I-JEPA ---------------------------------------------------------------


def test_predictor_mlp_ratio_is_four_whatever_the_encoder():
    """vit_giant's encoder uses an MLP ratio of 48/11; I-JEPA's predictor always uses 4."""
    from train.config import ModelConfig, TrainConfig
    from train.jepa import build_models

    cfg = TrainConfig(
        model="vit_giant",
        width=88,
        depth=1,
        heads=4,
        patch_size=16,
        image_size=32,
        predictor_width=32,
        predictor_depth=1,
        conditioning="none",
    )
    model, _ = build_models(ModelConfig.of(cfg), text_dim=None)
    assert model.encoder.blocks[0].mlp.fc1.out_features == int(88 * 48 / 11)
    assert model.predictor.blocks[0].mlp.fc1.out_features == 4 * 32


@pytest.mark.parametrize("form", ["paper", "mha"])
def test_every_residual_output_is_depth_scaled_the_cross_attention_too(form):
    """The cross-attention writes to the residual stream through its output projection (mha) or, without one
    (paper), through W_V: those rows get 1/√(2l), the keys and queries not."""
    torch.manual_seed(0)
    predictor = Predictor(
        encoder_width=64, grid=(4, 4), width=192, depth=3, heads=4, conditioning="cross", text_dim=32, conditioner=form
    )
    kv = predictor.cross.kv.weight.detach().view(3, 2, 192, 32)  # [layer, (keys, values), width, text]
    for layer, block in enumerate(predictor.blocks, start=1):
        outputs = [block.attn.proj.weight, block.mlp.fc2.weight]
        outputs.append(block.cross.proj.weight if form == "mha" else kv[layer - 1, 1])
        for weight in outputs:
            assert float(weight.detach().std()) == pytest.approx(0.02 / math.sqrt(2 * layer), rel=0.05)
        for weight in (block.cross.q.weight, kv[layer - 1, 0]):  # inputs are not rescaled
            assert float(weight.detach().std()) == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("heads", [None, 4])
def test_predictor_heads_sets_the_predictor_s_self_and_cross_attention_heads_and_none_keeps_the_encoder_s(heads):
    from dataclasses import replace

    from tests.support.training_step import STEP_CONFIG, STEP_TEXT_DIM
    from train.config import ModelConfig
    from train.jepa import build_models

    cfg = replace(STEP_CONFIG, predictor_heads=heads, conditioning="cross")
    model, _ = build_models(ModelConfig.of(cfg), text_dim=STEP_TEXT_DIM)
    expected = heads or STEP_CONFIG.heads
    for block in model.predictor.blocks:
        assert block.attn.heads == block.cross.heads == expected


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"predictor_width": 100, "predictor_heads": 12},
            "predictor_width 100 must be divisible by predictor_heads (12)",
        ),
        ({"predictor_width": 90, "predictor_heads": 3}, "and by 4"),
        ({"model": "vit_tiny", "width": 200}, "width 200 must be divisible by heads (3)"),
    ],
)
def test_widths_that_heads_or_position_embeddings_cannot_split_are_refused_in_one_line(settings, message):
    from pipeline.core.errors import UserError
    from train.config import TrainConfig, apply, validate

    cfg = apply(TrainConfig(conditioning="none"), settings, "test")
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize("conditioning", ["cross", "sequence", "none"])
def test_a_padded_context_gives_the_same_prediction_and_regularisers_as_the_unpadded_one(conditioning):
    """Image 0 alone (its own context length) and beside an image with a longer context (so padded): same outputs."""
    from train.config import ModelConfig, TrainConfig
    from train.jepa import build_models
    from train.objective import compute_losses

    torch.manual_seed(0)
    cfg = TrainConfig(
        model="vit_tiny",
        depth=2,
        patch_size=8,
        image_size=32,
        predictor_width=48,
        predictor_depth=2,
        conditioning=conditioning,
        cache="c",
        store="s",
        bf16=False,
    )
    model, target = build_models(ModelConfig.of(cfg), text_dim=16)
    model.eval()
    g = torch.Generator().manual_seed(3)
    images = torch.randn(2, 3, 32, 32, generator=g)
    short, long = torch.tensor([0, 1, 2, 4, 5, 6]), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    context = torch.stack([torch.cat([short, short[:1].repeat(3)]), long])  # row 0 padded with its first patch
    valid = torch.arange(9) < torch.tensor([6, 9])[:, None]
    targets = torch.tensor([[[10, 11], [14, 15]], [[12, 13], [9, 10]]])
    tokens, lengths = torch.randn(2, 3, 5, 16, generator=g), torch.tensor([[5, 3, 0], [2, 5, 4]])
    text = TextBatch(tokens, lengths)
    with torch.no_grad():
        alone = compute_losses(model, target, images[:1], short[None], targets[:1], text_row(text, 0), cfg)
        pred_alone = model(images[:1], short[None], targets[:1], text_row(text, 0)).prediction[0]
        unmasked = model(images, context, targets, text).prediction[0]
        one = compute_losses(model, target, images[1:], long[None], targets[1:], text_row(text, 1), cfg)
    assert not torch.allclose(unmasked, pred_alone, atol=1e-3), "without the mask the padding would be attended to"
    # The padding masked on padded rows, or left out (packed contexts, and the K/V projection on real words only).
    for layout, words in ((TokenLayout(valid), None), (TokenLayout.of(valid, 15), None), (TokenLayout.of(valid), 19)):
        padded = TextBatch(tokens, lengths, words)
        with torch.no_grad():
            both = compute_losses(model, target, images, context, targets, padded, cfg, layout)
            pred_both = model(images, context, targets, padded, layout).prediction[0]
        torch.testing.assert_close(pred_both, pred_alone, rtol=1e-4, atol=1e-5)
        if conditioning == "cross":  # the regularisers average over image 0's real tokens only
            torch.testing.assert_close(both.sparse, (alone.sparse + one.sparse) / 2, rtol=1e-4, atol=1e-6)
            consistency = (alone.consistency + one.consistency) / 2
            torch.testing.assert_close(both.consistency, consistency, rtol=1e-4, atol=1e-6)


def text_row(text: TextBatch, i: int) -> TextBatch:
    return TextBatch(text.tokens[i : i + 1], text.lengths[i : i + 1])


# ---- the lean cross-attention against the one it replaced (benchmarks/reference_predictor.py) ------------------


def _paired_predictors(pool: str) -> tuple[ReferencePredictor, Predictor]:
    """Today's predictor and the one it replaced, with the same weights (the old layout loaded into the new)."""
    torch.manual_seed(0)
    shape = dict(encoder_width=32, grid=(4, 4), width=48, depth=3, heads=3, text_dim=16, pool=pool)
    reference = ReferencePredictor(**shape)
    lean = Predictor(conditioning="cross", conditioner="mha", **shape)
    lean.load_state_dict(reference.state_dict())
    return reference, lean


def _paired_batch(lengths: torch.Tensor):
    """Three images, two target blocks; padded words, missing captions, contexts of 4, 6 and 5 padded to 6."""
    g = torch.Generator().manual_seed(5)
    b, n = lengths.shape
    tokens = torch.randn(b, n, 5, 16, generator=g) * (torch.arange(5) < lengths[..., None])[..., None]
    context = torch.randn(b, 6, 32, generator=g)
    context_idx = torch.stack([torch.randperm(16, generator=g)[:6] for _ in range(b)])
    target_idx = torch.stack([torch.randperm(16, generator=g)[:4].view(2, 2) for _ in range(b)])
    context_layout = TokenLayout.of(torch.arange(6) < torch.tensor([4, 6, 5])[:, None])
    weights = torch.randn(b, 2, 2, 32, generator=g)
    return TextBatch(tokens, lengths, int(lengths.sum())), context, context_idx, target_idx, context_layout, weights


def _step(model: torch.nn.Module, batch, bf16: bool) -> tuple[torch.Tensor, tuple, dict[str, torch.Tensor]]:
    """Prediction, (sparse, consistency, positive fraction) and every parameter's gradient of a weighted loss."""
    text, context, context_idx, target_idx, context_layout, weights = batch
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(context, context_idx, target_idx, text, context_layout)
        if isinstance(model, ReferencePredictor):
            regs = reference_regularisers(out.cosines, text.word_mask, text.valid, out.token_valid)
        else:
            regs = text_regularisers(out.queries, out.keys, text.word_mask, text.valid, out.token_valid)
    loss = (out.prediction.float() * weights).sum() + 3 * regs.sparse + 5 * regs.consistency
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if not isinstance(model, ReferencePredictor):
        grads = split_text_keys_values(grads, len(model.blocks))  # the fused K/V gradient, per layer as before
    terms = (regs.sparse.detach(), regs.consistency.detach(), regs.positive_fraction)
    return out.prediction.detach().float(), terms, grads


MANY_CAPTIONS = torch.tensor([[5, 0, 2], [0, 0, 0], [1, 3, 4]])  # missing captions, an image with none, padded words
ONE_CAPTION = torch.tensor([[5, 0, 0], [0, 0, 0], [0, 3, 0]])  # at most one per image: no max over captions


@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_lean_cross_attention_equals_the_old_one_in_float32(pool):
    reference, lean = _paired_predictors(pool)
    batch = _paired_batch(MANY_CAPTIONS)
    want_pred, want_regs, want_grads = _step(reference, batch, bf16=False)
    got_pred, got_regs, got_grads = _step(lean, batch, bf16=False)
    torch.testing.assert_close(got_pred, want_pred, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_regs, want_regs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        torch.testing.assert_close(got_grads[name], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_lean_cross_attention_equals_the_old_one_under_bf16_autocast(pool):
    """Both within bf16 rounding of the float32 result: the new never much further from it than the old.

    A gradient that sums many terms of both signs (the input embedding's) can be several % off in either.

    Outputs and regularisers with several captions per image; gradients where each image has one. With several,
    bf16 rounding flips the max over captions wherever two are within a rounding of each other, in the old code
    as in the new, and each flip moves a whole gradient entry to another caption.
    """
    reference, lean = _paired_predictors(pool)
    batch = _paired_batch(MANY_CAPTIONS)
    exact_pred, exact_regs, _ = _step(reference, batch, bf16=False)
    old_pred, old_regs, _ = _step(reference, batch, bf16=True)
    new_pred, new_regs, _ = _step(lean, batch, bf16=True)
    torch.testing.assert_close(new_pred, exact_pred, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(new_pred, old_pred, rtol=2e-2, atol=2e-2)
    for new, old, exact in zip(new_regs[:2], old_regs[:2], exact_regs[:2]):
        assert abs(float(new - exact)) <= 5e-3 * float(exact), (float(new), float(old), float(exact))
    torch.testing.assert_close(new_regs[2], old_regs[2], rtol=0, atol=0.02)

    batch = _paired_batch(ONE_CAPTION)
    _, _, exact_grads = _step(reference, batch, bf16=False)
    _, _, old_grads = _step(reference, batch, bf16=True)
    _, _, new_grads = _step(lean, batch, bf16=True)
    errors = []
    for name, exact in exact_grads.items():
        new_error, old_error = _relative_error(new_grads[name], exact), _relative_error(old_grads[name], exact)
        assert new_error < 1.25 * old_error + 1e-2, (name, new_error, old_error)
        errors.append(new_error)
    assert statistics.median(errors) < 1e-2, sorted(errors)


def test_a_checkpoint_with_per_layer_keys_and_values_loads_into_the_fused_projection():
    """A state dict saved before the fusion (per-layer `cross.k` / `cross.v`) loads, rows k_0, v_0, k_1, v_1, …"""
    reference, lean = _paired_predictors("after_mlp")
    old, new = reference.state_dict(), lean.state_dict()
    assert "blocks.0.cross.k.weight" not in new
    rows = torch.cat([old[f"blocks.{layer}.cross.{name}.weight"] for layer in range(3) for name in ("k", "v")])
    torch.testing.assert_close(new["cross.kv.weight"], rows, rtol=0, atol=0)
    back = split_text_keys_values(new, 3)
    assert back.keys() == old.keys()
    for name, value in old.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["after_mlp", "before_mlp"])
def test_cross_attention_and_regularisers_compile_as_one_graph(pool):
    """No graph break in the forward (fullgraph) and the same gradients: the regularisers' backward traces too."""
    _, lean = _paired_predictors(pool)
    batch = _paired_batch(MANY_CAPTIONS)
    text, context, context_idx, target_idx, context_layout, weights = batch

    def loss(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        text = TextBatch(tokens, lengths)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lean(context, context_idx, target_idx, text, context_layout)
            regs = text_regularisers(out.queries, out.keys, text.word_mask, text.valid, out.token_valid)
        return (out.prediction.float() * weights).sum() + 3 * regs.sparse + 5 * regs.consistency

    eager = torch.autograd.grad(loss(text.tokens, text.lengths), list(lean.parameters()))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    traced = torch.autograd.grad(compiled(text.tokens, text.lengths), list(lean.parameters()))
    for got, want in zip(traced, eager):
        torch.testing.assert_close(got, want)


def test_sigreg_is_the_epps_pulley_distance_of_the_projections_from_a_standard_normal():
    """By a fine numerical integral for one direction; near 0 for standard normal embeddings, large for collapsed
    ones (every embedding the same vector) and for a wrong scale; directions drawn from (seed, step) alone."""
    from train.losses import sigreg, sigreg_directions

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, 1, generator=g, dtype=torch.float64)
    t = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    error = (torch.cos(z * t).mean(0) - torch.exp(-0.5 * t * t)) ** 2 + torch.sin(z * t).mean(0) ** 2
    by_hand = float(torch.trapezoid(error * torch.exp(-0.5 * t * t), t))
    assert float(sigreg(z, torch.ones(1, 1))) == pytest.approx(by_hand, rel=0.05, abs=1e-5)
    directions = sigreg_directions(16, 64, seed=3, step=5, device=torch.device("cpu"))
    assert directions.shape == (16, 64) and torch.allclose(directions.norm(dim=0), torch.ones(64))
    assert torch.equal(directions, sigreg_directions(16, 64, seed=3, step=5, device=torch.device("cpu")))
    assert not torch.equal(directions, sigreg_directions(16, 64, seed=3, step=6, device=torch.device("cpu")))
    normal = float(sigreg(torch.randn(4000, 16, generator=g), directions))
    collapsed = float(sigreg(torch.randn(1, 16, generator=g).expand(4000, 16), directions))
    squeezed = float(sigreg(0.2 * torch.randn(4000, 16, generator=g), directions))
    assert normal < 0.002 and collapsed > 50 * normal and squeezed > 20 * normal


def test_a_step_with_sigreg_reports_it_and_moves_the_context_encoder_towards_it():
    """`sigreg` > 0: the step's fifth part is SIGReg of the context tokens, and its gradient reaches the encoder (the
    encoder differs after one step from the same step without it); 0 leaves the objective as it was."""
    import dataclasses

    from tests.support.training_step import STEP_CONFIG, STEP_TEXT_DIM, step_batch, train_steps
    from train.config import ModelConfig
    from train.jepa import build_models

    with_sigreg = dataclasses.replace(STEP_CONFIG, sigreg=1.0, sigreg_directions=32)
    encoders, parts = [], []
    for cfg in (STEP_CONFIG, with_sigreg):
        torch.manual_seed(0)
        model, target = build_models(ModelConfig.of(cfg), STEP_TEXT_DIM)
        parts.append(torch.stack(train_steps(cfg, model, target, [step_batch(0, cfg)])))
        encoders.append(model.encoder.state_dict())
    assert float(parts[0][0, 4]) == 0.0 and float(parts[1][0, 4]) > 0
    total, predict, sparse, consistency, anti_collapse, _grad_norm = parts[1][0]
    lam, beta = with_sigreg.lambda_sparse, with_sigreg.beta_consistency
    torch.testing.assert_close(total, predict + lam * sparse + beta * consistency + 1.0 * anti_collapse)
    assert torch.equal(parts[0][0, 1], parts[1][0, 1]), "the same prediction loss before the update"
    assert any(not torch.equal(encoders[0][k], encoders[1][k]) for k in encoders[0])
