"""`tcjepa embed`: every caption encoded once with T5's own vectors, resumable after a kill, refusals in one line.

`annotated_store` is `tcjepa embed` run on the session's cache (conftest); most tests run the job in process
(`run_embed`), and the CLI where what is tested is the command itself.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import zarr

from captioning.cache import CaptionCache, caption_row
from embedding_cache.encode import plan_batches, tokenize
from embedding_cache.job import run_embed
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import STAGING, EmbeddingStore
from embedding_cache.work import EmbedConfig, EmbedReport
from pipeline.core.errors import UserError
from pipeline.core.recipes import sha256_file
from tests.support.commands import refused, start_tcjepa, tcjepa
from tests.support.processes import kill_when
from tests.support.stores import SMALL_STORE, assert_same_embeddings, store_keys


def _embed(cache, store, tiny_models, **changes) -> EmbedReport:
    """`run_embed` with `annotated_store`'s settings (SMALL_STORE)."""
    settings = dict(chunk_tokens=64, shard_chunks=4, window=64, progress=False, device="cpu")
    return run_embed(EmbedConfig(cache=cache, store=store, model=str(tiny_models / "t5"), **{**settings, **changes}))


def _tree(root) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_embed_encodes_every_caption_once_with_t5s_own_vectors(tmp_path, annotated_cache, annotated_store, tiny_models):
    assert (
        "320 captions, 320 distinct texts, 0 already stored; encoded 320 captions"
        in (annotated_store.parent / "embed.stdout").read_text()
    )
    dry = _embed(annotated_cache, tmp_path / "new", tiny_models, dry_run=True)
    assert "would encode 320 captions" in dry.summary(dry_run=True) and not (tmp_path / "new").exists()
    keys = store_keys(annotated_store)
    texts = {r["text_sha256"]: r["text"] for r in CaptionCache(annotated_cache).read_captions().to_pylist()}
    assert len(keys) == len(set(keys)) and {k.hex() for k in keys} == set(texts)

    # the stored vectors are T5's own outputs for each caption, float16
    import torch
    from transformers import AutoTokenizer, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(tiny_models / "t5")
    model = T5EncoderModel.from_pretrained(tiny_models / "t5", dtype=torch.bfloat16).eval()
    reader = EmbeddingReader(annotated_store)
    for key_hex in list(texts)[:5]:
        ids = tok(texts[key_hex], return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model(input_ids=ids).last_hidden_state.float().half().numpy()[0]
        got = reader.get_key(bytes.fromhex(key_hex))
        assert got.dtype == np.float16 and got.shape == ref.shape and ids[0, -1] == tok.eos_token_id
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=0.05, rtol=0.05)


def test_a_rerun_over_a_complete_store_encodes_nothing(tmp_path, annotated_cache, annotated_store, tiny_models):
    store = tmp_path / "store"
    shutil.copytree(annotated_store, store)
    before = _tree(store)
    again = tcjepa("embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL_STORE)
    assert "320 already stored" in again.stdout and "encoded 0 captions" in again.stdout
    assert _tree(store) == before
    info = json.loads(tcjepa("store", "info", store, "--json").stdout)
    assert info["captions"] == 320 and info["encoder"]["eos"] is True and info["encoder"]["compute_dtype"] == "bfloat16"


def test_captions_of_an_image_are_adjacent(annotated_cache, annotated_store):
    rows = CaptionCache(annotated_cache).read_captions().to_pylist()
    image_of = {bytes.fromhex(r["text_sha256"]): r["image_sha256"] for r in rows}
    (segment,) = EmbeddingReader(annotated_store).segment_ids
    g = zarr.open_group(str(annotated_store / "segments" / segment), mode="r")
    images = [image_of[k.tobytes()] for k in g["keys"][:]]
    runs = 1 + sum(a != b for a, b in zip(images, images[1:]))
    assert runs == len(set(images)), "each image's captions form one contiguous run"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"max_length": 32}, "another encoder recipe"),
        ({"compute_dtype": "float32"}, "another encoder recipe"),
        ({"eos": False}, "another encoder recipe"),
        ({"compute_dtype": "float16"}, "overflows in float16"),
        ({"max_length": 32, "dry_run": True}, "another encoder recipe"),
    ],
)
def test_embed_refuses_another_encoder_recipe_and_fp16(
    tmp_path, annotated_cache, annotated_store, tiny_models, changes, needle
):
    store = tmp_path / "store"
    shutil.copytree(annotated_store, store)
    before = _tree(store)
    with pytest.raises(UserError, match=needle) as caught:
        _embed(annotated_cache, store, tiny_models, **changes)
    assert "\n" not in str(caught.value)
    assert _tree(store) == before


