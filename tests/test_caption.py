"""`tcjepa caption` on the real vLLM engine (CPU build) with the tiny Qwen2-VL, and the hf backend."""

from collections import Counter
from dataclasses import replace

import pytest

from captioning.cache import CaptionCache
from captioning.engines import SamplingConfig
from captioning.job import run_caption
from captioning.prompts import samples_per_prompt
from captioning.work import CaptionConfig, in_shard
from pipeline.core.errors import UserError
from pipeline.core.recipes import sha256_file
from tests.support.captions import TINY_VLLM_ARGS
from tests.support.captions import caption_config as _cfg
from tests.support.captions import caption_rows as _rows
from tests.support.commands import refused, start_tcjepa, tcjepa
from tests.support.images import bad_image_catalogue
from tests.support.processes import kill_when


def _keyed(rows):
    return {(r["image_sha256"], r["prompt_id"], r["sample"]): r["text"] for r in rows}


@pytest.fixture(scope="module")
def images(synth_dir):
    return synth_dir / "images"


def test_samples_per_prompt():
    assert samples_per_prompt(8, 4) == [2, 2, 2, 2]
    assert samples_per_prompt(6, 4) == [2, 2, 1, 1]
    assert samples_per_prompt(3, 4) == [1, 1, 1, 0]
    assert samples_per_prompt(5, 1) == [5]


@pytest.mark.vllm
def test_captions_structure_determinism_and_reuse(tmp_path, images, tiny_models, vllm_engine):
    report = run_caption(_cfg([images], tmp_path / "a", tiny_models, recipe_name="tiny"), engine=vllm_engine)
    assert (report.images_seen, report.captioned, report.failed, report.captions) == (40, 40, 0, 320)
    rows = _rows(tmp_path / "a")
    per_image = Counter(r["image_sha256"] for r in rows)
    assert len(per_image) == 40 and set(per_image.values()) == {8}
    assert Counter((r["prompt_id"], r["sample"]) for r in rows) == {
        (p, s): 40 for p in ("dense", "spatial", "objects", "setting") for s in (0, 1)
    }
    assert all(r["finish_reason"] in ("stop", "length") and 0 < r["num_tokens"] <= 12 for r in rows)
    by_path = {r["source_id"]: r["image_sha256"] for r in rows}
    assert by_path["000007.png"] == sha256_file(images / "000007.png")
    (recipe,) = CaptionCache(tmp_path / "a").recipes().values()
    assert (
        recipe.name == "tiny"
        and recipe.recipe["engine"] == "vllm"
        and recipe.recipe["engine_args"] == {"max_model_len": 1024}
    )
    assert recipe.recipe["sampling"]["max_tokens"] == 12 and [p["samples"] for p in recipe.recipe["prompts"]] == [
        2,
        2,
        2,
        2,
    ]

    # the same recipe in another cache gives the same captions: seeded per (image, prompt), whatever the chunking
    reordered = _cfg([images], tmp_path / "b", tiny_models)
    reordered.chunk_images = 7
    run_caption(reordered, engine=vllm_engine)
    assert _keyed(_rows(tmp_path / "b")) == _keyed(rows)
    # another seed is another recipe with other captions
    other = run_caption(_cfg([images], tmp_path / "a", tiny_models, seed=1), engine=vllm_engine)
    assert other.recipe != report.recipe and other.captioned == 40
    assert _keyed(_rows(tmp_path / "a", other.recipe)) != _keyed(rows)

    # rerun: nothing to do, and the engine is never asked
    class NoEngine:
        name, version, engine_args = "vllm", vllm_engine.version, dict(TINY_VLLM_ARGS)
        chat_template = vllm_engine.chat_template

        def generate(self, *a):
            raise AssertionError("a finished cache must not reach the engine")

    again = run_caption(_cfg([images], tmp_path / "a", tiny_models), engine=NoEngine())
    assert (again.already_cached, again.captioned) == (40, 0)


