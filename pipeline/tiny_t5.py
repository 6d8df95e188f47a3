"""A tiny T5 encoder built from nothing, for tests and the demo.

The real pipeline encodes captions with a pretrained T5; offline tests have no model hub, so
this module trains a Unigram tokenizer on the captions and a ~0.1 M-parameter T5 on them.
A *random* T5 is nearly a bag of words: the vector for "red" hardly depends on the position
phrase after it, so captions could not tell a model where things are. A short span-corruption
pretraining fixes that; :func:`binding_score` and :func:`cell_probe_accuracy` measure it.

Every output is a pure function of the arguments: two builds with the same arguments write
byte-identical files (on the same machine and torch build).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline import synth
from pipeline.errors import UserError

if TYPE_CHECKING:
    import torch
    import transformers

SPECIAL_PIECES = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5
N_SENTINELS = 32
MAX_TOKENS = 128  # captions are truncated to this many tokens for training and probing
SCORE_DECIMALS = 4
# A marker that no caption contains; see _train_unigram.
WORD_END = "\ue000"
MODEL_CONFIG: dict[str, Any] = dict(
    d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=16, relative_attention_max_distance=64,
    feed_forward_proj="gated-gelu", dropout_rate=0.0, tie_word_embeddings=True,
)
NOISE_DENSITY = 0.15
MEAN_SPAN = 3.0
FALLBACK_SCENES = 1000
FALLBACK_SEED = 0


def fallback_corpus(n_scenes: int = FALLBACK_SCENES, grid: int = 4) -> list[str]:
    """Captions of `n_scenes` synthetic scenes, without rendering images (fast, fixed seed)."""
    texts: list[str] = []
    for i in range(n_scenes):
        rng = np.random.default_rng([FALLBACK_SEED, i])
        texts += synth.captions_for(synth.draw_scene(rng, grid), grid, rng)
    return texts


# --- tokenizer ---------------------------------------------------------------------------


def _train_unigram(texts: Sequence[str], vocab_size: int) -> list[tuple[str, float]]:
    """Unigram pieces and log-probabilities learned on `texts`, in canonical form.

    The trainer seeds its candidates from substrings that occur in two *distinct* words with
    different continuations. In a small closed vocabulary every word is always followed by
    the word boundary, so whole words never become candidates and "red" ends up as r-e-d.
    One extra line with every word followed by WORD_END gives each word a second
    continuation; pieces with the marker are dropped afterwards.

    The trainer is not deterministic: characters it never learned get the lowest score plus
    a penalty growing in hash order, and parallel sums jitter in the last bits. Those
    characters all get the lowest score, scores are rounded, and pieces are sorted.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    # The pre-tokenizer T5Tokenizer uses, so pieces are learned on the words it will see.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    words = sorted({w for t in texts for w in t.split()})
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size + 1, special_tokens=list(SPECIAL_PIECES), unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_with_word_ends(texts, words), trainer)
    learned = [(p, s) for p, s in tok.get_vocab_scores() if p not in SPECIAL_PIECES and WORD_END not in p] \
        if hasattr(tok, "get_vocab_scores") else _vocab_scores(tok)
    floor = min(s for _, s in learned)
    # The unlearned characters sit within N_chars * 1e-4 of the floor; 0.01 covers 100 of them.
    pieces = [(p, round(floor if s < floor + 0.01 else s, SCORE_DECIMALS)) for p, s in learned]
    pieces.sort(key=lambda ps: (-ps[1], ps[0]))
    return [(p, 0.0) for p in SPECIAL_PIECES] + pieces
