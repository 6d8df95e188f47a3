"""Checkpoints: written atomically, loaded with `weights_only=True`, never silently skipped.

Two formats, one per run:
- `checkpoint.pt` (one process, DDP): plain full state dicts, the step and the resolved config, written by rank 0,
  also named `checkpoints/step-N.pt` (hard links: no extra space), of which the newest `checkpoint_keep` and every
  `checkpoint_every_keep`-th are kept;
- `sharded_checkpoint/` (FSDP): each process writes its own shards with `torch.distributed.checkpoint` (DCP), so a
  1 B-parameter model and its optimizer state are never gathered on one rank; `latest.json` names the newest
  complete one (with its step and config) and is written only after every shard is. DCP reshards on load, so such
  a run resumes on any number of processes.

The two encoders also go to `target_encoder.safetensors` and `context_encoder.safetensors` beside them (and
`checkpoints/step-N.NAME.safetensors`), readable without torch: at every checkpoint of a whole-state run, and at the
end of a sharded one only, for they must be gathered to rank 0 to be written. Under FSDP the kept steps' encoders
are read from their shards (`kept_encoder_steps`, `load_kept_encoders`), so no checkpoint but the last gathers
anything (a sharded run stopped before its end has no such files until it ends).

`load_checkpoint` gives full state dicts whatever the format (evaluation reads runs through it). A checkpoint that
exists but cannot be read stops the run with a clear message (the reference code swallowed such errors and
restarted from step 0).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes, fsync_dir

CHECKPOINT = "checkpoint.pt"
SHARDED = "sharded_checkpoint"
LATEST = "latest.json"
HISTORY = "checkpoints"  # step-N.pt (and step-N.NAME.safetensors): the checkpoints kept
ENCODERS = ("target_encoder", "context_encoder")
ENCODER_SUFFIX = ".safetensors"
ENCODER_FORMAT = "tcjepa-encoder-state"
CONTEXT_PREFIX = "encoder."  # the context encoder's names inside the JEPA model's state dict
DCP_METADATA = ".metadata"  # DCP's file system writer names its index so, and writes it last


class _WriteErrorKeeper:
    """Passes writes to a file and keeps the OSError (e.g. disk full) that torch.save reports as a bare RuntimeError."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _link_or_copy(source: Path, link: Path) -> None:
    """`link` names `source`'s bytes: a hard link (no space), or a copy where the file system has none."""
    link.unlink(missing_ok=True)  # left by a run killed after linking this very step
    try:
        os.link(source, link)
    except OSError:
        shutil.copyfile(source, link)


def _history_step(path: Path) -> int | None:
    match = re.fullmatch(r"step-(\d+)(\..*)?", path.name)
    return int(match.group(1)) if match else None


def kept_steps(steps: list[int], keep: int, every_keep: int) -> set[int]:
    """The checkpoints to keep: the newest `keep`, and every step that is a multiple of `every_keep` (when > 0)."""
    newest = sorted(steps)[-keep:] if keep > 0 else []
    return set(newest) | {s for s in steps if every_keep > 0 and s % every_keep == 0}


def prune_history(directory: Path, keep: int, every_keep: int) -> None:
    """Remove the files (or directories) `step-N*` of `directory` whose step `kept_steps` does not keep."""
    if not directory.is_dir():
        return
    entries = [(p, _history_step(p)) for p in directory.iterdir()]
    steps = [step for _, step in entries if step is not None]
    kept = kept_steps(sorted(set(steps)), keep, every_keep)
    for path, step in entries:
        if step is not None and step not in kept:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def save_checkpoint(run: Path, state: dict[str, Any], keep: int = 2, every_keep: int = 0) -> Path:
    """Write `run/checkpoint.pt` via a temporary file, fsync and rename: a crash leaves the previous one intact.

    The same bytes are also named `checkpoints/step-N.pt` (a hard link); the newest `keep` of those, and every
    `every_keep`-th step, are kept, the others removed.
    """
    final = run / CHECKPOINT
    tmp = run / f".{CHECKPOINT}.{os.getpid()}.tmp"
    for stale in run.glob(f".{CHECKPOINT}.*.tmp"):  # left by a run killed while saving
        stale.unlink(missing_ok=True)
    history = run / HISTORY
    try:
        with open(tmp, "wb") as f:
            writer = _WriteErrorKeeper(f)
            try:
                torch.save(state, cast("IO[bytes]", writer))  # torch.save only writes and flushes
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        history.mkdir(exist_ok=True)
        _link_or_copy(tmp, history / f"step-{int(state['step']):08d}.pt")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(run)
    prune_history(history, keep, every_keep)
    return final