@pytest.mark.vllm
def test_uneven_prompts_and_prompt_file(tmp_path, images, tiny_models, vllm_engine):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Describe the image.\nWhere are the shapes?\nWhat colours?\n")
    report = run_caption(
        _cfg(
            [images / "000001.png", images / "000002.png"],
            tmp_path / "c",
            tiny_models,
            prompts_file=prompts,
            captions_per_image=7,
        ),
        engine=vllm_engine,
    )
    rows = _rows(tmp_path / "c")
    assert report.captions == 14
    assert Counter(r["prompt_id"] for r in rows) == {"p0": 6, "p1": 4, "p2": 4}


@pytest.mark.vllm
def test_bad_images_are_recorded_not_fatal(tmp_path, tiny_models, vllm_engine):
    folder = tmp_path / "bad"
    folder.mkdir()
    catalogue = bad_image_catalogue()
    for name, (data, _) in catalogue.items():
        (folder / name).write_bytes(data)
    (folder / "broken_link.png").symlink_to(tmp_path / "nowhere.png")
    report = run_caption(_cfg([folder], tmp_path / "cache", tiny_models), engine=vllm_engine)
    good = [n for n, (_, reason) in catalogue.items() if reason is None]
    assert report.captioned == len(good) and report.failed == len(catalogue) - len(good) + 1
    failures = CaptionCache(tmp_path / "cache").read_failures().to_pylist()
    reasons = {f["source_id"]: f["reason"] for f in failures}
    for name, (_, reason) in catalogue.items():
        if reason is not None:
            assert reasons[name].startswith(reason), (name, reasons.get(name))
    assert reasons["broken_link.png"].startswith("unreadable file")
    assert {r["source_id"] for r in _rows(tmp_path / "cache")} == set(good)
    # everything failing is an error
    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    (only_bad / "zero.png").write_bytes(b"")
    with pytest.raises(UserError, match="every image failed"):
        run_caption(_cfg([only_bad], tmp_path / "cache2", tiny_models), engine=vllm_engine)


@pytest.mark.vllm
def test_shards_cover_every_image_exactly_once(tmp_path, images, tiny_models, vllm_engine):
    counts = []
    for i in range(3):
        report = run_caption(_cfg([images], tmp_path / "cache", tiny_models, shard=f"{i}/3"), engine=vllm_engine)
        counts.append(report.captioned)
        assert report.captioned + report.other_shards == 40
    assert sum(counts) == 40 and min(counts) > 0
    rows = _rows(tmp_path / "cache")
    assert len({r["image_sha256"] for r in rows}) == 40 and len(rows) == 320
    assert sorted(counts) == sorted(sum(in_shard(h, i, 3) for h in {r["image_sha256"] for r in rows}) for i in range(3))
    dry = run_caption(_cfg([images], tmp_path / "cache", tiny_models, dry_run=True))
    assert dry.captioned == 0 and dry.already_cached == 40


def test_hf_backend_same_semantics(tmp_path, images, tiny_models):
    cfg = CaptionConfig(
        inputs=[images / "000003.png", images / "000004.png"],
        cache=tmp_path / "hf",
        model=str(tiny_models / "vlm"),
        backend="hf",
        sampling=SamplingConfig(max_tokens=12),
        captions_per_image=4,
        device="cpu",
        decode_workers=0,
    )
    report = run_caption(cfg)
    rows = _rows(tmp_path / "hf")
    assert report.captions == 8 and Counter(r["prompt_id"] for r in rows) == {
        "dense": 2,
        "spatial": 2,
        "objects": 2,
        "setting": 2,
    }
    assert set(Counter(r["image_sha256"] for r in rows).values()) == {4}
    (recipe,) = CaptionCache(tmp_path / "hf").recipes().values()
    assert recipe.recipe["engine"] == "transformers"
    cfg.cache = tmp_path / "hf2"
    run_caption(cfg)
    assert _keyed(_rows(tmp_path / "hf2")) == _keyed(rows)


