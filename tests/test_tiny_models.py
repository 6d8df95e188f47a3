import hashlib
import json

import pytest

from tests.conftest import tcjepa


def _digests(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_random_models_load_offline_through_from_pretrained(tiny_models):
    from transformers import AutoProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration, T5EncoderModel

    tok = AutoTokenizer.from_pretrained(tiny_models / "t5")
    t5 = T5EncoderModel.from_pretrained(tiny_models / "t5")
    ids = tok("a red circle in row 1, column 2.", return_tensors="pt").input_ids
    assert ids[0, -1] == tok.eos_token_id and tok.unk_token_id not in ids[0].tolist()
    assert t5(input_ids=ids).last_hidden_state.shape == (1, ids.shape[1], t5.config.d_model)

    processor = AutoProcessor.from_pretrained(tiny_models / "vlm")
    vlm = Qwen2VLForConditionalGeneration.from_pretrained(tiny_models / "vlm")
    assert sum(p.numel() for p in vlm.parameters()) < 2_000_000
    assert vlm.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_same_arguments_give_identical_files(tmp_path, synth_dir):
    args = ["--t5-corpus", synth_dir / "captions.jsonl", "--t5-steps", 20]
    tcjepa("tiny-models", "--out", tmp_path / "a", *args)
    tcjepa("tiny-models", "--out", tmp_path / "b", *args)
    tcjepa("tiny-models", "--out", tmp_path / "c", *args, "--seed", 1)
    a, b, c = _digests(tmp_path / "a"), _digests(tmp_path / "b"), _digests(tmp_path / "c")
    assert a == b
    assert a["t5/model.safetensors"] != c["t5/model.safetensors"] and a["vlm/model.safetensors"] != c["vlm/model.safetensors"]


@pytest.mark.slow
def test_trained_t5_ties_colours_to_positions(tmp_path_factory, tiny_models):
    """A random T5 is a bag of words; span corruption on scene captions makes the position phrase carry its object.

    Measured both ways: the colour word's change with the position phrase (binding_score, which training
    does not raise) and linear probes; the probe reading an object's colour from its position phrase is what
    training improves, and what a predictor cross-attending to "row r, column c" needs.
    """
    from pipeline.tiny_t5 import binding_score, probe_accuracy

    data = tmp_path_factory.mktemp("corpus")
    tcjepa("synth", "--out", data, "--n", 2000)
    out = tmp_path_factory.mktemp("trained")
    stats = json.loads(tcjepa("tiny-models", "--out", out, "--t5-corpus", data / "captions.jsonl", "--t5-steps", 1500).stdout)
    random_probe = probe_accuracy(tiny_models / "t5")
    trained_probe = stats["t5_probe_accuracy"]
    assert stats["t5_training"]["final_loss"] < 1.0
    assert stats["t5_binding_score"] == pytest.approx(binding_score(out / "t5"), abs=1e-4)
    assert 0 < binding_score(tiny_models / "t5") < 0.2, "a random T5: a colour word hardly changes with its cell"
    assert trained_probe["colour_from_where"] > random_probe["colour_from_where"] + 0.1, (random_probe, trained_probe)
    assert trained_probe["colour_from_where"] > 2.5 * (1 / 8), "well above chance"


@pytest.mark.vllm
def test_vllm_serves_the_tiny_vlm(vllm_engine, tiny_models):
    from PIL import Image
    from transformers import AutoProcessor
    from vllm import SamplingParams

    processor = AutoProcessor.from_pretrained(tiny_models / "vlm")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]
    requests = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in images]
    params = SamplingParams(n=4, seed=7, max_tokens=8, temperature=1.0)
    first = vllm_engine.llm.generate(requests, params)
    second = vllm_engine.llm.generate(requests, params)
    assert [len(o.outputs) for o in first] == [4, 4]
    assert all(0 < len(c.token_ids) <= 8 and c.finish_reason in ("stop", "length") for o in first for c in o.outputs)
    assert [[c.text for c in o.outputs] for o in first] == [[c.text for c in o.outputs] for o in second]