def save_encoders(run: Path, encoders: dict[str, dict[str, torch.Tensor]], step: int, config: dict[str, Any]) -> None:
    """Each encoder's state dict (`target_encoder`, `context_encoder`) as `run/NAME.safetensors`, for tools that
    read weights without torch.load, and under `checkpoints/step-N.NAME.safetensors` (pruned with the checkpoints).

    The step and the run's config go in the files' metadata. Written before `checkpoint.pt`, so a checkpoint's
    encoders are there whenever it is.
    """
    from safetensors.torch import save_file

    history = run / HISTORY
    history.mkdir(exist_ok=True)
    metadata = {"format": ENCODER_FORMAT, "step": str(step), "config": json.dumps(config)}
    for name, state in encoders.items():
        tmp = run / f".{name}{ENCODER_SUFFIX}.tmp"
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
            _link_or_copy(tmp, history / f"step-{step:08d}.{name}{ENCODER_SUFFIX}")
            os.replace(tmp, run / f"{name}{ENCODER_SUFFIX}")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(run)


def _damaged(path: Path, exc: Exception) -> UserError:
    return UserError(
        f"{path} cannot be read ({str(exc).splitlines()[0][:120]}); move it away to start over, or restore a good copy"
    )


def load_full_checkpoint(run: Path) -> dict[str, Any] | None:
    """The run's `checkpoint.pt` (memory-mapped on CPU: only the tensors used are read), or None without one."""
    path = run / CHECKPOINT
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise _damaged(path, exc) from None


def _latest_sharded(run: Path) -> dict[str, Any] | None:
    """`latest.json` of the run's sharded checkpoints ({"step", "dir", "config"}), or None when there is none."""
    path = run / SHARDED / LATEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise _damaged(path, exc) from None


def sharded_steps(run: Path) -> list[int]:
    """The steps of the run's complete sharded checkpoints, published or not yet: `sharded_checkpoint/step-N/` with
    DCP's `.metadata`, which is written after every rank's shards."""
    steps = (_history_step(path) for path in (run / SHARDED).glob("step-*") if (path / DCP_METADATA).is_file())
    return sorted(step for step in steps if step is not None)


def kept_encoder_steps(run: Path) -> list[int]:
    """The steps whose two encoders the run kept: as safetensors (`checkpoints/step-N.NAME.safetensors`), or in a
    complete sharded checkpoint."""
    found: dict[int, set[str]] = {}
    for path in (run / HISTORY).glob(f"step-*{ENCODER_SUFFIX}"):
        step, _, name = path.name.removesuffix(ENCODER_SUFFIX).partition(".")
        if step.removeprefix("step-").isdigit():
            found.setdefault(int(step.removeprefix("step-")), set()).add(name)
    saved = {step for step, names in found.items() if set(ENCODERS) <= names}
    return sorted(saved | set(sharded_steps(run)))


def load_kept_encoders(run: Path, step: int) -> dict[str, dict[str, torch.Tensor]] | None:
    """The two encoders the run kept at `step` (`target_encoder`, `context_encoder`: state dicts on CPU), from their
    safetensors or else their shards; None when it kept neither."""
    files = {name: run / HISTORY / f"step-{step:08d}.{name}{ENCODER_SUFFIX}" for name in ENCODERS}
    if all(path.is_file() for path in files.values()):
        from safetensors.torch import load_file

        return {name: load_file(str(path)) for name, path in files.items()}
    directory = run / SHARDED / f"step-{step:08d}"
    if step not in sharded_steps(run):
        return None
    try:
        state = _read_sharded(directory, (f"model.{CONTEXT_PREFIX}", "target."))
    except UserError:
        if step not in sharded_steps(run):  # DCP reads shard after shard: a trainer may prune the step meanwhile
            raise UserError(
                f"{directory} was pruned by the run's trainer while it was read; it is no longer kept"
            ) from None
        raise
    context = {k.removeprefix(CONTEXT_PREFIX): v for k, v in state["model"].items() if k.startswith(CONTEXT_PREFIX)}
    return {"target_encoder": state["target"], "context_encoder": context}


def sharded_checkpoint(run: Path) -> tuple[Path, int] | None:
    """(directory, step) of the run's newest complete sharded checkpoint, or None."""
    latest = _latest_sharded(run)
    return None if latest is None else (run / SHARDED / latest["dir"], int(latest["step"]))


def checkpoint_step(run: Path) -> int | None:
    """The step of the run's checkpoint (either format), or None when it has none yet."""
    steps = []
    full = load_full_checkpoint(run)
    if full is not None:
        steps.append(int(full["step"]))
    sharded = sharded_checkpoint(run)
    if sharded is not None:
        steps.append(sharded[1])
    return max(steps) if steps else None


def has_checkpoint(run: Path) -> bool:
    return (run / CHECKPOINT).exists() or (run / SHARDED / LATEST).exists()


@contextmanager
def _one_process_meant() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group is up: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