def test_cli_errors_are_one_line(tmp_path, images, tiny_models):
    for args, needle in [
        (["caption", images, "--cache", tmp_path / "c"], "needs IMAGES and --model"),
        (["caption", images, "--cache", tmp_path / "c", "--model", tiny_models / "vlm", "--shard", "3/2"], "--shard"),
        (
            ["caption", images, "--cache", tmp_path / "c", "--model", tiny_models / "vlm", "--vllm-arg", "nonsense"],
            "key=value",
        ),
        (["caption", tmp_path / "absent", "--cache", tmp_path / "c", "--model", tiny_models / "vlm"], "no such file"),
        (["caption", images, "--cache", tmp_path / "c", "--model", tiny_models / "t5", "--dry-run"], "chat template"),
        (["caption", images, "--cache", tmp_path / "c", "--annotations", tmp_path / "x.jsonl"], "not both"),
    ]:
        proc = refused(*args)
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.strip().count("\n") == 0, (
            args,
            proc.stderr[-500:],
        )


def _committed(cache) -> int:
    """Chunks committed to a local cache (a manifest is written last)."""
    return len(list((cache / "manifests").glob("*.json"))) if (cache / "manifests").is_dir() else 0


def test_kill_and_resume_ends_as_an_uninterrupted_run(tmp_path, images, tiny_models):
    """SIGKILL the command and all it started once it has committed a chunk and is captioning the next; the rerun
    captions only the rest, and the cache is an uninterrupted run's, each caption once. The hf backend (engines
    differ in how they generate, not in what is committed when; a vLLM CLI rerun skips the cached images in
    test_demo.py); several
    writers at once on one cache: test_cache.py's writer processes."""
    subset = tmp_path / "images"
    subset.mkdir()
    for image in sorted(images.glob("*.png"))[:8]:
        (subset / image.name).write_bytes(image.read_bytes())
    settings = {"backend": "hf", "device": "cpu", "decode_workers": 0, "chunk_images": 4}
    reference = run_caption(replace(_cfg([subset], tmp_path / "reference", tiny_models), engine_args={}, **settings))
    cache = tmp_path / "killed"
    args = ["caption", subset, "--cache", cache, "--model", tiny_models / "vlm", "--max-tokens", "12"]
    args += ["--backend", "hf", "--device", "cpu", "--decode-workers", "0", "--chunk-images", "4"]
    kill_when(start_tcjepa(*args, quiet=True), lambda: _committed(cache) >= 1)
    partial = len({r["image_sha256"] for r in _rows(cache)})
    assert 0 < partial < 8, "killed mid-run, after some chunks were committed"
    out = tcjepa(*args).stdout
    assert f"captioned {8 - partial} images ({8 * (8 - partial)} captions), {partial} already cached" in out, out
    rows = _rows(cache)
    keys = [(r["image_sha256"], r["prompt_id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == 64 and reference.captions == 64
    assert _keyed(rows) == _keyed(_rows(tmp_path / "reference")), "resumed captions differ"


@pytest.mark.vllm
def test_tar_and_parquet_sources_through_the_engine(tmp_path, images, tiny_models, vllm_engine):
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(images.glob("*.png"))[:4]
    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        for f in files[:2]:
            tar.add(f, arcname=f"{f.stem}.png")
    pq.write_table(
        pa.table({"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files[2:]]}), tmp_path / "part.parquet"
    )
    report = run_caption(
        _cfg([tmp_path / "shard-000.tar", tmp_path / "part.parquet"], tmp_path / "cache", tiny_models),
        engine=vllm_engine,
    )
    assert report.captioned == 4 and report.captions == 32
    sources = {r["source_id"]: r["image_sha256"] for r in _rows(tmp_path / "cache")}
    assert sources == {
        "shard-000.tar::000000.png": sha256_file(files[0]),
        "shard-000.tar::000001.png": sha256_file(files[1]),
        "part.parquet::0": sha256_file(files[2]),
        "part.parquet::1": sha256_file(files[3]),
    }