def test_a_refusal_is_one_line_from_the_command(tmp_path, annotated_cache, annotated_store, tiny_models):
    store = tmp_path / "store"
    shutil.copytree(annotated_store, store)
    args = ["--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL_STORE]
    proc = tcjepa("embed", *args, "--max-length", "32", check=False)
    assert proc.returncode == 2 and "another encoder recipe" in proc.stderr and proc.stderr.count("\n") == 1, (
        proc.stderr
    )


def test_truncation_is_counted_and_eos_kept(tmp_path, annotated_cache, tiny_models):
    report = _embed(annotated_cache, tmp_path / "store", tiny_models, max_length=12)
    assert report.truncated == 320 and "320 truncated" in report.summary(dry_run=False)  # every caption is longer
    reader = EmbeddingReader(tmp_path / "store")
    assert set(reader.lengths(np.arange(len(reader)))) == {12}


def test_several_recipes_need_a_choice(tmp_path, annotated_cache, tiny_models):
    cache = tmp_path / "cache"
    shutil.copytree(annotated_cache, cache)
    c = CaptionCache(cache)
    other = c.add_recipe({"kind": "test"}, "other")
    image = c.read_captions().column("image_sha256")[0].as_py()
    c.commit([caption_row(image, "x", other, "p", 0, "an entirely different caption", "stop")])
    with pytest.raises(UserError, match="several recipes") as caught:
        _embed(cache, tmp_path / "s", tiny_models)
    assert "captions" in str(caught.value) and "other" in str(caught.value)
    assert _embed(cache, tmp_path / "s", tiny_models, recipes=["other"]).encoded == 1
    both = _embed(cache, tmp_path / "s", tiny_models, recipes=["other", "captions"])
    assert (both.already_stored, both.encoded) == (1, 320)


@pytest.mark.parametrize("bad", [{"token_budget": 0}, {"window": 0}, {"segment_mb": 0.0}])
def test_work_sizes_must_be_positive(tmp_path, annotated_cache, bad):
    with pytest.raises(UserError, match="--token-budget, --window and --segment-mb must be positive"):
        run_embed(EmbedConfig(cache=annotated_cache, store=tmp_path / "s", model="never-loaded", **bad))
    assert not (tmp_path / "s").exists()


def test_bad_model_or_executor_is_one_line(tmp_path, annotated_cache, synth_dir):
    args = ["embed", "--cache", annotated_cache, "--store", tmp_path / "s", "--model", synth_dir, *SMALL_STORE]
    proc = refused(*args)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --model") and proc.stderr.count("\n") == 1
    proc = refused(*args, "--executor", "dask")
    assert proc.returncode == 2 and proc.stderr == "error: --executor 'dask': choose local or ray\n"
    assert not (tmp_path / "s").exists()


def test_plan_batches_respects_budget_and_covers_everything():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, size=500)
    batches = plan_batches(lengths, 2048)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(500))
    for b in batches:
        assert len(b) * lengths[b].max() <= 2048
    padded = sum(len(b) * lengths[b].max() for b in batches)
    assert padded < 1.1 * lengths.sum(), "sorting by length leaves little padding"


def test_tokenize_truncates_keeping_eos(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "t5")
    ids, truncated = tokenize(tok, ["a red circle in row 1, column 2 and a blue square", "red"], 5, eos=True)
    assert truncated == 1 and len(ids[0]) == 5 and ids[0][-1] == tok.eos_token_id and ids[1][-1] == tok.eos_token_id
    ids, truncated = tokenize(tok, ["red"], 5, eos=False)
    assert tok.eos_token_id not in ids[0]


def _listed(store) -> list[str]:
    try:
        return json.loads((store / "zarr.json").read_text())["attributes"]["tcjepa"]["segments"]
    except (OSError, ValueError, KeyError):
        return []


def _staging(store) -> list[str]:
    return sorted(p.name for p in (store / STAGING).iterdir()) if (store / STAGING).is_dir() else []


@pytest.mark.slow
def test_kill_and_resume_ends_as_an_uninterrupted_run(tmp_path, annotated_cache, annotated_store, tiny_models):
    """SIGKILL the run and all it started at a published-progress event, rerun: the same captions, each once.

    The kill lands with two segments published and the next one half written (segments of ~4 captions: ~75 in
    all); the rerun drops the dead writer's staging and encodes only what is missing.
    """
    store = tmp_path / "killed"
    args = ["embed", "--store", store, "--cache", annotated_cache, "--model", tiny_models / "t5", *SMALL_STORE]
    args += ["--segment-mb", "0.05", "--window", "16"]
    kill_when(start_tcjepa(*args, quiet=True), lambda: len(_listed(store)) >= 2 and bool(_staging(store)))
    published, half_written = _listed(store), _staging(store)
    assert half_written, "killed with a segment half written"
    stored = EmbeddingStore(store).stats()["captions"]
    assert 0 < stored < 320, "killed mid-run"

    out = tcjepa(*args).stdout
    assert f"320 distinct texts, {stored} already stored; encoded {320 - stored} captions" in out, out
    assert _listed(store)[: len(published)] == published, "what was published stays"
    assert not (store / STAGING).exists(), "the dead writer's staging is gone"
    assert_same_embeddings(store, annotated_store)  # another batch composition: equal up to bfloat16 rounding


def test_non_finite_or_overflowing_vectors_stop_with_the_caption_named(tmp_path, annotated_cache, tiny_models):
    """T5 activations beyond float16's range must not be stored as inf."""
    import torch
    from transformers import T5EncoderModel

    broken = tmp_path / "t5-huge"
    shutil.copytree(tiny_models / "t5", broken)
    model = T5EncoderModel.from_pretrained(broken)
    with torch.no_grad():
        model.encoder.final_layer_norm.weight.mul_(1e6)
    model.save_pretrained(broken)
    with pytest.raises(UserError, match=r"caption \w+ .*non-finite or float16-overflowing"):
        run_embed(EmbedConfig(cache=annotated_cache, store=tmp_path / "s", model=str(broken), progress=False))
    assert not EmbeddingReader(tmp_path / "s").segment_ids, "nothing is published"
    assert not _staging(tmp_path / "s"), "nor left half written"
