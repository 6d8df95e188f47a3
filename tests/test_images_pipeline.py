"""The training input pipeline: draft-mode decoding, antialiased bilinear resizing, captions packed in reused shared
buffers and padded on the device, `--verify-images` instead of a hash per read, `--decode gpu`'s CPU fallback."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.nn.functional import interpolate
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2.functional import resize

import train.images
from embedding_cache.reader import EmbeddingReader
from embedding_cache.store import EmbeddingStore, TokenLayout
from embedding_cache.transform import fit_transform
from pipeline.core.images import load_rgb, open_image, oriented_size
from pipeline.core.recipes import text_key
from tests.support.commands import tcjepa
from tests.support.training import assert_close_runs, metrics, train_args
from train.data import Batch, BatchBuffers
from train.images import (
    EncodedImages,
    antialiased_bilinear_weights,
    crop_resize,
    crop_resize_into,
    crop_resize_on_device,
    device_decodable,
    draft_reduction,
)
from train.step import to_device


def scene_jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    """A photo-like JPEG: smooth random shapes with fine texture."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8))
    scene = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    pixels = np.clip(scene + rng.normal(0, 6, (height, width, 1)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return 10 * np.log10(255.0**2 / mse)


def test_a_draft_decode_is_close_to_a_full_decode_and_resize():
    data = scene_jpeg(1600, 1200)
    box, size = (100, 80, 1500, 1130), 224  # a crop more than 4x the output on each side
    assert draft_reduction(box, size) == 4
    drafted, _ = load_rgb(open_image(data)[0], draft_reduction(box, size))
    assert drafted is not None and drafted.size == (400, 300), "libjpeg decoded at a quarter scale"
    im = open_image(data)[0]
    fast = crop_resize(im, oriented_size(im), box, size, flip=False)
    full, _ = load_rgb(open_image(data)[0])
    assert full is not None and full.size == (1600, 1200)
    pixels = torch.from_numpy(np.array(full.crop(box))).permute(2, 0, 1)
    reference = resize(pixels, [size, size], antialias=True)
    assert fast is not None and fast.shape == reference.shape == (3, size, size)
    assert psnr(fast, reference) > 32, psnr(fast, reference)
    assert float((fast.float() - reference.float()).abs().mean()) < 2.5


def test_the_resize_is_torchvisions_antialiased_bilinear_and_the_flip_a_mirror():
    data = scene_jpeg(300, 200, seed=1)
    box, size = (20, 10, 280, 190), 128  # the crop is under twice the output: decoded whole
    assert draft_reduction(box, size) == 1
    im = open_image(data)[0]
    ours = crop_resize(im, oriented_size(im), box, size, flip=False)
    flipped = crop_resize(open_image(data)[0], (300, 200), box, size, flip=True)
    whole, _ = load_rgb(open_image(data)[0])
    assert whole is not None and ours is not None and flipped is not None
    crop = torch.from_numpy(np.array(whole.crop(box))).permute(2, 0, 1)
    expected = resize(crop, [size, size], interpolation=InterpolationMode.BILINEAR, antialias=True)
    assert torch.equal(ours, expected)
    assert torch.equal(flipped, expected.flip(-1))
    for other in (
        resize(crop, [size, size], interpolation=InterpolationMode.BILINEAR, antialias=False),
        resize(crop, [size, size], interpolation=InterpolationMode.BICUBIC, antialias=True),
    ):
        assert not torch.equal(ours, other)


def test_an_exif_rotated_jpeg_is_cropped_upright():
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: show rotated 90° clockwise
    Image.open(io.BytesIO(scene_jpeg(120, 80, seed=2))).save(rotated, format="JPEG", quality=95, exif=exif)
    im = open_image(rotated.getvalue())[0]
    assert im is not None and im.size == (120, 80) and oriented_size(im) == (80, 120)
    out = crop_resize(im, (80, 120), (0, 0, 80, 120), 48, flip=False)
    upright, _ = load_rgb(open_image(rotated.getvalue())[0])
    assert upright is not None and upright.size == (80, 120) and out is not None
    expected = resize(torch.from_numpy(np.array(upright)).permute(2, 0, 1), [48, 48], antialias=True)
    assert torch.equal(out, expected)


# --- captions: packed, in reused shared buffers, padded on the device ------------------------------------------


def test_int8_captions_are_dequantized_and_padded_on_the_device_as_the_reader_pads_them(tmp_path):
    rng = np.random.default_rng(0)
    d, lengths = 256, [5, 0, 9, 3, 12, 7, 1, 4]
    vectors = rng.standard_normal((sum(lengths), d)).astype(np.float32)
    vectors[:, [3, d // 2, d - 5]] *= np.array([50.0, 75.0, 100.0], dtype=np.float32)  # T5-like: channel scaling
    entries, transform = fit_transform(vectors, "int8", None, captions=len(lengths))
    store = EmbeddingStore.open_or_create(
        tmp_path / "s", {"kind": "test", "storage_dtype": "int8", **entries}, d, transform=transform
    )
    writer = store.new_segment(TokenLayout(chunk_tokens=8, shard_chunks=2))
    offsets = np.cumsum([0, *lengths])
    for i in range(len(lengths)):
        writer.append(text_key(f"caption {i}"), vectors[offsets[i] : offsets[i + 1]].astype(np.float16))
    writer.finish()
    store.publish(writer)
    reader = EmbeddingReader(tmp_path / "s")
    assert reader.codec == "int8" and reader.channel_scales is not None
    chosen = np.array([[0, 2, -1], [4, -1, -1], [5, 6, 7], [3, 1, 2]])  # row 1 has no tokens
    present = chosen[chosen >= 0]
    tokens, scales, _ = reader.gather_packed_raw(present, max_len=10)
    lengths_out = np.zeros(chosen.size, dtype=np.int64)
    lengths_out[chosen.reshape(-1) >= 0] = np.minimum(reader.lengths(present), 10)
    batch = Batch(
        torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
        torch.zeros(4, 1, dtype=torch.int64),
        torch.ones(4, dtype=torch.int64),
        torch.zeros(4, 1, 1, dtype=torch.int64),
        torch.from_numpy(tokens),
        torch.from_numpy(lengths_out).view(4, 3),
        0,
        torch.from_numpy(scales),
        torch.from_numpy(reader.channel_scales),
    )
    assert batch.tokens.dtype == torch.int8
    moved = to_device(batch, torch.device("cpu"))
    old, _ = reader.gather_padded(chosen.reshape(-1), max_len=10)
    # the longest caption (10 tokens) rounded up to a multiple of 8: zeros past the reader's padding
    assert moved.tokens.dtype == torch.float16 and moved.tokens.shape == (4, 3, 16, d)
    torch.testing.assert_close(moved.tokens[:, :, :10], torch.from_numpy(old).view(4, 3, 10, d), rtol=1e-3, atol=1e-3)
    assert not moved.tokens[:, :, 10:].any()


def test_batch_buffers_are_reused_once_released_and_never_while_out():
    buffers = BatchBuffers(capacity=256, keep=2)
    a, lease_a = buffers.take()
    b, lease_b = buffers.take()
    assert a.data_ptr() != b.data_ptr() and (int(lease_a[0]), int(lease_b[0])) == (1, 2), "each take's number"
    c, _ = buffers.take()  # both out, the pool full: a fresh buffer that is not kept
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr()) and len(buffers.pool) == 2
    lease_b.zero_()  # what Batch.release does
    again, lease = buffers.take()
    assert again.data_ptr() == b.data_ptr() and int(lease[0]) == 4


# --- --verify-images and --decode gpu, through the CLI ----------------------------------------------------------


@pytest.mark.slow
def test_verify_images_refuses_a_changed_image_in_one_line_while_training_reads_it_unhashed(tmp_path, synth_dir):
    images = tmp_path / "images"
    shutil.copytree(synth_dir / "images", images)
    none = ["--conditioning", "none", "--steps", "2"]
    first = tmp_path / "first"
    tcjepa(*train_args(images, None, None, first, *none))  # builds the index (hashing every image once)
    again = tmp_path / "again"  # a run that starts from the same index
    again.mkdir()
    for name in ("config.yaml", "index.parquet"):
        shutil.copy(first / name, again / name)
    victim = sorted(images.iterdir())[0]
    with Image.open(victim) as im:
        fmt = im.format
        ImageOps.invert(im.convert("RGB")).save(victim, format=fmt)  # decodable, but other bytes
    refused = tcjepa(*train_args(images, None, None, first, *none, "--verify-images"), check=False)
    assert refused.returncode == 1, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"problem: image {victim.name} changed since the run's index was built"), line
    assert "Traceback" not in refused.stderr
    # Without the flag nothing is hashed: the changed image is trained on without a word.
    tcjepa(*train_args(images, None, None, again, *none))
    assert metrics(again)[-1]["step"] == 2
    assert all(m.get("images_replaced", 0) == 0 for m in metrics(again))


@pytest.mark.slow
def test_decode_gpu_without_cuda_decodes_on_the_cpu_and_trains_the_same(
    tmp_path, synth_dir, annotated_cache, annotated_store
):
    runs: dict[str, Path] = {}
    stderr = {}
    for decode in ("cpu", "gpu"):
        runs[decode] = tmp_path / decode
        args = train_args(synth_dir / "images", annotated_cache, annotated_store, runs[decode], "--steps", "3")
        stderr[decode] = tcjepa(*args, "--decode", decode, "--set", "log_every=1").stderr
    fallback = [line for line in stderr["gpu"].splitlines() if line.startswith("--decode gpu")]
    assert fallback == ["--decode gpu: no CUDA device (cpu); decoding images on the CPU"]
    assert not any(line.startswith("--decode gpu") for line in stderr["cpu"].splitlines())
    assert_close_runs(metrics(runs["gpu"]), metrics(runs["cpu"]))


def _device_decoded_batch(folder: Path, **settings: Any) -> Batch:
    """The first batch of 4 that the loader makes of the images in `folder` with `decode: gpu`."""
    from train.config import TrainConfig
    from train.data import StepBatches
    from train.data_index import build_index

    index = build_index([folder], None, None, [], progress=False)
    cfg = TrainConfig(
        images=[str(folder)],
        conditioning="none",
        model="vit_tiny",
        image_size=32,
        patch_size=8,
        batch_size=4,
        min_context=2,
        **settings,
    )
    return StepBatches(index, np.arange(len(index)), cfg, (4, 4), device_decode=True)[0]


def test_the_loader_hands_device_decoded_jpegs_over_with_the_run_s_resize_and_both_resizes_agree(tmp_path, monkeypatch):
    """`StepBatches` with `decode: gpu` sends a batch's JPEGs with the run's `device_resize`; decoded and resized
    (here on the CPU, where torchvision has no image extension and each image is decoded alone), per image or
    batched, the batch's pixels agree to a level of uint8."""
    folder = tmp_path / "jpegs"
    folder.mkdir()
    for k, (width, height) in enumerate([(90, 60), (60, 90), (75, 75), (120, 50)] * 2):
        (folder / f"{k}.jpg").write_bytes(scene_jpeg(width, height, seed=k))
    pixels = {}
    calls: list[tuple] = []
    monkeypatch.setattr(train.images, "crop_resize_into", lambda *a: calls.append(a) or crop_resize_into(*a))
    for way in ("per_image", "batched"):
        batch = _device_decoded_batch(folder, device_resize=way, hflip=True)
        assert batch.encoded is not None and batch.encoded.resize == way and batch.encoded.rows == [0, 1, 2, 3]
        assert any(batch.encoded.flips) and not all(batch.encoded.flips)
        calls.clear()
        pixels[way] = to_device(batch, torch.device("cpu")).images
        assert len(calls) == (way == "batched"), "the batched resize runs when asked for, and only then"
    assert (pixels["per_image"].int() - pixels["batched"].int()).abs().max() <= 1


def test_device_decoded_rows_pack_into_one_block_and_split_with_the_micro_batches():
    jpegs = [torch.frombuffer(bytearray(scene_jpeg(40 + k, 30, seed=k)), dtype=torch.uint8) for k in range(4)]
    boxes = [(0, 0, 40 + k, 30) for k in range(4)]
    encoded = EncodedImages([0, 2, 3, 5], jpegs, boxes, [False, True, False, True]).packed()
    assert len({d.untyped_storage().data_ptr() for d in encoded.data}) == 1, "one block for the batch"
    assert all(torch.equal(a, b) for a, b in zip(encoded.data, jpegs))
    second = encoded.select(2, 6)  # rows 2..5 of the batch: the images of rows 2, 3 and 5
    assert second is not None and second.rows == [0, 1, 3] and second.flips == [True, False, True]
    assert second.boxes == boxes[1:] and all(torch.equal(a, b) for a, b in zip(second.data, jpegs[1:]))
    assert encoded.select(1, 2) is None
    data = bytes(jpegs[0].numpy())
    im = open_image(data)[0]
    assert im is not None and device_decodable(im, data) and device_decodable(im, data + bytes(16))
    cut = data[: data.index(b"\xff\xda") + 14]  # the header and the scan's, then nothing: sent to the CPU
    assert not device_decodable(open_image(cut)[0], cut)
    png = _png(40, 30)
    assert not device_decodable(open_image(png)[0], png)


def test_the_loader_replaces_a_jpeg_cut_short_before_a_device_decoder_sees_it(tmp_path):
    """`--decode gpu`: a JPEG whose header is sound but whose file ends early goes to the CPU decoder, which refuses
    it, and the loader replaces the image by the next usable one, as without `--decode gpu`; nvJPEG never gets the
    damaged bytes (it need not report them)."""
    folder = tmp_path / "jpegs"
    folder.mkdir()
    whole = [scene_jpeg(60 + 5 * k, 50, seed=k) for k in range(4)]
    cut = whole[0][: len(whole[0]) // 2]
    assert open_image(cut)[0] is not None, "its header is whole: only the end decides"
    (folder / "0.jpg").write_bytes(cut)
    for k in range(1, 4):
        (folder / f"{k}.jpg").write_bytes(whole[k])
    batch = _device_decoded_batch(folder)
    assert batch.encoded is not None and batch.replaced == 1
    sent = {bytes(d.numpy()) for d in batch.encoded.data}
    assert len(batch.encoded.rows) == 4 and sent <= set(whole[1:]), "only whole JPEGs reach the device decoder"


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(("length", "size"), [(500, 224), (1200, 224), (225, 224), (224, 224), (100, 224), (37, 16)])
def test_the_batched_resize_weighs_pixels_as_torch_s_antialiased_bilinear_resize(length, size):
    """Torch's own weights, read off its kernel by resizing an identity (input pixel j is the impulse j), against
    `antialiased_bilinear_weights` for shrinking, keeping and enlarging, padded past the input's end with zeros."""
    eye = torch.eye(length)[None, None]
    want = interpolate(eye, size=(size, length), mode="bilinear", align_corners=False, antialias=True)[0, 0]
    got = antialiased_bilinear_weights(torch.tensor([length, length // 2 + 1]), size, length + 5)
    torch.testing.assert_close(got[0, :, :length], want, rtol=0, atol=2e-5)
    assert (got[0, :, length:] == 0).all() and (got[1, :, length // 2 + 1 :] == 0).all()
    torch.testing.assert_close(got.sum(-1), torch.ones(2, size))


def test_batched_crops_resize_as_each_alone_in_one_group_or_several(monkeypatch):
    """`crop_resize_into` on crops that shrink, keep and enlarge, flipped or not, from images of other sizes: the
    pixels torch's float resize gives each crop alone (what `crop_resize_on_device` runs on CUDA), to a level of
    uint8 where rounding falls the other way; and the same pixels when the crops are resized in several groups."""
    g = torch.Generator().manual_seed(0)
    sides = [(375, 500), (500, 375), (333, 500), (60, 80), (500, 500), (90, 40)]
    images = [
        interpolate(torch.rand(1, 3, h // 8, w // 8, generator=g), size=(h, w), mode="bilinear")[0]
        .mul(255)
        .round()
        .to(torch.uint8)
        for h, w in sides
    ]
    boxes = [
        (10, 20, 410, 320),
        (0, 0, 375, 500),
        (100, 50, 200, 150),
        (5, 5, 45, 60),
        (0, 0, 500, 500),
        (3, 7, 40, 89),
    ]
    flips = [False, True, False, True, True, False]
    size = (48, 56)

    def alone(image: torch.Tensor, box: tuple[int, int, int, int], flip: bool) -> torch.Tensor:
        left, top, right, bottom = box
        crop = image[None, :, top:bottom, left:right].float()
        out = interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=True)[0].round()
        return (out.flip(-1) if flip else out).to(torch.uint8)

    def batched_resize() -> torch.Tensor:
        out = torch.zeros((len(images) + 2, 3, *size), dtype=torch.uint8)
        crop_resize_into(out, [5, 0, 7, 1, 3, 2], images, boxes, flips)  # rows of a batch, in another order
        assert (out[[4, 6]] == 0).all(), "rows not listed are left alone"
        return out[[5, 0, 7, 1, 3, 2]]

    batched = batched_resize()
    want = torch.stack([alone(i, b, f) for i, b, f in zip(images, boxes, flips)])
    differ = (batched.int() - want.int()).abs()
    assert differ.max() <= 1 and (differ == 0).float().mean() > 0.99, (differ.max(), (differ == 0).float().mean())
    each = torch.stack([crop_resize_on_device(i, b, size, f) for i, b, f in zip(images, boxes, flips)])
    assert (batched.int() - each.int()).abs().max() <= 1  # torchvision's uint8 path on the CPU, fixed-point
    monkeypatch.setattr(train.images, "BATCHED_RESIZE_BYTES", 3 * 500 * 500 * 4)  # the largest crop alone
    assert torch.equal(batched_resize(), batched)


@pytest.mark.parametrize("resize", ["per_image", "batched"])
def test_a_device_decoded_jpeg_with_a_corrupt_body_leaves_its_row_a_duplicate_without_captions(resize):
    """`--decode gpu` on a batch whose third JPEG has a sound header and no body. Here torchvision has no image
    extension, so the batched decode fails as nvJPEG does on such a file, and each image is decoded alone as the
    CPU loader decodes it: the sound ones as `crop_resize` makes them, the corrupt one's row another row's pixels,
    its captions dropped and the row counted."""
    sound = [scene_jpeg(40, 30, seed=k) for k in range(2)]
    corrupt = sound[0][: sound[0].index(b"\xff\xda") + 14]  # the header and the scan's, then nothing
    assert open_image(corrupt)[0] is not None and load_rgb(open_image(corrupt)[0])[0] is None
    jpegs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in (*sound, corrupt)]
    boxes = [(2, 3, 38, 27), (0, 0, 40, 30), (0, 0, 40, 30)]
    encoded = EncodedImages([0, 1, 2], jpegs, boxes, [False, True, False], resize).packed()
    assert encoded.resize == resize and encoded.select(0, 2).resize == resize
    lengths = torch.tensor([[3, 2], [4, 0], [6, 5]])
    batch = Batch(
        torch.zeros(3, 3, 16, 16, dtype=torch.uint8),
        torch.zeros(3, 1, dtype=torch.int64),
        torch.ones(3, dtype=torch.int64),
        torch.zeros(3, 1, 1, dtype=torch.int64),
        torch.randn(int(lengths.sum()), 8).half(),
        lengths,
        0,
        encoded=encoded,
    )
    moved = to_device(batch, torch.device("cpu"))
    for row, data in enumerate(sound):
        im = open_image(data)[0]
        assert im is not None
        want = crop_resize(im, im.size, boxes[row], 16, flip=row == 1)
        assert want is not None
        torch.testing.assert_close(moved.images[row].float(), want.float(), rtol=0, atol=2, msg=str(row))
    assert torch.equal(moved.images[2], moved.images[0]), "the unreadable row repeats another row's pixels"
    assert moved.replaced == 1 and moved.images_with_text == 2 and batch.images_with_text() == 3
    assert moved.lengths is not None and moved.lengths.tolist() == [[3, 2], [4, 0], [0, 0]]
    assert moved.image_words == 8, "the most real words of an image read (5), rounded up to 8; not the unread's 11"
