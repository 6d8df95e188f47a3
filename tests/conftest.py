"""Session-wide fixtures and the helpers tests share.

Tiny models, synthetic data, a caption cache, an embedding store, trained runs and an S3 server are built once per
test session. Tests run the CLI through `tcjepa` (wait for it) or `start_tcjepa` (a process to watch and kill), and end
only the processes they started (`kill_tree`).
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedding_cache.store import TokenLayout
from train.config import TrainConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process, here and in every process a test starts: on 2 cores that other processes (or other
# work on the machine) share, OpenMP's waiting threads made tiny models up to ~10x slower than one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]

# --- tiers -------------------------------------------------------------------------------------------------------

# Session fixtures that start a marked thing, or cost the unit tier too much (the tiny models and what is made with
# them: ~30 s on 2 cores): a test that uses one carries its marker, whether or not it says so itself.
FIXTURE_MARKERS = {
    "vllm_engine": "vllm",
    "s3_server": "s3",
    "tiny_models": "slow",
    "reference_run": "slow",
    "exact_run": "slow",
    "trained_t5": "slow",
}


# Under pytest-xdist (`make test`), each worker builds the session fixtures it needs. Tests that share one too costly
# to build twice, or a resource one machine holds once, run in one worker: the first matching group here.
XDIST_GROUPS = {"vllm_engine": "vllm", "trained_t5": "trained-t5", "ray": "ray"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which turns the xdist_group marks set here into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = config.pluginmanager.hasplugin("xdist")  # `-p no:xdist` knows no xdist_group marker
    for item in items:
        if "trained_t5" in item.fixturenames and item.nodeid not in TRAINED_T5_USERS:
            raise pytest.UsageError(f"{item.nodeid} uses trained_t5: add it to conftest.TRAINED_T5_USERS")
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in item.fixturenames and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        for name, group in XDIST_GROUPS.items() if grouped else ():
            if name in item.fixturenames or item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.xdist_group(group))
                break
    items.sort(key=_turn)


TIER_MARKERS = ("slow", "vllm", "ray", "distributed", "s3")


def _turn(item: pytest.Item) -> int:
    """When a test runs: the costly tiers first and the unit tier after them, so that pytest-xdist, which hands tests
    out in this order, ends a run on short tests that keep both workers busy to the end rather than on a long one
    beside an idle core; the trained T5's users last, when the build collection started is done."""
    if "trained_t5" in item.fixturenames:
        return 2
    return 0 if any(item.get_closest_marker(m) for m in TIER_MARKERS) else 1


# --- running the CLI --------------------------------------------------------------------------------------------


def cli(*args: object) -> list[str]:
    """The command line of `tcjepa ARGS` in this interpreter."""
    return [sys.executable, "-m", "pipeline", *map(str, args)]


def torchrun(*args: object, launch: tuple[str, ...] = ("--standalone", "--nproc-per-node", "2")) -> list[str]:
    """The command line of `torchrun LAUNCH -m pipeline ARGS` (default: two processes on this host)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "pipeline", *map(str, args)]


def two_nodes(name: str) -> tuple[str, ...]:
    """torchrun's launch options for two nodes of one process each, meeting at a c10d rendezvous on loopback."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    endpoint = ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name)
    return ("--nnodes", "2", "--nproc-per-node", "1", *endpoint)


