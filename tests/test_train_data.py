"""Training batches, schedules, EMA and optimiser groups, in process."""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from embedding_cache.reader import EmbeddingReader, StoreKeys
from embedding_cache.store import EmbeddingStore, TokenLayout
from pipeline.core.errors import DataProblem, UserError
from pipeline.core.refs import ImageRef
from train.config import ModelConfig, TrainConfig
from train.data import Batch, StepBatches, crop_box
from train.data_index import TrainIndex, build_index, verify_images
from train.jepa import build_models, ema_update
from train.optim import apply_schedules, param_groups
from train.partitions import split_partitions
from train.schedules import Cosine, Linear, WarmupCosine
from train.step import to_device


@pytest.fixture(scope="module")
def setup(synth_dir, annotated_cache, vector_store):
    index = build_index([synth_dir / "images"], annotated_cache, vector_store, [], progress=False)
    cfg = TrainConfig(
        images=[str(synth_dir / "images")],
        cache=str(annotated_cache),
        store=str(vector_store),
        model="vit_tiny",
        patch_size=8,
        image_size=64,
        batch_size=8,
        steps=100,
        captions_per_image=3,
        min_context=4,
        seed=5,
    )
    return index, cfg


def _same(a, b):
    for name in ("images", "context", "context_lengths", "targets", "lengths", "tokens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _padded(batch) -> torch.Tensor:
    """The batch's captions `[b, N, S, d]` as the step gets them: packed tokens padded where they are moved to."""
    return to_device(batch, torch.device("cpu")).tokens


def test_a_step_is_the_same_on_one_or_two_processes(setup):
    index, cfg = setup
    ids = np.arange(len(index))
    whole = StepBatches(index, ids, cfg, (8, 8))[7]
    halves = [StepBatches(index, ids, cfg, (8, 8), rank=r, world=2)[7] for r in (0, 1)]
    assert whole.context.shape[0] == 8 and halves[0].context.shape[0] == 4
    for r, half in enumerate(halves):
        sliced = whole.rows(4 * r, 4 * r + 4)
        sliced.context = whole.context[4 * r : 4 * r + 4]  # `rows` also cuts the context's padding; masks do not
        _same(half, sliced)
    again = StepBatches(index, ids, cfg, (8, 8))[7]
    _same(whole, again)
    assert not torch.equal(StepBatches(index, ids, cfg, (8, 8))[8].images, whole.images)


def test_captions_are_the_images_own_embeddings(setup):
    index, cfg = setup
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    batch = data[3]
    reader = EmbeddingReader(cfg.store)
    for k, i in enumerate(data.images_of_step(3).tolist()):
        own = {bytes(key) for key in index.captions_of(i)}
        assert batch.lengths[k].tolist() == [
            min(len(reader.get_key(key)), cfg.max_words) for key in _picked(batch, k, reader, own)
        ]


def _picked(batch, k, reader, own_keys):
    """Keys among the image's own captions whose embeddings equal the batch's caption slots, slot by slot."""
    picked = []
    padded = _padded(batch)
    for n in range(batch.lengths.shape[1]):
        words = padded[k, n, : int(batch.lengths[k, n])].numpy()
        hits = [key for key in own_keys if np.array_equal(reader.get_key(key)[: len(words)], words)]
        assert hits, f"caption slot {n} of sample {k} is not one of the image's captions"
        picked.append(hits[0])
    assert len(set(picked)) == len(picked), "a caption was picked twice"
    return picked


def test_the_index_resolves_each_caption_where_a_key_lookup_finds_it(setup):
    index, cfg = setup
    reader = EmbeddingReader(cfg.store)
    want = reader.spans_of_rows(reader.locate(index.caption_keys))
    got = index.caption_spans
    assert [index.segments[s] for s in got.segment.tolist()] == [reader.segment_ids[s] for s in want.segment.tolist()]
    assert np.array_equal(got.start, want.start) and np.array_equal(got.length, want.length)
    assert (got.segment.dtype, got.start.dtype, got.length.dtype) == (np.int32, np.int64, np.int32)


class _KeyIndexBuilds(torch.utils.data.Dataset):
    """Runs a step of `data` and answers how many key indexes this process has built by then."""

    def __init__(self, data: StepBatches) -> None:
        self.data = data

    def __len__(self) -> int:
        return 4

    def __getitem__(self, step: int) -> int:
        self.data[step]
        return StoreKeys.builds


def test_neither_the_dataset_nor_its_workers_build_a_key_index(setup):
    index, cfg = setup
    before = StoreKeys.builds
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    data.validation_batch(np.arange(3))
    assert data[2].lengths.gt(0).any() and StoreKeys.builds == before, "in this process"
    loader = torch.utils.data.DataLoader(_KeyIndexBuilds(data), batch_size=None, num_workers=1)
    assert list(loader) == [before] * 4, "in a DataLoader worker"


def _republished(path, into):
    """The store at `path` written anew into `into`: the same captions and vectors in new segments."""
    old, reader = EmbeddingStore(path), EmbeddingReader(path)
    new = EmbeddingStore.open_or_create(into, old.encoder, old.width)
    writer = new.new_segment(TokenLayout(chunk_tokens=64, shard_chunks=4))
    for segment in old.segment_ids():
        for key in old.read_keys(segment):
            writer.append(key.tobytes(), reader.get_key(key.tobytes()))
    writer.finish()
    new.publish(writer)


def test_an_index_whose_store_changed_is_refused(setup, tmp_path, synth_dir, annotated_cache):
    from train.inputs import load_or_build_index
    from train.run_dir import INDEX
    from train.runtime import Runtime

    _, cfg = setup
    store = tmp_path / "store"
    shutil.copytree(cfg.store, store)
    cfg = dataclasses.replace(cfg, store=str(store))
    run = tmp_path / "run"
    run.mkdir()
    rt = Runtime(0, 1, torch.device("cpu"))
    index = load_or_build_index(cfg, run, rt)
    writer = EmbeddingStore(store).new_segment(TokenLayout(chunk_tokens=64, shard_chunks=4))
    writer.append(b"\x01" * 32, np.ones((3, EmbeddingStore(store).width), np.float16))
    writer.finish()
    EmbeddingStore(store).publish(writer)
    assert load_or_build_index(cfg, run, rt).segments == index.segments, "a store that only grew still serves it"

    _republished(cfg.store, tmp_path / "anew")
    shutil.rmtree(store)
    shutil.copytree(tmp_path / "anew", store)
    with pytest.raises(UserError, match=f"no longer holds 2 of the segments .*delete {run / INDEX} to rebuild"):
        load_or_build_index(cfg, run, rt)
    with pytest.raises(UserError, match=r"does not hold segment .* which the run index reads; the store was changed"):
        StepBatches(index, np.arange(len(index)), cfg, (8, 8))[0]
    (run / INDEX).unlink()
    rebuilt = load_or_build_index(cfg, run, rt)
    assert rebuilt.segments == EmbeddingStore(store).segment_ids() and len(rebuilt.segments) == 1


def test_every_image_is_seen_once_per_epoch(setup):
    index, cfg = setup
    split = split_partitions(np.zeros(len(index), np.int32), 1, 8, cfg.seed)
    train_ids, val_ids = split.train_ids, split.val_ids
    assert not set(train_ids) & set(val_ids) and len(train_ids) + len(val_ids) == len(index)
    data = StepBatches(index, train_ids, cfg, (8, 8))
    per_epoch = len(train_ids) // cfg.batch_size  # 32 training images, 8 per step
    seen = np.concatenate([data.images_of_step(s) for s in range(per_epoch)])
    assert sorted(seen.tolist()) == sorted(train_ids.tolist())


def test_validation_batch_is_fixed_and_uncropped(setup):
    index, cfg = setup
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    a, b = data.validation_batch(np.arange(4)), data.validation_batch(np.arange(4))
    _same(a, b)
    assert a.lengths.shape == (4, 3) and (a.lengths > 0).all()  # the first N of the 8 captions, always


def _copied_images(cfg: TrainConfig, tmp_path):
    """The images copied to a new folder, their index, and a one-image-batch config."""
    folder = tmp_path / "images"
    shutil.copytree(cfg.images[0], folder)
    moved = build_index([folder], cfg.cache, cfg.store, [], progress=False, verify_sample=0)
    return folder, moved, TrainConfig(**{**cfg.__dict__, "batch_size": 1})


def test_a_changed_image_is_read_unhashed_and_caught_by_verify_images(setup, tmp_path):
    folder, moved, one = _copied_images(setup[1], tmp_path)
    data = StepBatches(moved, np.array([0]), one, (8, 8))
    before = data.validation_batch(np.array([0])).images
    verify_images(moved, progress=False)  # nothing changed: passes
    victim = folder / moved.refs[0].source_id
    with Image.open(victim) as im:
        fmt = im.format
        ImageOps.invert(im.convert("RGB")).save(victim, format=fmt)  # still decodable, other bytes and pixels
    # Training reads it as it is now: no hash on the read path, so no complaint, and the new pixels.
    after = data.validation_batch(np.array([0]))
    assert after.replaced == 0 and not torch.equal(after.images, before)
    with pytest.raises(DataProblem, match=f"image {moved.refs[0].source_id} changed since the run's index was built"):
        verify_images(moved, progress=False)


def test_crop_box_stays_inside_and_respects_scale():
    rng = np.random.default_rng(0)
    fractions = []
    for _ in range(500):
        w, h = int(rng.integers(100, 150)), int(rng.integers(100, 150))
        left, top, right, bottom = crop_box(rng, w, h, (0.3, 1.0), (0.75, 4 / 3))
        assert 0 <= left < right <= w and 0 <= top < bottom <= h
        fractions.append((right - left) * (bottom - top) / (w * h))
    assert 0.25 <= min(fractions) and max(fractions) <= 1.0 and 0.5 < np.mean(fractions) < 0.8
    # An image too elongated for any crop of the allowed aspect: the largest centred crop that fits.
    assert crop_box(np.random.default_rng(0), 400, 40, (0.9, 1.0), (0.75, 4 / 3)) == (173, 0, 226, 40)


def test_schedules_are_functions_of_the_step():
    lr = WarmupCosine(start=2e-4, peak=1e-3, final=1e-6, warmup=10, total=110)
    assert lr(0) == 2e-4 and lr(5) == pytest.approx(6e-4) and lr(10) == pytest.approx(1e-3)
    assert (
        lr(60) == pytest.approx(1e-6 + 0.5 * (1e-3 - 1e-6))
        and lr(110) == pytest.approx(1e-6)
        and lr(500) == pytest.approx(1e-6)
    )
    wd = Cosine(0.04, 0.4, 100)
    assert wd(0) == pytest.approx(0.04) and wd(50) == pytest.approx(0.22) and wd(100) == pytest.approx(0.4)
    ema = Linear(0.996, 1.0, 100)
    assert ema(0) == 0.996 and ema(25) == pytest.approx(0.997) and ema(100) == 1.0


def test_ema_update_and_optimizer_groups():
    cfg = TrainConfig(
        model="vit_tiny",
        depth=1,
        patch_size=8,
        image_size=32,
        predictor_width=48,
        predictor_depth=1,
        conditioning="cross",
        cache="c",
        store="s",
    )
    model, target = build_models(ModelConfig.of(cfg), text_dim=16)
    assert not any(p.requires_grad for p in target.parameters())
    for p in model.encoder.parameters():
        p.data.add_(1.0)
    before = [p.clone() for p in target.parameters()]
    ema_update(target, model.encoder, 0.9)
    for t0, t1, o in zip(before, target.parameters(), model.encoder.parameters()):
        torch.testing.assert_close(t1, 0.9 * t0 + 0.1 * o)
    groups = param_groups(model, text_lr_scale=3.0)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        for p in g["params"]:
            assert g["decay"] == (p.ndim > 1), names[id(p)]
            assert (g["lr_scale"] == 3.0) == (".cross." in names[id(p)] or ".norm_cross." in names[id(p)]), names[id(p)]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert math.isclose(sum(p.numel() for g in groups for p in g["params"]), sum(p.numel() for p in model.parameters()))


def test_the_text_learning_rate_scale_leaves_weight_decay_alone():
    """AdamW decays a weight by lr · weight_decay per step: with zero gradients (decay alone), a text weight whose
    learning rate is scaled 10× shrinks exactly as much as any other weight, while its gradient steps are 10× larger."""
    text, other = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    groups = [
        {"params": [other], "decay": True, "lr_scale": 1.0},
        {"params": [text], "decay": True, "lr_scale": 10.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1.0)
    for group in opt.param_groups:
        apply_schedules(group, lr=1e-2, weight_decay=0.4)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-1]
    for _ in range(5):
        text.grad, other.grad = torch.zeros_like(text), torch.zeros_like(other)
        opt.step()
    torch.testing.assert_close(text.detach(), other.detach(), rtol=0, atol=0)
    assert float(other.detach()[0, 0]) == pytest.approx((1 - 1e-2 * 0.4) ** 5)
    bias = {"params": [torch.nn.Parameter(torch.ones(2))], "decay": False, "lr_scale": 10.0}
    apply_schedules(bias, lr=1e-2, weight_decay=0.4)
    assert bias["weight_decay"] == 0.0 and bias["lr"] == pytest.approx(0.1)


def test_an_image_gone_since_the_index_was_built_is_replaced_with_its_captions(setup, tmp_path):
    folder, moved, one = _copied_images(setup[1], tmp_path)
    unreadable = folder / moved.refs[1].source_id
    unreadable.unlink()
    unreadable.mkdir()  # reading it raises IsADirectoryError, as an unreadable file would
    (folder / moved.refs[3].source_id).unlink()  # gone
    cfg = TrainConfig(**{**one.__dict__, "batch_size": 3})
    data = StepBatches(moved, np.array([0, 1, 2, 3, 5]), cfg, (8, 8))
    step = next(s for s in range(20) if {1, 3} & set(data.images_of_step(s).tolist()))
    asked = data.images_of_step(step)
    batch = data[step]
    assert batch.replaced == len({1, 3} & set(asked.tolist()))
    # The next usable image of the training split stands in, pixels and captions alike: 1 -> 2, 3 -> 5 (4 is not
    # in this split, so a held-out image never stands in for a training one).
    stand_in = np.array([{1: 2, 3: 5}.get(i, i) for i in asked.tolist()])
    for k, i in enumerate(stand_in.tolist()):
        own = {bytes(key) for key in moved.captions_of(i)}
        _picked(batch, k, EmbeddingReader(cfg.store), own)
    # Pixels too: in a validation batch (no random crop), image 1's slot shows image 2.
    pair, alone = data.validation_batch(np.array([1, 2])), data.validation_batch(np.array([2]))
    assert pair.replaced == 1 and torch.equal(pair.images[0], alone.images[0])
    assert torch.equal(_padded(pair)[0], _padded(pair)[1])


# --- captions: packed, in reused shared buffers, padded on the device ------------------------------------------


def _chosen_rows(batch: Batch, reader: EmbeddingReader, index, ids: np.ndarray) -> np.ndarray:
    """Store rows of the captions in each slot (-1: none), found by matching the packed tokens to the image's own."""
    rows = np.full(batch.lengths.shape, -1, dtype=np.int64)
    start = 0
    for k, i in enumerate(ids.tolist()):
        own = reader.locate(index.captions_of(i))
        for n in range(batch.lengths.shape[1]):
            length = int(batch.lengths[k, n])
            words = batch.tokens[start : start + length].numpy()
            start += length
            if length:
                rows[k, n] = next(r for r in own.tolist() if np.array_equal(reader.get(r)[:length], words))
    return rows


def test_packed_captions_padded_on_the_device_equal_the_old_padded_batch(setup):
    index, cfg = setup
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    reader = EmbeddingReader(cfg.store)
    for step in (0, 5):
        batch = data[step]
        assert batch.tokens is not None and batch.tokens.dim() == 2, "packed: [sum of lengths, d]"
        assert len(batch.tokens) == int(batch.lengths.sum()) < batch.lengths.numel() * int(batch.lengths.max())
        assert int(batch.lengths.max()) == cfg.max_words
        rows = _chosen_rows(batch, reader, index, data.images_of_step(step))
        old, old_lengths = reader.gather_padded(rows.reshape(-1), max_len=cfg.max_words)
        moved = to_device(batch, torch.device("cpu"))
        assert torch.equal(moved.lengths, torch.from_numpy(old_lengths).view(batch.lengths.shape))
        assert torch.equal(moved.tokens, torch.from_numpy(old).view(moved.tokens.shape))


def test_batches_from_a_worker_come_in_reused_shared_buffers_and_stay_intact_once_released(setup):
    index, cfg = setup
    data = StepBatches(index, np.arange(len(index)), cfg, (8, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=range(10), num_workers=1, prefetch_factor=2)
    moved = []
    for taken, batch in enumerate(loader, start=1):
        assert batch.lease is not None and int(batch.lease[0]) == taken, "the lease word: which take holds it"
        for t in (batch.images, batch.context, batch.targets, batch.tokens, batch.lengths):
            assert t.is_shared() and t.untyped_storage().data_ptr() == batch.lease.untyped_storage().data_ptr()
        moved.append(to_device(batch, torch.device("cpu")))
        lease = batch.lease
        batch.release()  # as `on_device` does: the worker refills the buffer for a later batch
        assert int(lease[0]) in (0, *range(taken + 1, 11)), "free, or already taken again for a later batch"
    # Every batch handed to the step is still the batch made for its step (as made in this process), although the
    # worker has since refilled the buffers they came in.
    for step, got in enumerate(moved):
        here = to_device(data[step], torch.device("cpu"))
        for name in ("images", "context", "context_lengths", "targets", "tokens", "lengths"):
            assert torch.equal(getattr(got, name), getattr(here, name)), (step, name)


# --- the step-batch sampler: which samples each rank takes at each step ---------------------------------------


def _sampler(n_images: int, batch: int, seed: int = 3, rank: int = 0, world: int = 1) -> StepBatches:
    """Batches over `n_images` indexed images (ids 100, 103, ...), no text: `images_of_step` reads no image."""
    refs = [ImageRef(f"{i}.png", "file", f"/nowhere/{i}.png") for i in range(n_images)]
    index = TrainIndex(
        refs, ["0" * 64] * n_images, np.zeros(n_images + 1, np.int64), np.zeros((0, 32), np.uint8), [], {}
    )
    cfg = TrainConfig(conditioning="none", batch_size=batch, seed=seed, steps=100, image_size=32, patch_size=8)
    return StepBatches(index, 100 + 3 * np.arange(n_images), cfg, (4, 4), rank=rank, world=world)


def test_epochs_run_back_to_back_each_a_permutation_of_the_images():
    data = _sampler(10, 4)
    taken = np.concatenate([data.images_of_step(s) for s in range(15)])  # 60 samples: 6 epochs, steps across ends
    epochs = taken.reshape(6, 10)
    for order in epochs:
        assert sorted(order.tolist()) == list(range(100, 130, 3)), "each image once per epoch"
    assert len({tuple(order) for order in epochs}) == 6, "a new order each epoch"
    straddling = data.images_of_step(2)  # positions 8..11: the end of epoch 0, the start of epoch 1
    assert straddling.tolist() == [*epochs[0][8:], *epochs[1][:2]]
    assert np.array_equal(_sampler(10, 4).images_of_step(7), data.images_of_step(7)), "a function of (seed, step)"
    assert not np.array_equal(_sampler(10, 4, seed=4).images_of_step(0), data.images_of_step(0))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_shares_are_disjoint_and_make_up_the_global_batch(world):
    whole = _sampler(13, 8)
    for step in (0, 1, 5, 11):
        shares = [_sampler(13, 8, rank=r, world=world).images_of_step(step) for r in range(world)]
        assert all(len(s) == 8 // world for s in shares)
        # Rank r takes global positions [r·b/w, (r+1)·b/w) of the step: in rank order, the shares are the batch.
        assert np.array_equal(np.concatenate(shares), whole.images_of_step(step))


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="batch_size 8 is not divisible by 3 processes"):
        _sampler(13, 8, rank=0, world=3)
