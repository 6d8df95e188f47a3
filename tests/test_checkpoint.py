"""Checkpoints (`train.checkpoint`): saved whole or not at all, a killed save's leftovers removed, a damaged file
refused in one line. The disk fills for real: the soft file-size limit of this process is lowered for one save."""

from __future__ import annotations

import resource
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pipeline.core.errors import UserError
from train.checkpoint import CHECKPOINT, HISTORY, kept_steps, load_checkpoint, save_checkpoint, save_encoders


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 64), float(step))}, "step": step, "config": {"lr": 0.1}}


@contextmanager
def _file_size_limit(max_bytes: int) -> Iterator[None]:
    """Writes past `max_bytes` fail with EFBIG (as on a full disk) in this process, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_checkpoint_round_trips_and_a_run_without_one_has_none(tmp_path):
    assert load_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, _state(3))
    loaded = load_checkpoint(tmp_path)
    assert (
        loaded["step"] == 3
        and loaded["config"] == {"lr": 0.1}
        and torch.equal(loaded["model"]["w"], _state(3)["model"]["w"])
    )


def test_a_save_that_fills_the_disk_raises_the_os_error_and_keeps_the_last_checkpoint(tmp_path):
    save_checkpoint(tmp_path, _state(1))
    before = (tmp_path / CHECKPOINT).read_bytes()
    with _file_size_limit(4096), pytest.raises(OSError, match="File too large"):
        save_checkpoint(tmp_path, _state(2))
    assert (tmp_path / CHECKPOINT).read_bytes() == before, "the previous checkpoint is intact"
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT, HISTORY], "no half-written temporary is left"
    assert [p.name for p in (tmp_path / HISTORY).iterdir()] == ["step-00000001.pt"]


def test_a_killed_saves_temporary_is_removed_by_the_next_save(tmp_path):
    stale = tmp_path / f".{CHECKPOINT}.999999999.tmp"
    stale.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, _state(4))
    assert not stale.exists() and load_checkpoint(tmp_path)["step"] == 4


def test_a_damaged_checkpoint_is_refused_in_one_line(tmp_path):
    save_checkpoint(tmp_path, _state(5))
    data = (tmp_path / CHECKPOINT).read_bytes()
    (tmp_path / CHECKPOINT).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="cannot be read .*move it away to start over") as caught:
        load_checkpoint(tmp_path)
    assert "\n" not in str(caught.value)


def test_the_newest_checkpoints_and_every_nth_are_kept(tmp_path):
    assert kept_steps(list(range(1, 11)), keep=2, every_keep=4) == {4, 8, 9, 10}
    assert kept_steps([5, 10], keep=1, every_keep=0) == {10}
    for step in range(1, 8):
        save_encoders(tmp_path, {"target_encoder": {"w": torch.full((2,), float(step))}}, step, {"lr": 0.1})
        save_checkpoint(tmp_path, _state(step), keep=2, every_keep=3)
    kept = sorted(p.name for p in (tmp_path / HISTORY).iterdir())
    assert kept == [f"step-{s:08d}.{kind}" for s in (3, 6, 7) for kind in ("pt", "target_encoder.safetensors")]
    assert (tmp_path / CHECKPOINT).samefile(tmp_path / HISTORY / "step-00000007.pt"), "the newest costs no space"
    assert torch.load(tmp_path / HISTORY / "step-00000003.pt", weights_only=True)["step"] == 3
    assert load_checkpoint(tmp_path)["step"] == 7


def test_encoders_are_safetensors_with_their_step(tmp_path):
    from safetensors import safe_open

    save_encoders(
        tmp_path, {"target_encoder": {"w": torch.arange(3.0)}, "context_encoder": {"w": torch.ones(3)}}, 9, {}
    )
    with safe_open(str(tmp_path / "target_encoder.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "9" and torch.equal(f.get_tensor("w"), torch.arange(3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoints",
        "context_encoder.safetensors",
        "target_encoder.safetensors",
    ]


class _Model(torch.nn.Module):
    """An encoder and a predictor, as the trainer's model holds them (the encoders go to safetensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 4)
        self.predictor = torch.nn.Linear(4, 4)


