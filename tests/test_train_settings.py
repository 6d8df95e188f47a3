"""Training settings refused in process: `apply` (type checks), `validate` (combinations), `load_yaml`, and runs that
`run_training` will not continue. test_train.py keeps the CLI's error path (one `error:` line, exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.core.errors import UserError
from tests.support.logs import logging_as_rank
from tests.support.repo import REPO
from train.config import (
    TrainConfig,
    apply,
    differences,
    load_yaml,
    parse_set,
    resolve,
    saved_config,
    to_dict,
    validate,
)


def _set(*pairs: str) -> TrainConfig:
    return apply(TrainConfig(), parse_set(list(pairs)), "--set")


def _settings(**changes) -> TrainConfig:
    return apply(TrainConfig(cache="c", store="s"), changes, "command line")


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (["stepz=3"], "--set: unknown config key 'stepz' (did you mean 'steps'?)"),
        (["lr=fast"], "config key 'lr': expected a number"),
        (["steps=2.5"], "config key 'steps': expected an integer"),
        (["bf16=1"], "config key 'bf16': expected true or false"),
        (["ema=[0.99]"], "config key 'ema': expected 2 numbers like [a, b]"),
        (["recipes={a: 1}"], "config key 'recipes': expected a list"),
        (["model=[1]"], "config key 'model': expected a string"),
        (["lr"], "--set 'lr': expected key=value"),
        (["lr=[1"], "--set 'lr=[1': cannot read the value as YAML"),
    ],
)
def test_bad_values_are_refused_with_the_key_named(pairs, message):
    with pytest.raises(UserError) as caught:
        _set(*pairs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_values_are_converted_to_the_fields_types():
    cfg = _set("lr=1e-4", "ema=[0.99, 1]", "recipes=one", "mirror=null", "steps=7", "hflip=true")
    assert cfg.lr == 1e-4 and cfg.ema == (0.99, 1.0) and cfg.recipes == ["one"] and cfg.mirror is None
    assert cfg.steps == 7 and cfg.hflip is True
    assert TrainConfig().recipes is not TrainConfig().recipes, "list defaults are not shared"


def test_an_old_runs_value_is_read_as_what_it_meant(capsys):
    assert apply(TrainConfig(), {"loss": "l2"}, "run/config.yaml").loss == "mse"
    assert "run/config.yaml: loss: 'l2' is read as 'mse'" in capsys.readouterr().err
    assert differences({**to_dict(TrainConfig(loss="mse")), "loss": "l2"}, TrainConfig(loss="mse")) == []


def test_an_old_runs_missing_keys_are_read_as_that_run_had_them():
    """A run saved before the paper's conditioner was the default used the multi-head form: resumed or evaluated,
    it is rebuilt so (its checkpoint has that form's biases); a config written by hand still gets the default."""
    old = to_dict(TrainConfig(cache="c", store="s"))
    del old["conditioner"]
    assert apply(TrainConfig(), saved_config(old), "saved").conditioner == "mha"
    assert differences(old, apply(TrainConfig(), saved_config(old), "saved")) == []
    assert differences(old, TrainConfig(cache="c", store="s")) == ["conditioner"]
    assert apply(TrainConfig(), {"lr": 0.1}, "a YAML file").conditioner == "paper"
    new = to_dict(TrainConfig(cache="c", store="s"))
    assert apply(TrainConfig(), saved_config(new), "saved").conditioner == "paper"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"conditioning": "crosss"}, "conditioning must be one of none, sequence, cross"),
        ({"pool": "mean"}, "pool must be one of"),
        ({"model": "vit_enormous"}, "model must be one of"),
        ({"attention": "flash"}, "attention must be one of masked, jagged, got 'flash'"),
        ({"device_resize": "roi_align"}, "device_resize must be one of per_image, batched"),
        ({"patch_size": 7, "image_size": 64}, "patch_size 7 does not divide image_size 64"),
        ({"target_scale": [0.3, 0.2]}, "mask settings: target_scale must be ordered"),
        ({"steps": 0}, "steps must be at least 1, got 0"),
        ({"min_coverage": 1.5}, "min_coverage must be in [0, 1]"),
        ({"num_workers": -1}, "warmup_steps, num_workers, val_images and min_context must be >= 0"),
        ({"lambda_sparse": -0.1}, "lambda_sparse, beta_consistency and sigreg must be >= 0"),
        ({"sigreg": -1.0}, "lambda_sparse, beta_consistency and sigreg must be >= 0"),
        ({"crop_scale": [0.5, 1.5]}, "crop_scale must satisfy 0 < low <= high <= 1"),
        ({"cache": None}, "conditioning cross needs --cache and --store (or use --conditioning none)"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_anything_is_built(changes, message):
    with pytest.raises(UserError) as caught:
        validate(_settings(**changes))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_defaults_and_a_textless_run_without_a_cache_are_valid():
    validate(_settings())
    validate(TrainConfig(conditioning="none"))


def test_config_sources_stack_saved_run_or_file_then_flags_then_set(tmp_path):
    """`resolve`, the merge `tcjepa train` makes: the run's saved config (read as that run had it), or instead the
    --config file, under the flags (None: not given), under --set; each layer refused in one line naming it."""
    run = tmp_path / "run"
    assert resolve(run) == TrainConfig()
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"steps": 5, "lr": 0.5, "seed": 3}))
    saved = resolve(run)
    assert (saved.steps, saved.lr, saved.seed, saved.conditioner) == (5, 0.5, 3, "mha")
    flagged = resolve(run, flags={"steps": 7, "lr": None, "recipes": ["r"]})
    assert (flagged.steps, flagged.lr, flagged.seed, flagged.recipes) == (7, 0.5, 3, ["r"])
    both = resolve(run, flags={"steps": 7}, sets=["steps=9", "batch_size=8"])
    assert (both.steps, both.batch_size, both.lr) == (9, 8, 0.5)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump({"lr": 0.2, "batch_size": 16, "steps": 4}))
    filed = resolve(run, config_file, flags={"batch_size": 32}, sets=["steps=6"])
    assert (filed.lr, filed.batch_size, filed.steps, filed.seed, filed.conditioner) == (0.2, 32, 6, 0, "paper")
    for kwargs, message in (
        ({"flags": {"stepz": 1}}, "command line: unknown config key 'stepz' (did you mean 'steps'?)"),
        ({"sets": ["lr=fast"]}, "config key 'lr': expected a number"),
        ({"config_file": tmp_path / "absent.yaml"}, f"--config {tmp_path / 'absent.yaml'}: no such file"),
    ):
        with pytest.raises(UserError) as caught:
            resolve(run, **kwargs)
        assert message in str(caught.value)
    (run / "config.yaml").write_text(yaml.safe_dump({"stepz": 5}))
    with pytest.raises(UserError, match=f"^{run / 'config.yaml'}: unknown config key 'stepz'"):
        resolve(run)