@dataclass
class ShardedSave:
    """A sharded checkpoint being written: `publish` waits for its shards (a background write's future, or none) and
    then, on rank 0, points `latest.json` at it and prunes the history."""

    root: Path
    name: str
    step: int
    config: dict[str, Any]
    keep: int
    every_keep: int
    written: Future | None = None

    def publish(self, main: bool) -> None:
        if self.written is not None:
            self.written.result()  # rank 0's future ends after DCP's metadata, which every rank's shards precede
        if main:
            atomic_write_bytes(
                self.root / LATEST, json.dumps({"step": self.step, "dir": self.name, "config": self.config}).encode()
            )
            prune_history(self.root, self.keep, self.every_keep)
            prune_history(self.root.parent / HISTORY, self.keep, self.every_keep)  # the encoders' safetensors


def start_sharded_checkpoint(
    run: Path,
    state: dict[str, Any],
    step: int,
    config: dict[str, Any],
    keep: int = 2,
    every_keep: int = 0,
    group: dist.ProcessGroup | None = None,
) -> ShardedSave:
    """Every process writes its shards of `state` (DTensor or plain state dicts) to `sharded_checkpoint/step-N/`: in
    a background thread when `group` (a gloo group of all ranks, for DCP's collectives off the training thread) is
    given, once the state is copied to host memory; else before returning. A collective: every rank calls it.
    Nothing points at the new checkpoint until its `publish`, so a run killed before leaves `latest.json` on the
    previous, complete one."""
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    root = run / SHARDED
    name = f"step-{step:08d}"
    target = root / name
    if main:
        # Left by a run killed while saving this very step, or before publishing it: its index goes first, so that no
        # reader counts it complete (`sharded_steps`) while its shards are removed.
        (target / DCP_METADATA).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    if distributed:
        dist.barrier()
    pending = ShardedSave(root, name, step, config, keep, every_keep)
    with _one_process_meant():
        if group is not None:
            written = dcp.async_save(state, checkpoint_id=target, process_group=group)  # a group: distributed
            pending.written = cast(Future, written)
        else:
            dcp.save(state, checkpoint_id=target, no_dist=not distributed)
    return pending


def save_sharded_checkpoint(
    run: Path, state: dict[str, Any], step: int, config: dict[str, Any], keep: int = 2, every_keep: int = 0
) -> Path:
    """`start_sharded_checkpoint` written in the foreground, then published: every rank's shards, then `latest.json`
    (rank 0) and the history pruned. A collective."""
    pending = start_sharded_checkpoint(run, state, step, config, keep, every_keep)
    pending.publish(not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0)
    return pending.root / pending.name


def load_sharded_into(run: Path, state: dict[str, Any]) -> int:
    """Fill `state` (this process's DTensor or plain state dicts, as `get_state_dict` gives) in place from the run's
    newest sharded checkpoint, whatever the number of processes that wrote it; returns its step."""
    import torch.distributed.checkpoint as dcp

    found = sharded_checkpoint(run)
    if found is None:
        raise UserError(f"{run} has no sharded checkpoint to resume from")
    directory, step = found
    try:
        with _one_process_meant():
            dcp.load(state, checkpoint_id=directory, no_dist=not (dist.is_available() and dist.is_initialized()))
    except Exception as exc:
        raise _damaged(directory, exc) from None
    return step


