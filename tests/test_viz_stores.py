"""`tcjepa viz` encodes fresh captions exactly as the run's store holds them, whatever the store's codec."""

from __future__ import annotations

import json

import numpy as np
import pytest

from captioning.cache import CaptionCache
from embedding_cache.reader import EmbeddingReader
from evaluation.viz import encode_captions
from pipeline.core.errors import UserError
from pipeline.core.recipes import text_key
from tests.support.commands import tcjepa
from tests.support.models import another_t5


@pytest.mark.parametrize("codec_args", [["--store-dtype", "int8"], ["--store-dtype", "int8", "--project-dim", "16"]])
def test_fresh_captions_match_an_int8_or_projected_store(tmp_path, annotated_cache, tiny_models, codec_args):
    store = tmp_path / "store"
    tcjepa(
        "embed",
        "--cache",
        annotated_cache,
        "--store",
        store,
        "--model",
        tiny_models / "t5",
        "--no-progress",
        *codec_args,
    )
    text = CaptionCache(annotated_cache).read_captions(columns=["text"]).column("text")[0].as_py()
    (encoded,) = encode_captions([[" ".join(text.split())]], tiny_models / "t5", store)
    stored = EmbeddingReader(store).get_key(text_key(" ".join(text.split())))
    length = int(encoded.lengths[0, 0])
    assert (
        length == len(stored)
        and encoded.tokens.shape[-1] == json.loads(tcjepa("store", "info", store, "--json").stdout)["d_model"]
    )
    # Fresh T5 output may sit a hair away from the embedded one, so an int8 value can round one step the other way.
    fresh, kept = encoded.tokens[0, 0, :length].numpy(), stored.astype(np.float32)
    cosine = (fresh * kept).sum(1) / np.linalg.norm(fresh, axis=1) / np.linalg.norm(kept, axis=1)
    assert cosine.min() > 0.999, cosine.min()
    other = another_t5(tiny_models, tmp_path / "other")
    with pytest.raises(UserError, match="is not the encoder that made"):
        encode_captions([["a caption"]], other, store)