def run_command(
    command: list[str], check: bool = True, timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run `command` in the repository (or `cwd=`), capturing its text output; with `check`, a failure shows its
    stderr. Past `timeout` it is ended with every process it started (subprocess.run ends only the first), and
    the test fails with its stderr."""
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **{"cwd": REPO, **kwargs}
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_family(child)
        raise AssertionError(
            f"{' '.join(map(str, command[1:]))} still running after {timeout} s; its stderr:\n"
            f"{(child.communicate()[1] or '')[-3000:]}"
        ) from None
    proc = subprocess.CompletedProcess(command, child.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command[1:])} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def tcjepa(*args: object, check: bool = True, timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run the real CLI (`python -m pipeline ...`) in a subprocess."""
    return run_command(cli(*args), check=check, timeout=timeout, **kwargs)


def refused(*args: object) -> subprocess.CompletedProcess:
    """`tcjepa ARGS` through the console script's own entry point (`pipeline.cli.main`), in this process: for
    commands that must be refused before any work. Everything but the process start (~2.5 CPU-seconds of imports)
    is the real path, exit status and stderr included; the same error path is checked from a process once per
    command (test_cli.py, and a `tcjepa(..., check=False)` test in each command's module)."""
    from pipeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["tcjepa", *map(str, args)]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            main()
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
    assert code != 0, f"tcjepa {' '.join(map(str, args))} was not refused:\n{out.getvalue()[-2000:]}"
    return subprocess.CompletedProcess(["tcjepa", *map(str, args)], code, out.getvalue(), err.getvalue())


def python_module(
    module: str, *args: object, check: bool = True, timeout: float = 600, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (a benchmark, say) in the repository, as `tcjepa` runs the CLI."""
    return run_command([sys.executable, "-m", module, *map(str, args)], check=check, timeout=timeout, **kwargs)


def start(command: list[str], quiet: bool = False, **kwargs: Any) -> subprocess.Popen:
    """Start `command` in the repository in a session of its own (so `kill_tree` can end it and its children);
    text pipes for its output, or none when `quiet`."""
    streams: dict[str, Any] = (
        {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        if quiet
        else {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    )
    return subprocess.Popen(command, start_new_session=True, **{"cwd": REPO, **streams, **kwargs})


def start_tcjepa(*args: object, quiet: bool = False, **kwargs: Any) -> subprocess.Popen:
    """Start `tcjepa ARGS` (see `start`)."""
    return start(cli(*args), quiet=quiet, **kwargs)


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[str, str]]:
    """Wait for processes started with pipes; each must succeed. Their (stdout, stderr). Past `timeout` (for all
    together) every one is ended with what it started, and the test fails with the end of each one's stderr."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, err[-3000:]
            outs.append((out, err))
    except subprocess.TimeoutExpired:
        tails = []
        for p in procs:
            if p.poll() is None:
                _end_family(p)
            tails.append((p.communicate()[1] or "")[-2000:])
        raise AssertionError(f"still running after {timeout} s; their stderr:\n" + "\n---\n".join(tails)) from None
    return outs


def _family(proc: subprocess.Popen) -> list[Any]:
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def freeze_tree(proc: subprocess.Popen) -> list[Any]:
    """SIGSTOP a process this test started and every process under it, until none is left running; returns them.

    The state the processes left on disk then stays as it is while the test looks at it.
    """
    import psutil

    stopped: dict[int, Any] = {}
    while True:
        family = [p for p in _family(proc) if p.pid not in stopped]
        if not family:
            return list(stopped.values())
        for p in family:
            with suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGSTOP)
                stopped[p.pid] = p


def thaw(family: list[Any]) -> None:
    """SIGCONT what `freeze_tree` stopped."""
    import psutil

    for p in family:
        with suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGCONT)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process this test started and every process under it, by their ids, and wait until they are gone.

    Stopped first, so none can start another; torchrun's workers and Ray's actors live in sessions of their own,
    which is why a process group is not enough.
    """
    _end_family(proc)
    proc.communicate() if proc.stdout is not None and not proc.stdout.closed else proc.wait()


def _end_family(proc: subprocess.Popen) -> None:
    import psutil

    family = freeze_tree(proc)
    for p in family:
        with suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(family, timeout=60)


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """Kill `proc` and everything under it (`kill_tree`) at the first moment `ready()` holds, which is checked again
    with all of them stopped: the kill lands exactly in the state the test waited for, not at a moment chosen by a
    clock."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the process ended before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill the process never came"
        if ready():
            family = freeze_tree(proc)
            if ready():
                kill_tree(proc)
                return
            thaw(family)
        time.sleep(0.02)


def descendants(proc: subprocess.Popen, marker: str) -> list[Any]:
    """Processes under `proc` whose command line contains `marker` (e.g. one Ray actor's class)."""
    import psutil

    found = []
    for p in _family(proc)[1:]:
        with suppress(psutil.NoSuchProcess):
            if marker in " ".join(p.cmdline()):
                found.append(p)
    return found


# --- training ---------------------------------------------------------------------------------------------------


def sets(*pairs: str) -> list[str]:
    """`--set key=value` for each pair."""
    return [arg for pair in pairs for arg in ("--set", pair)]


