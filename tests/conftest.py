"""Session-wide fixtures and the suite's hooks.

Tiny models, synthetic data, a caption cache, an embedding store, trained runs and an S3 server are built once per
test session. The hooks mark tests with the tiers of the fixtures they use, keep the tests that share a costly thing
in one pytest-xdist worker, order the tiers, and start the trained tiny T5's build beside the tests. What tests share
besides fixtures (running the CLI, tiny training runs, stores, images, ...) lives in `tests/support`.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process, here and in every process a test starts: on 2 cores that other processes (or other
# work on the machine) share, OpenMP's waiting threads made tiny models up to ~10x slower than one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What the commands say is checked as a user sees it by default: at INFO, rank 0's.
os.environ.pop("TCJEPA_LOG_LEVEL", None)
# The processes the session starts (workers, commands, torchrun, Ray, vLLM's engine) see a user's install:
# tests/support/user_site/sitecustomize.py hides the tests' own reference packages. The pytest processes keep them.
USER_SITE = str(Path(__file__).parent / "support" / "user_site")
if USER_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [USER_SITE, os.environ.get("PYTHONPATH")]))
if "sklearn" in sys.modules and sys.modules["sklearn"] is None:  # a pytest-xdist worker, started with it hidden
    del sys.modules["sklearn"]

# The helpers' asserts explain their failures as a test's do: pytest rewrites tests/support when it imports it (below,
# after this line, and in the test modules).
pytest.register_assert_rewrite("tests.support")

from pipeline.devkit.tiny_models import T5_STEPS  # noqa: E402
from tests.support.builds import SYNTH_ARGS, built_once, session_root  # noqa: E402
from tests.support.captions import TINY_VLLM_ARGS  # noqa: E402
from tests.support.commands import cli, tcjepa  # noqa: E402
from tests.support.object_servers import SCHEMES, azurite, bucket_on  # noqa: E402
from tests.support.processes import kill_tree, start  # noqa: E402
from tests.support.stores import SMALL_STORE, VECTOR_WIDTH, caption_vector  # noqa: E402
from tests.support.training import EXACT_STEPS, REFERENCE_STEPS, train_args  # noqa: E402

# --- tiers -------------------------------------------------------------------------------------------------------

# Session fixtures that start a marked thing, or cost the unit tier too much (the tiny models and what is made with
# them: ~30 s on 2 cores): a test that uses one carries its marker, whether or not it says so itself.
FIXTURE_MARKERS = {
    "vllm_engine": "vllm",
    "s3_server": "s3",
    "azure_server": "s3",
    "object_server": "s3",
    "object_bucket": "s3",
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
    items.sort(key=lambda item: (_turn(item), "vllm_engine" not in item.fixturenames))  # the engine's users in a row


TIER_MARKERS = ("slow", "vllm", "ray", "distributed", "s3")


def _turn(item: pytest.Item) -> int:
    """When a test runs: the costly tiers first and the unit tier after them, so that pytest-xdist, which hands tests
    out in this order, ends a run on short tests that keep both workers busy to the end rather than on a long one
    beside an idle core; the trained T5's users last, when the build collection started is done."""
    if "trained_t5" in item.fixturenames:
        return 2
    return 0 if any(item.get_closest_marker(m) for m in TIER_MARKERS) else 1


# --- session fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def cli_logging() -> None:
    """The CLI's logging set-up (`pipeline.core.logs.configure`) in this process: a test that calls a library
    function reads what it says on stderr (capsys, capfd), line for line as the CLI shows it."""
    from pipeline.core import logs

    logs.configure()


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "synth", lambda out: tcjepa("synth", "--out", out, *SYNTH_ARGS))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """`DIR/t5` (random tiny T5) and `DIR/vlm` (random tiny Qwen2-VL), built through the CLI."""
    return built_once(tmp_path_factory, "tiny", lambda out: tcjepa("tiny-models", "--out", out))


@pytest.fixture(scope="session")
def annotated_cache(tmp_path_factory, synth_dir) -> Path:
    annotations = synth_dir / "captions.jsonl"
    out = built_once(
        tmp_path_factory, "cache", lambda out: tcjepa("caption", "--cache", out / "cache", "--annotations", annotations)
    )
    return out / "cache"