def test_a_sharded_checkpoint_is_written_in_the_background_and_published_once_written(tmp_path):
    """Under FSDP the shards are written by a thread while training goes on: nothing points at them until `wait`
    (the next save, the end of the run) finds them written, and what they hold is the state at the save, not the
    parameters changed after it. One process in a gloo group of its own, as a rank of a run is."""
    import torch.distributed as dist

    from train.checkpoint import (
        Checkpointer,
        _read_sharded,
        kept_encoder_steps,
        load_kept_encoders,
        sharded_checkpoint,
    )

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        run = tmp_path / "run"
        run.mkdir()
        model, target = _Model(), torch.nn.Linear(4, 4)
        saver = Checkpointer(run, model, target, torch.optim.AdamW(model.parameters()), main=True)

        def resumed_weight() -> torch.Tensor:
            fresh = _Model()
            reader = Checkpointer(run, fresh, torch.nn.Linear(4, 4), torch.optim.AdamW(fresh.parameters()), True)
            reader.resume()
            return fresh.encoder.weight.detach()

        saved = model.encoder.weight.detach().clone()
        saver.save(1, {"lr": 0.1}, sharded=True, keep=2, every_keep=0)
        assert saver._pending is not None and saver._pending.written is not None, "a background write's future"
        with torch.no_grad():
            model.encoder.weight.add_(1.0)  # the step after the save, while its shards may still be written
        assert sharded_checkpoint(run) is None, "not published before it is known to be written"
        saver._pending.written.result()
        saver.publish_if_written()  # where the loop logs: rank 0 publishes what is written, without waiting
        assert sharded_checkpoint(run) == (run / "sharded_checkpoint" / "step-00000001", 1)
        saver.wait()
        torch.testing.assert_close(resumed_weight(), saved)
        saver.save(2, {"lr": 0.1}, sharded=True, keep=2, every_keep=0)
        assert not (run / "target_encoder.safetensors").exists(), "no save but the last gathers the encoders"
        assert not any((run / "checkpoints").glob("*")), "no save but the last gathers the encoders"
        saver.save(3, {"lr": 0.1}, sharded=True, keep=2, every_keep=0, last=True)  # publishes step 2 first
        assert sharded_checkpoint(run)[1] == 2
        saver.wait()
        assert sharded_checkpoint(run)[1] == 3
        assert sorted(p.name for p in (run / "sharded_checkpoint").glob("step-*")) == ["step-00000002", "step-00000003"]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            "step-00000003.context_encoder.safetensors",
            "step-00000003.target_encoder.safetensors",
        ]
        torch.testing.assert_close(resumed_weight(), saved + 1.0)
        # The kept steps' encoders, read from the shards where no safetensors were written, else from those.
        assert kept_encoder_steps(run) == [2, 3]
        for step in (2, 3):
            encoders = load_kept_encoders(run, step)
            torch.testing.assert_close(encoders["context_encoder"]["weight"], saved + 1.0)
            torch.testing.assert_close(encoders["target_encoder"]["weight"], target.weight.detach())
            assert set(encoders["context_encoder"]) == {"weight", "bias"}, "the predictor is not the context encoder"
        read = _read_sharded(run / "sharded_checkpoint" / "step-00000002", ("model.encoder.", "target."))
        assert {k: set(v) for k, v in read.items()} == {
            "model": {"encoder.weight", "encoder.bias"},
            "target": {"weight", "bias"},
        }
        with pytest.raises(UserError, match="no tensor named model.head."):
            _read_sharded(run / "sharded_checkpoint" / "step-00000002", ("model.head.",))
        assert load_kept_encoders(run, 1) is None, "pruned"
        # A step whose shards are not all written yet (DCP writes its index, `.metadata`, after every rank's) is not
        # kept, and a step left by a killed run loses its index before its shards when saved again.
        partial = run / "sharded_checkpoint" / "step-00000009"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"shards being written")
        assert kept_encoder_steps(run) == [2, 3] and load_kept_encoders(run, 9) is None
        shutil.copytree(run / "sharded_checkpoint" / "step-00000003", partial, dirs_exist_ok=True)
        assert kept_encoder_steps(run) == [2, 3, 9]
    finally:
        dist.destroy_process_group()