# A tiny run: 8×8 patches of 8 px, a 2-layer encoder and predictor, 4 captions per image.
TINY_TRAIN = [
    *("--model", "vit_tiny", "--patch-size", "8", "--image-size", "64", "--batch-size", "8"),
    *("--captions-per-image", "4", "--no-progress"),
    *sets("depth=2", "predictor_width=96", "predictor_depth=2", "min_context=4", "val_images=8"),
    *sets("num_workers=1", "warmup_steps=2"),
]
LOSS_KEYS = ("loss", "loss_predict", "loss_sparse", "loss_consistency")
# The reference run: 12 steps of `cross`, logging every step, validating and checkpointing every 4.
REFERENCE_STEPS = ["--steps", "12", *sets("log_every=1", "val_every=4", "checkpoint_every=4")]
# Runs compared across process counts: float32 (bf16 rounds differently per batch split), a checkpoint every 2 steps.
EXACT_STEPS = ["--steps", "8", *sets("log_every=1", "val_every=4", "checkpoint_every=2", "bf16=false")]


def train_args(images: Path, cache: Path | str | None, store: Path | str | None, run: Path, *extra: object) -> list:
    """`tcjepa train` arguments of a tiny run on `images` (with a cache and store unless they are None)."""
    data = [] if cache is None else ["--cache", cache, "--store", store]
    return ["train", images, *data, "--out", run, *TINY_TRAIN, *extra]


# --- the training step in one process (test_step, test_compile) -------------------------------------------------

STEP_TEXT_DIM = 16
STEP_GRID = (8, 8)
# A tiny model for steps on synthetic batches, float32 so that ways of computing the same update agree to rounding.
STEP_CONFIG = TrainConfig(
    model="vit_tiny",
    image_size=64,
    patch_size=8,
    depth=2,
    width=64,
    heads=2,
    predictor_width=32,
    predictor_depth=2,
    predictor_heads=2,
    captions_per_image=3,
    max_words=10,
    min_context=4,
    batch_size=8,
    bf16=False,
    grad_clip=1.0,
    cache="unused",
    store="unused",
)


def step_batch(step: int, cfg: TrainConfig = STEP_CONFIG) -> Any:
    """A synthetic batch of `cfg`'s shapes; 40% of its images without any caption, so that micro-batches differ in
    how many images the regularisers average."""
    from benchmarks.gpu_check import synthetic_batch

    return synthetic_batch(cfg, STEP_GRID, step, STEP_TEXT_DIM, missing=0.4)


def train_steps(cfg: TrainConfig, model: Any, target: Any, batches: list) -> list:
    """The loss parts of one optimizer step per batch, taken by the trainer's step on the CPU."""
    import torch

    from train.optim import make_optimizer
    from train.step import TrainStep, on_device

    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    step = TrainStep(model, model, target, optimizer, cfg, torch.device("cpu"))
    return [step(micro, 0.99) for _, micro in on_device(batches, torch.device("cpu"), cfg.accum_steps)]


def assert_same_models(a: Any, b: Any, rtol: float, atol: float) -> None:
    """Every entry of two models' state dicts agrees within `atol` plus `rtol` of that tensor's largest magnitude.

    Relative to the tensor, not to each element: AdamW divides by the root of the squared gradients, so an element
    whose gradient is near zero moves by up to the learning rate on float32 rounding noise alone."""
    import torch

    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        scale = float(y.abs().max()) if y.is_floating_point() and y.numel() else 0.0
        torch.testing.assert_close(x, y, rtol=0.0, atol=atol + rtol * scale, msg=name)