@pytest.fixture(scope="session")
def annotated_store(tmp_path_factory, annotated_cache, tiny_models) -> Path:
    """Embeddings (random tiny T5) of every caption of `annotated_cache`, in small chunks and shards."""

    def build(out: Path) -> None:
        done = tcjepa(
            "embed", "--cache", annotated_cache, "--store", out / "store", "--model", tiny_models / "t5", *SMALL_STORE
        )
        (out / "embed.stdout").write_text(done.stdout)  # what the command said, for test_embed

    return built_once(tmp_path_factory, "store", build) / "store"


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


TRAINED_T5_STEPS = T5_STEPS  # the default: what `tiny-models` and the demo train
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
    """Without xdist: start `trained_t5`'s build once a selected test uses it (and is to run). In every process: the
    heap the collection made (the test modules' imports) leaves the collector's reach, as after each test
    (`pytest_runtest_logfinish`)."""
    gc.collect()
    gc.freeze()
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


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """After each test: collect its garbage, then freeze what is left (the modules imported so far, session fixtures,
    pytest's reports) out of the cyclic collector's reach. A worker's heap grows to millions of objects as tests import
    torch, transformers, vLLM, Ray and moto, and each full collection walked all of it: ~12% of the workers' CPU in
    the unit tier (counted by `gc.callbacks`). `make test-fast`, one run beside the other: 144 against 125
    core-seconds, 121 against 109-112. A collection now walks only what the running test made. Only what outlives a
    test is frozen, and refcounting still frees it; a cycle that such an object later joins stays until the worker
    ends."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After pytest's own teardown of a test: end the session's vLLM engine if the next test of this process does not
    use it. Its idle worker polls (~5% of a core), and its tests run first and together (one xdist group, handed out
    in one piece; one run of `_turn` without xdist), so it would otherwise idle through the rest of the session. A
    later user starts it again. pytest has no public call that ends a session fixture early: `FixtureDef.finish` is
    what pytest runs at the session's end."""
    try:
        return (yield)
    finally:
        if "vllm_engine" in item.fixturenames and (nextitem is None or "vllm_engine" not in nextitem.fixturenames):
            for fixturedef in item._fixtureinfo.name2fixturedefs["vllm_engine"]:
                fixturedef.finish(item._request)  # type: ignore[arg-type]  # finish reads only the request's node


@pytest.fixture(scope="session")
def vllm_engine(tiny_models):
    """One vLLM engine (CPU build) on the tiny Qwen2-VL for the tests that share it (a start costs ~20 s), ended
    when the last of them in a row is done (`pytest_runtest_teardown`)."""
    from captioning.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(tiny_models / "vlm"), dict(TINY_VLLM_ARGS))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, synth_dir, annotated_cache, annotated_store) -> Path:
    """A finished run of `cross` (`REFERENCE_STEPS`), shared read-only: tests that write into a run copy it first
    (evaluation's feature cache and reports excepted: they are what `tcjepa eval` adds to a run)."""
    run = tmp_path_factory.mktemp("runs") / "reference"
    # fresh: the runs compared with it byte for byte are forked (tests.support.forked_commands: one hash seed)
    tcjepa(*train_args(synth_dir / "images", annotated_cache, annotated_store, run, *REFERENCE_STEPS), fresh=True)
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


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """The session's S3 server reachable from this test's process; returns the environment for its subprocesses."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return {**os.environ}


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Azure Blob storage (Azurite) on loopback for the session: the environment variables that reach it."""
    if shutil.which("node") is None:
        # Azurite is a Node.js program, and Node.js is no Python dependency: a machine without it cannot run Azure's
        # tests at all. With Node.js here, a missing Azurite is a broken install and fails (`azurite` says so).
        pytest.skip("no Node.js here: Azurite, the Azure Blob emulator, cannot run")
    with azurite(tmp_path_factory.mktemp("azurite")) as env:
        yield env


@pytest.fixture(params=SCHEMES)
def object_server(request, monkeypatch) -> tuple[str, dict[str, str], dict[str, str]]:
    """Each object storage back-end in turn (s3: moto, az: Azurite), reachable from this test's process: its scheme,
    its server's variables (for `bucket_on`) and the environment for the test's subprocesses."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "azure_server")
    for key, value in server.items():
        monkeypatch.setenv(key, value)
    return request.param, server, {**os.environ}


@pytest.fixture
def object_bucket(object_server) -> tuple[Any, str, str, dict[str, str]]:
    """A bucket (Azure: container) of its own on each back-end in turn: (fsspec file system, URL prefix
    `scheme://name`, name, the environment of subprocesses that reach it)."""
    scheme, server, env = object_server
    name = f"t-{uuid.uuid4().hex[:12]}"
    return bucket_on(server, scheme, name), f"{scheme}://{name}", name, env