def test_config_files_that_cannot_be_read_are_named(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(UserError, match=r"--config .*c\.yaml: not valid YAML"):
        load_yaml(bad)
    with pytest.raises(UserError, match="no such file"):
        load_yaml(tmp_path / "absent.yaml")
    bad.write_text("- steps\n")
    with pytest.raises(UserError, match="expected a mapping of config keys, got list"):
        load_yaml(bad)
    bad.write_text("")
    assert load_yaml(bad) == {}


@pytest.fixture
def saved_run(tmp_path, synth_dir, annotated_cache, vector_store):
    """A run directory as `tcjepa train` leaves it before training: its config and the store's encoder record."""
    cfg = TrainConfig(
        images=[str(synth_dir / "images")], cache=str(annotated_cache), store=str(vector_store), steps=2, device="cpu"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    from embedding_cache.store import EmbeddingStore

    store = EmbeddingStore(vector_store)
    record = {"encoder_hash": store.encoder_hash, "encoder": store.encoder, "d_model": store.width}
    (run / "text_encoder.json").write_text(json.dumps(record))
    return cfg, run


def _files(run):
    return {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".lock"}


def test_a_run_of_another_config_is_refused_and_left_as_it_was(saved_run):
    from train.loop import run_training

    cfg, run = saved_run
    before = _files(run)
    with pytest.raises(UserError, match=r"holds a run with another config \(lr: 0.001 → 0.5\)"):
        run_training(apply(cfg, {"lr": 0.5}, "command line"), run, progress=False)
    assert _files(run) == before


def test_a_run_continued_on_another_encoders_store_is_refused(saved_run):
    """The store path is in the config, but a store rebuilt in place with another encoder is caught by the record."""
    from train.loop import run_training

    cfg, run = saved_run
    record = json.loads((run / "text_encoder.json").read_text())
    (run / "text_encoder.json").write_text(json.dumps({**record, "encoder_hash": "0" * 64}))
    with pytest.raises(UserError, match="was trained on embeddings of encoder 000000000000"):
        run_training(cfg, run, progress=False)
    assert not (run / "index.parquet").exists()


def test_a_run_in_use_is_refused(saved_run):
    from filelock import FileLock

    from train.loop import run_training

    cfg, run = saved_run
    with FileLock(str(run / ".lock")), pytest.raises(UserError, match="is in use by another `tcjepa train`"):
        run_training(cfg, run, progress=False)


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, synth_dir):
    from train.loop import run_training

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    cfg = TrainConfig(images=[str(synth_dir / "images")], conditioning="none", steps=2, device="cpu")
    with pytest.raises(UserError, match="is a non-empty directory that is not a tcjepa run"):
        run_training(cfg, tmp_path / "mine", progress=False)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_loader_workers_share_the_nodes_cpus_among_its_ranks_and_keep_one_for_each_step():
    from train.config import MAX_LOADER_WORKERS, automatic_num_workers

    cases = {(2, 1): 1, (16, 1): MAX_LOADER_WORKERS, (16, 8): 1, (128, 8): MAX_LOADER_WORKERS, (8, 8): 0, (2, 2): 0}
    assert {case: automatic_num_workers(*case) for case in cases} == cases
    assert TrainConfig().num_workers is None, "automatic unless set"


def test_automatic_settings_fit_a_small_folder_and_say_so(capsys):
    from train.config import resolve_automatic

    small = resolve_automatic(TrainConfig(patch_size=16, image_size=64), 20)
    assert (small.val_images, small.min_context) == (2, 1)
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith("val_images: 2 of the 20 images held out for validation (automatic")
    assert said[1].startswith("min_context: 1 patch(es) on the 4×4 grid (automatic")
    assert said[2].startswith("ema: 0.99402 -> 1.0 over 1000 steps, 5.0% of the starting weights left")
    with logging_as_rank(1):  # the other processes of a torchrun group choose the same and say nothing
        large = resolve_automatic(TrainConfig(), 100_000)
        assert (large.val_images, large.min_context) == (32, 10), "the defaults of I-JEPA's 14×14 grid are kept"
        assert resolve_automatic(TrainConfig(patch_size=8, image_size=64), 5).val_images == 1
    assert capsys.readouterr().err == ""


def test_explicit_settings_are_honoured_or_refused_in_one_line(capsys):
    from train.config import resolve_automatic

    kept = resolve_automatic(
        TrainConfig(val_images=7, min_context=2, patch_size=16, image_size=64, ema=(0.999, 1.0)), 20
    )
    assert (kept.val_images, kept.min_context, kept.ema) == (7, 2, (0.999, 1.0)) and capsys.readouterr().err == ""
    for cfg, n, message in (
        (TrainConfig(val_images=20), 20, "val_images 20: only 20 images, so at most 19 can be held out"),
        (TrainConfig(), 1, "only 1 image(s) indexed: training needs at least 2"),
    ):
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
            resolve_automatic(cfg, n)
        assert "\n" not in str(caught.value)
    with pytest.raises(UserError) as caught:
        validate(TrainConfig(conditioning="none", patch_size=16, image_size=64, min_context=12))
    assert str(caught.value).startswith(
        "min_context 12 was given explicitly: mask settings leave no context on this 4×4"
    )
    validate(TrainConfig(conditioning="none", patch_size=16, image_size=64))


def test_ema_auto_leaves_at_most_five_percent_of_the_starting_weights():
    """Π_t m_t over the run, as the trainer schedules m: I-JEPA's 0.996 leaves 30% of θ₀ after 600 steps (the
    probed target encoder would be mostly its starting weights); auto lowers the start just enough for 5%, and keeps
    0.996 for runs long enough to wash θ₀ out with it (the paper's 187,500 steps)."""
    from train.config import automatic_ema_start, ema_left, ema_schedule, resolve_automatic

    product = 1.0
    for t in range(600):
        product *= 0.99 + 0.01 * t / 600
    assert ema_left(0.99, 1.0, 600) == pytest.approx(product, rel=1e-9)
    assert ema_left(0.996, 1.0, 600) == pytest.approx(0.300, abs=1e-3)
    assert ema_left(0.999, 1.0, 600) == pytest.approx(0.740, abs=1e-3)
    for steps in (50, 300, 600, 1000):
        start = automatic_ema_start(steps)
        assert start < 0.996 and ema_left(start, 1.0, steps) <= 0.05 < ema_left(start + 1e-4, 1.0, steps)
    assert automatic_ema_start(187_500) == automatic_ema_start(2_000) == 0.996
    assert ema_schedule(TrainConfig(steps=600)) == (automatic_ema_start(600), 1.0)
    assert ema_schedule(TrainConfig(steps=600, ema=(0.99, 1.0))) == (0.99, 1.0)
    assert apply(TrainConfig(), {"ema": "auto"}, "a YAML file").ema == "auto"
    assert apply(TrainConfig(), {"ema": [0.9, 1.0]}, "a YAML file").ema == (0.9, 1.0)
    with pytest.raises(UserError, match="config key 'ema': expected numbers like \\[a, b\\], or auto, got 'fast'"):
        apply(TrainConfig(), {"ema": "fast"}, "--set")
    assert resolve_automatic(TrainConfig(steps=600), 100).ema == (automatic_ema_start(600), 1.0)


def test_local_paths_become_absolute_and_urls_stay(tmp_path, monkeypatch):
    from train.config import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hfdir").mkdir()
    cfg = absolute_paths(
        TrainConfig(
            images=["imgs", "hf:hfdir[train]", "hf:org/name", "s3://b/x.tar"],
            cache="c",
            store="s3://b/store",
            init="../w.pth.tar",
        )
    )
    assert cfg.images == [str(tmp_path / "imgs"), f"hf:{tmp_path / 'hfdir'}[train]", "hf:org/name", "s3://b/x.tar"]
    assert (cfg.cache, cfg.store, cfg.mirror) == (str(tmp_path / "c"), "s3://b/store", None)
    assert cfg.init == str(tmp_path.parent / "w.pth.tar")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    """The configs the docs point users to are config keys of today's names and types, and pass `validate` (given
    a cache and store for the modes that read text)."""
    config = apply(TrainConfig(cache="c", store="s"), load_yaml(path), str(path))
    validate(config)
    if path.name.startswith("paper_"):
        assert config.compile and config.bf16 and config.batch_size == 2048, "the GPU settings the docs describe"