def metrics(run: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_close_runs(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics agree step by step: losses within float32 reduction-order noise, schedules exactly."""
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in (*LOSS_KEYS, "val_loss_predict"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), (x["step"], key)
        if "lr" in x:
            assert (x["lr"], x["wd"], x["ema"]) == (y["lr"], y["wd"], y["ema"])


# --- stores ------------------------------------------------------------------------------------------------------


def store_keys(store: Path) -> list[bytes]:
    """Every caption key of a local store, segment by segment."""
    from embedding_cache.store import EmbeddingStore

    opened = EmbeddingStore(store)
    return [k.tobytes() for segment in opened.segment_ids() for k in opened.read_keys(segment)]


def assert_same_embeddings(got: Path, want: Path) -> None:
    """Two local stores hold the same captions, each once, with vectors equal up to bfloat16 rounding (another batch
    composition changes the last bits)."""
    from embedding_cache.reader import EmbeddingReader

    keys = store_keys(got)
    assert len(keys) == len(set(keys)), "a caption is stored twice"
    assert set(keys) == set(store_keys(want)), "captions lost or added"
    a, b = EmbeddingReader(got), EmbeddingReader(want)
    for key in keys:
        np.testing.assert_allclose(
            a.get_key(key).astype(np.float32), b.get_key(key).astype(np.float32), atol=0.02, rtol=0.02
        )


# A store of made-up vectors: `numbered_caption(i)` is caption i (its key, `[length, TEST_WIDTH]` float16 vectors).
TEST_ENCODER = {"kind": "t5-encoder", "model": "fake", "max_length": 64}
TEST_WIDTH = 8


TEST_LAYOUT = TokenLayout(chunk_tokens=16, shard_chunks=4)  # 64-token shards: captions cross chunks and shards


def numbered_caption(i: int, length: int | None = None) -> tuple[bytes, np.ndarray]:
    from pipeline.core.recipes import text_key

    rng = np.random.default_rng(i)
    n = int(rng.integers(0, 40)) if length is None else length
    return text_key(f"caption {i}"), rng.standard_normal((n, TEST_WIDTH)).astype(np.float16)


def publish_captions(store: Any, ids: Any) -> Any:
    """Write `numbered_caption(i)` for each of `ids` into a new segment of `store` and publish it."""
    writer = store.new_segment(TEST_LAYOUT)
    for i in ids:
        writer.append(*numbered_caption(i))
    writer.finish()
    return store.publish(writer)


# --- images ------------------------------------------------------------------------------------------------------


def png(colour: Any, size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    """A PNG of one colour."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


def bad_image_catalogue() -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, expected failure reason prefix or None when it must decode)."""
    from PIL import Image

    rgb = png("green", (40, 30))
    jpeg = io.BytesIO()
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(jpeg, format="JPEG")
    palette = io.BytesIO()
    Image.new("P", (20, 20), 3).save(palette, format="PNG", transparency=3)
    sixteen = io.BytesIO()
    Image.fromarray(np.full((20, 20), 40000, dtype=np.uint16)).save(sixteen, format="PNG")
    bomb = io.BytesIO()
    Image.new("1", (10_000, 9_000)).save(bomb, format="PNG")
    return {
        "ok.png": (rgb, None),
        "truncated.png": (rgb[: len(rgb) // 2], "corrupt or truncated"),
        "zero.png": (b"", "empty file"),
        "pixel.png": (png("red", (1, 1)), "too small"),
        "bomb.png": (bomb.getvalue(), "decompression bomb"),
        "cmyk.jpg": (jpeg.getvalue(), None),
        "palette_alpha.png": (palette.getvalue(), None),
        "rgba.png": (png((255, 0, 0, 0), (20, 20), "RGBA"), None),
        "la.png": (png((128, 255), (20, 20), "LA"), None),
        "sixteen_bit.png": (sixteen.getvalue(), None),
        "png_named.jpg": (png("blue", (40, 30)), None),
        "text.png": (b"hello, I am not an image", "not an image"),
        "huge_but_decodable.png": (png("white", (3000, 2000)), None),
    }


# --- captioning with the tiny VLM --------------------------------------------------------------------------------

TINY_VLLM_ARGS = {"max_model_len": 1024}
CAPTION_MAX_TOKENS = 12
# `tcjepa caption` flags of the configuration `caption_config` makes.
VLLM_CLI = [
    "--vllm-arg",
    "max_model_len=1024",
    "--max-tokens",
    str(CAPTION_MAX_TOKENS),
    "--chunk-images",
    "4",
    "--decode-workers",
    "1",
]


def caption_config(images: list, cache: Path, tiny_models: Path, **kw: Any):
    """A `CaptionConfig` for the tiny VLM on vLLM (the settings of `VLLM_CLI`)."""
    from captioning.engines import SamplingConfig
    from captioning.job import CaptionConfig

    return CaptionConfig(
        inputs=images,
        cache=cache,
        model=str(tiny_models / "vlm"),
        engine_args=dict(TINY_VLLM_ARGS),
        sampling=SamplingConfig(max_tokens=CAPTION_MAX_TOKENS),
        chunk_images=4,
        decode_workers=1,
        **kw,
    )


def caption_rows(cache: Path, recipe: str | None = None) -> list[dict]:
    """Every caption row of a cache (of one recipe)."""
    from captioning.cache import CaptionCache

    return CaptionCache(cache).read_captions(recipes=None if recipe is None else [recipe]).to_pylist()


# --- session fixtures --------------------------------------------------------------------------------------------


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's common temporary directory: the base directory of the one process, or under pytest-xdist the
    controller's, which holds each worker's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, made by `build(directory)` once per test session and then only read.

    Under pytest-xdist every worker process would build its own copy of a session fixture; here the first worker to
    ask builds it in the session's common temporary directory (the workers' base directories' parent) while the
    others wait on its lock, and all of them use that one. A build that failed leaves no `.done` mark: the next
    worker to ask builds it again (and fails as loudly). Only for fixtures no test writes into.
    """
    from filelock import FileLock

    shared = session_root(tmp_path_factory) / "built-once"
    shared.mkdir(exist_ok=True)
    out, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


SYNTH_ARGS = ("--n-images", 40, "--seed", 3)  # the session's synthetic scenes


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "synth", lambda out: tcjepa("synth", "--out", out, *SYNTH_ARGS))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """`DIR/t5` (random tiny T5) and `DIR/vlm` (random tiny Qwen2-VL), built through the CLI."""
    return built_once(tmp_path_factory, "tiny", lambda out: tcjepa("tiny-models", "--out", out))