def _read_sharded(directory: Path, prefixes: tuple[str, ...] = ("model.", "target.")) -> dict[str, Any]:
    """The tensors of the sharded checkpoint in `directory` whose flat names (`model.encoder.…`) start with one of
    `prefixes`, whole, in this process (on CPU), nested as saved: {"model": {...}, "target": {...}}. The others (the
    optimizer's moments, or the predictor where only the encoders are wanted) are not read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with _one_process_meant():
            names = FileSystemReader(directory).read_metadata().state_dict_metadata
            keys = {name for name in names if name.startswith(prefixes)}
            for prefix in prefixes:
                if not any(key.startswith(prefix) for key in keys):
                    raise ValueError(f"no tensor named {prefix}* in its index")
            return _load_state_dict_from_keys(keys, checkpoint_id=directory)
    except Exception as exc:
        raise _damaged(directory, exc) from None


def load_checkpoint(run: Path) -> dict[str, Any] | None:
    """The run's checkpoint as full state dicts on CPU: `model`, `target`, `step`, `config` (and `optimizer` from a
    `checkpoint.pt`, memory-mapped: only the tensors used are read), whatever the format; None when it has none yet.

    A sharded checkpoint is read whole into this process (its model and target only): for evaluation and export,
    not for resuming a sharded run (`load_sharded_into`).
    """
    full = load_full_checkpoint(run)
    sharded = sharded_checkpoint(run)
    if sharded is None or (full is not None and int(full["step"]) >= sharded[1]):
        return full
    directory, step = sharded
    state = _read_sharded(directory)
    latest = _latest_sharded(run)
    assert latest is not None
    return {"model": state["model"], "target": state["target"], "step": step, "config": latest["config"]}


class Checkpointer:
    """Saves and resumes one run's context encoder and predictor, target encoder and optimizer, whole or sharded.

    Under FSDP every process writes its own shards (no gather), in a background thread once they are copied to host
    memory: the training goes on, and the checkpoint is published (`latest.json`) when the next save or the end of
    the run (`wait`) finds it written. Otherwise rank 0 writes full state dicts. Rank 0 also writes the two encoders
    as safetensors: at every save of full state dicts, and at the last save of a sharded run (gathered to it, on CPU).
    Resuming takes the newer of the two formats, into whatever this process holds (whole or sharded).

    DCP's state-dict functions are imported by the methods that use them: evaluation and export read checkpoints
    through this module without them (about 2 s of imports).
    """

    def __init__(
        self, run: Path, model: nn.Module, target: nn.Module, optimizer: torch.optim.Optimizer, main: bool
    ) -> None:
        self.run = run
        self.model = model
        self.target = target
        self.optimizer = optimizer
        self.main = main
        self._pending: ShardedSave | None = None  # the sharded checkpoint being written in the background
        self._save_group: dist.ProcessGroup | None = None

    def resume(self) -> int:
        """Load the run's newest checkpoint, of either format, into this process's models and optimizer; its step,
        or 0 when there is none."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
            set_state_dict,
        )

        sharded = sharded_checkpoint(self.run)
        full = load_full_checkpoint(self.run)
        if sharded is not None and (full is None or sharded[1] > int(full["step"])):
            state = self._sharded_state()
            step = load_sharded_into(self.run, state)
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
            set_model_state_dict(self.target, state["target"])
            return step
        if full is None:
            return 0
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, full["model"], options=options)
        set_model_state_dict(self.target, full["target"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, full["optimizer"], options=options)
        return int(full["step"])

    def save(
        self, step: int, config: dict[str, Any], sharded: bool, keep: int, every_keep: int, last: bool = False
    ) -> None:
        """Checkpoint `step` (a collective: every process calls it), with the run's `config`; `last`: the run's final
        step, whose encoders a sharded run also writes as safetensors."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        self.wait()
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if sharded:
            self._pending = start_sharded_checkpoint(
                self.run, self._sharded_state(), step, config, keep, every_keep, self._group()
            )
            if last:  # only what the safetensors hold is gathered: the encoders, not the predictor
                context = cast(
                    dict[str, torch.Tensor], get_model_state_dict(cast(nn.Module, self.model.encoder), options=full)
                )
                target = cast(dict[str, torch.Tensor], get_model_state_dict(self.target, options=full))
                if self.main:
                    save_encoders(self.run, {"target_encoder": target, "context_encoder": context}, step, config)
        else:
            model = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=full))
            target = cast(dict[str, torch.Tensor], get_model_state_dict(self.target, options=full))
            if self.main:
                context = {k.removeprefix(CONTEXT_PREFIX): v for k, v in model.items() if k.startswith(CONTEXT_PREFIX)}
                save_encoders(self.run, {"target_encoder": target, "context_encoder": context}, step, config)
                state = {
                    "model": model,
                    "target": target,
                    "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=full),
                    "step": step,
                    "config": config,
                }
                save_checkpoint(self.run, state, keep, every_keep)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def wait(self) -> None:
        """Finish the sharded checkpoint being written in the background, if any, and publish it (a collective: the
        next `save`, a non-finite stop and the end of the run call it on every rank; after it, every rank reads the
        same `latest.json`)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.publish(self.main)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def publish_if_written(self) -> None:
        """On rank 0, publish the sharded checkpoint being written if it is written by now (no waiting, no
        collective: rank 0's write ends after every rank's). The loop calls it where it logs, so a run killed
        before its next save loses only the steps since the last one written."""
        pending = self._pending
        if self.main and pending is not None and pending.written is not None and pending.written.done():
            self._pending = None
            pending.publish(self.main)

    def _group(self) -> dist.ProcessGroup | None:
        """A gloo group of every rank for DCP's collectives in the background (made once, by every rank at its first
        sharded save): collectives on the training group from another thread could interleave with the step's. None
        without a process group: the checkpoint is then written in the foreground."""
        if self._save_group is None and dist.is_available() and dist.is_initialized():
            self._save_group = dist.new_group(backend="gloo")
        return self._save_group

    def _sharded_state(self) -> dict[str, Any]:
        """This process's shards (plain tensors on one process) of model, target and optimizer, keyed by name."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "target": get_model_state_dict(self.target), "optimizer": optimizer}
