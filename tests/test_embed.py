import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import zarr

from captioning.cache import CaptionCache, caption_row
from embedding_cache.encode import plan_batches, tokenize
from embedding_cache.reader import EmbeddingReader
from tests.conftest import REPO, tcjepa

SMALL = ["--chunk-tokens", "64", "--shard-chunks", "4", "--window", "64", "--no-progress"]


def _store_contents(path):
    reader = EmbeddingReader(path)
    out = {}
    for seg in reader.segment_ids:
        g = zarr.open_group(str(path / "segments" / seg), mode="r")
        keys, offsets = g["keys"][:], g["offsets"][:]
        assert offsets[0] == 0 and np.all(np.diff(offsets) > 0) and offsets[-1] == g["tokens"].shape[0]
        for k in keys:
            kb = k.tobytes()
            assert kb not in out, "a key is in exactly one segment"
            out[kb] = reader.get_key(kb)
    return out


def test_embed_encodes_every_caption_once(tmp_path, annotated_cache, tiny_models):
    store = tmp_path / "store"
    dry = tcjepa(
        "embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", "--dry-run", *SMALL
    ).stdout
    assert "would encode 320 captions" in dry and not store.exists()
    out = tcjepa("embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL).stdout
    assert "encoded 320 captions" in out
    contents = _store_contents(store)
    texts = {r["text_sha256"]: r["text"] for r in CaptionCache(annotated_cache).read_captions().to_pylist()}
    assert {k.hex() for k in contents} == set(texts)

    # the stored vectors are T5's own outputs for each caption, float16
    import torch
    from transformers import AutoTokenizer, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(tiny_models / "t5")
    model = T5EncoderModel.from_pretrained(tiny_models / "t5", dtype=torch.bfloat16).eval()
    for key_hex in list(texts)[:5]:
        ids = tok(texts[key_hex], return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model(input_ids=ids).last_hidden_state.float().half().numpy()[0]
        got = contents[bytes.fromhex(key_hex)]
        assert got.shape == ref.shape and ids[0, -1] == tok.eos_token_id
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), atol=0.05, rtol=0.05)

    again = tcjepa("embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL).stdout
    assert "320 already stored" in again and "encoded 0 captions" in again
    info = json.loads(tcjepa("store", "info", store, "--json").stdout)
    assert info["captions"] == 320 and info["encoder"]["eos"] is True and info["encoder"]["compute_dtype"] == "bfloat16"


def test_captions_of_an_image_are_adjacent(tmp_path, annotated_cache, tiny_models):
    store = tmp_path / "store"
    tcjepa("embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL)
    rows = CaptionCache(annotated_cache).read_captions().to_pylist()
    image_of = {bytes.fromhex(r["text_sha256"]): r["image_sha256"] for r in rows}
    reader = EmbeddingReader(store)
    g = zarr.open_group(str(store / "segments" / reader.segment_ids[0]), mode="r")
    images = [image_of[k.tobytes()] for k in g["keys"][:]]
    runs = 1 + sum(a != b for a, b in zip(images, images[1:]))
    assert runs == len(set(images)), "each image's captions form one contiguous run"


def test_embed_refuses_other_encoder_recipe_and_fp16(tmp_path, annotated_cache, tiny_models):
    store = tmp_path / "store"
    tcjepa("embed", "--cache", annotated_cache, "--store", store, "--model", tiny_models / "t5", *SMALL)
    for extra, needle in [
        (["--max-length", "32"], "another encoder recipe"),
        (["--dtype", "float32"], "another encoder recipe"),
        (["--no-eos"], "another encoder recipe"),
        (["--dtype", "float16"], "overflows in float16"),
        (["--max-length", "32", "--dry-run"], "another encoder recipe"),
    ]:
        proc = tcjepa(
            "embed",
            "--cache",
            annotated_cache,
            "--store",
            store,
            "--model",
            tiny_models / "t5",
            *SMALL,
            *extra,
            check=False,
        )
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_truncation_is_counted_and_eos_kept(tmp_path, annotated_cache, tiny_models):
    store = tmp_path / "store"
    out = tcjepa(
        "embed",
        "--cache",
        annotated_cache,
        "--store",
        store,
        "--model",
        tiny_models / "t5",
        "--max-length",
        "12",
        *SMALL,
    ).stdout
    assert "320 truncated" in out  # every synthetic caption is longer than 12 tokens
    reader = EmbeddingReader(store)
    assert set(reader.lengths(np.arange(len(reader)))) == {12}


def test_several_recipes_need_a_choice(tmp_path, synth_dir, tiny_models):
    cache = tmp_path / "cache"
    tcjepa("caption", "--cache", cache, "--annotations", synth_dir / "captions.jsonl", "--recipe", "synthetic")
    c = CaptionCache(cache)
    other = c.add_recipe({"kind": "test"}, "other")
    image = c.read_captions().column("image_sha256")[0].as_py()
    c.commit([caption_row(image, "x", other, "p", 0, "an entirely different caption", "stop")])
    proc = tcjepa(
        "embed", "--cache", cache, "--store", tmp_path / "s", "--model", tiny_models / "t5", *SMALL, check=False
    )
    assert (
        proc.returncode == 2
        and "several recipes" in proc.stderr
        and "synthetic" in proc.stderr
        and "other" in proc.stderr
    )
    out = tcjepa(
        "embed", "--cache", cache, "--store", tmp_path / "s", "--model", tiny_models / "t5", "--recipe", "other", *SMALL
    ).stdout
    assert "encoded 1 captions" in out
    out = tcjepa(
        "embed",
        "--cache",
        cache,
        "--store",
        tmp_path / "s",
        "--model",
        tiny_models / "t5",
        "--recipe",
        "other",
        "--recipe",
        "synthetic",
        *SMALL,
    ).stdout
    assert "1 already stored" in out and "encoded 320 captions" in out


def test_bad_model_is_one_line(tmp_path, annotated_cache, synth_dir):
    proc = tcjepa(
        "embed", "--cache", annotated_cache, "--store", tmp_path / "s", "--model", synth_dir, *SMALL, check=False
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: --model") and proc.stderr.count("\n") == 1


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


def test_kill_and_resume_ends_as_an_uninterrupted_run(tmp_path, annotated_cache, tiny_models):
    """SIGKILL the whole process group at random moments, rerun: same captions, no duplicates."""
    args = ["--cache", annotated_cache, "--model", tiny_models / "t5", *SMALL, "--segment-mb", "0.05", "--window", "16"]
    tcjepa("embed", "--store", tmp_path / "reference", *args)
    reference = _store_contents(tmp_path / "reference")
    store = tmp_path / "killed"
    rng = random.Random(7)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "embed", "--store", str(store), *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(rng.uniform(2.0, 7.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out = tcjepa("embed", "--store", store, *args).stdout
    assert "320 distinct texts" in out
    resumed = _store_contents(store)
    assert resumed.keys() == reference.keys()
    for k, v in reference.items():  # other batch compositions: equal up to bfloat16 rounding
        np.testing.assert_allclose(resumed[k].astype(np.float32), v.astype(np.float32), atol=0.02, rtol=0.02)


def test_non_finite_or_overflowing_vectors_stop_with_the_caption_named(tmp_path, annotated_cache, tiny_models):
    """T5 activations beyond float16's range must not be stored as inf."""
    import shutil

    import torch
    from transformers import T5EncoderModel

    broken = tmp_path / "t5-huge"
    shutil.copytree(tiny_models / "t5", broken)
    model = T5EncoderModel.from_pretrained(broken)
    with torch.no_grad():
        model.encoder.final_layer_norm.weight.mul_(1e6)
    model.save_pretrained(broken)
    proc = tcjepa(
        "embed", "--cache", annotated_cache, "--store", tmp_path / "s", "--model", broken, *SMALL, check=False
    )
    assert proc.returncode == 2 and "non-finite or float16-overflowing" in proc.stderr and "caption " in proc.stderr, (
        proc.stderr[-500:]
    )
    assert not EmbeddingReader(tmp_path / "s").segment_ids, "nothing is published"