def another_t5(tiny_models: Path, out: Path) -> Path:
    """A copy of the session's tiny T5 with one weight changed: another encoder to every recipe, for the price of a
    file copy (building one with `tcjepa tiny-models --seed 1` costs ~10 CPU-seconds)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(tiny_models / "t5", out)
    weights = load_file(out / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + np.ones((), weights[first].dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def annotated_cache(tmp_path_factory, synth_dir) -> Path:
    annotations = synth_dir / "captions.jsonl"
    out = built_once(
        tmp_path_factory, "cache", lambda out: tcjepa("caption", "--cache", out / "cache", "--annotations", annotations)
    )
    return out / "cache"


# The embedding settings of `annotated_store`: small chunks and shards, so captions cross both.
SMALL_STORE = ["--chunk-tokens", "64", "--shard-chunks", "4", "--window", "64", "--no-progress"]


@pytest.fixture(scope="session")
def annotated_store(tmp_path_factory, annotated_cache, tiny_models) -> Path:
    """Embeddings (random tiny T5) of every caption of `annotated_cache`, in small chunks and shards."""

    def build(out: Path) -> None:
        done = tcjepa(
            "embed", "--cache", annotated_cache, "--store", out / "store", "--model", tiny_models / "t5", *SMALL_STORE
        )
        (out / "embed.stdout").write_text(done.stdout)  # what the command said, for test_embed

    return built_once(tmp_path_factory, "store", build) / "store"


VECTOR_WIDTH = 16


def caption_vector(key: bytes, text: str) -> np.ndarray:
    """A stand-in caption embedding, a function of the caption: one row per word and one for EOS."""
    rng = np.random.default_rng(list(key[:8]))
    return rng.standard_normal((len(text.split()) + 1, VECTOR_WIDTH)).astype(np.float16)


@pytest.fixture(scope="session")
def vector_store(tmp_path_factory, annotated_cache) -> Path:
    """A store of `caption_vector`s for every caption of `annotated_cache`, in two segments, written through the
    store's Python API: for tests of what reads a store, without a text encoder."""
    from captioning.cache import CaptionCache
    from embedding_cache.store import EmbeddingStore, TokenLayout

    path = tmp_path_factory.mktemp("vectors") / "store"
    store = EmbeddingStore.open_or_create(path, {"kind": "test-vectors", "width": VECTOR_WIDTH}, VECTOR_WIDTH)
    rows = CaptionCache(annotated_cache).read_captions(columns=["text_sha256", "text"]).to_pylist()
    texts = {bytes.fromhex(r["text_sha256"]): r["text"] for r in rows}
    keys = sorted(texts)
    for part in (keys[: len(keys) // 2], keys[len(keys) // 2 :]):
        writer = store.new_segment(TokenLayout(chunk_tokens=64, shard_chunks=4))
        for key in part:
            writer.append(key, caption_vector(key, texts[key]))
        writer.finish()
        store.publish(writer)
    return path


TRAINED_T5_STEPS = 600
# The tests that use `trained_t5`, by id. Its build takes minutes; under pytest-xdist the controller, which sees test
# ids only, starts it for them as soon as a worker has collected one (a user missing here is refused at collection).
TRAINED_T5_USERS = ("tests/test_tiny_models.py::test_trained_t5_ties_colours_to_positions",)
_trained_t5_build: subprocess.Popen | None = None  # in the process of this session that started it


def _start_trained_t5(root: Path) -> None:
    """Start building `trained_t5` in ROOT/trained-t5 (the session's synth captions, then a T5 trained on them),
    unless a process of this session already has; the build writes `rc`, its exit status, when it ends.

    The build trains the tiny T5 for minutes on one thread (it pins torch to one thread, for bit-identical weights).
    Started when collection ends, it runs beside the tests and is done, or nearly, when its test comes."""
    global _trained_t5_build
    out = root / "trained-t5"
    try:
        out.mkdir()
    except FileExistsError:
        return
    corpus = ("--t5-corpus", out / "synth" / "captions.jsonl", "--t5-steps", TRAINED_T5_STEPS)
    steps = [cli("synth", "--out", out / "synth", *SYNTH_ARGS), cli("tiny-models", "--out", out / "models", *corpus)]
    stdout, stderr, part, rc = (shlex.quote(str(out / name)) for name in ("stdout", "stderr", "rc.part", "rc"))
    script = " && ".join(shlex.join(step) for step in steps)
    command = ["sh", "-c", f"({script}) > {stdout} 2> {stderr}; echo $? > {part} && mv {part} {rc}"]
    _trained_t5_build = start(command, quiet=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """The xdist controller: start `trained_t5`'s build once a worker has collected a test that uses it."""
    grouped = {f"{test}@{XDIST_GROUPS['trained_t5']}" for test in TRAINED_T5_USERS}  # --dist loadgroup's ids
    if set(ids) & (grouped | set(TRAINED_T5_USERS)):
        _start_trained_t5(session_root(node.config._tmp_path_factory))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without xdist: start `trained_t5`'s build once a selected test uses it (and is to run)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    if any("trained_t5" in i.fixturenames for i in session.items):
        _start_trained_t5(session_root(session.config._tmp_path_factory))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """End `trained_t5`'s build if this process started it and it still runs (a session cut short)."""
    if _trained_t5_build is not None and _trained_t5_build.poll() is None:
        kill_tree(_trained_t5_build)


@pytest.fixture(scope="session")
def trained_t5(tmp_path_factory) -> tuple[Path, dict]:
    """`tcjepa tiny-models --t5-corpus` (synth's captions, TRAINED_T5_STEPS steps): (its directory, the JSON it
    printed). Waits for the build the session started (or starts it)."""
    out = session_root(tmp_path_factory) / "trained-t5"
    _start_trained_t5(out.parent)
    deadline = time.monotonic() + 1200
    while not (out / "rc").exists():
        assert time.monotonic() < deadline, "the trained tiny T5 is still building after 20 minutes"
        time.sleep(0.5)
    assert (out / "rc").read_text().strip() == "0", (out / "stderr").read_text()[-3000:]
    return out / "models", json.loads((out / "stdout").read_text().strip().splitlines()[-1])


@pytest.fixture(scope="session")
def vllm_engine(tiny_models):
    """One vLLM engine (CPU build) on the tiny Qwen2-VL for the whole session: a start costs ~20 s."""
    from captioning.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_models / "vlm"), dict(TINY_VLLM_ARGS))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, synth_dir, annotated_cache, annotated_store) -> Path:
    """A finished run of `cross` (`REFERENCE_STEPS`), shared read-only: tests that write into a run copy it first
    (evaluation's feature cache and reports excepted: they are what `tcjepa eval` adds to a run)."""
    run = tmp_path_factory.mktemp("runs") / "reference"
    tcjepa(*train_args(synth_dir / "images", annotated_cache, annotated_store, run, *REFERENCE_STEPS))
    return run


@pytest.fixture(scope="session")
def exact_run(tmp_path_factory, synth_dir, annotated_cache, annotated_store) -> Path:
    """`EXACT_STEPS` on one process: what runs on two processes (DDP, FSDP, a resumed one) must match."""
    args = (synth_dir / "images", annotated_cache, annotated_store)
    return (
        built_once(tmp_path_factory, "exact", lambda out: tcjepa(*train_args(*args, out / "run", *EXACT_STEPS))) / "run"
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto) on loopback for the session: the AWS environment variables that reach it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    server.stop()


def s3_bucket(server: dict[str, str], name: str) -> Any:
    """An s3fs file system on the session's S3 server (`s3_server`), with the bucket `name` made."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=server["AWS_ACCESS_KEY_ID"],
        secret=server["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=server["AWS_ENDPOINT_URL"],
        skip_instance_cache=True,
    )
    fs.mkdir(name)
    return fs


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """The session's S3 server reachable from this test's process; returns the environment for its subprocesses."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return {**os.environ}
