"""The run directory: its lock, its config (written once the settings worked) and the text encoder it trains on.

`RUN/config.yaml` marks a run whose settings work; a RUN without it holds at most what a refused start left, which a
corrected retry clears. `RUN/text_encoder.json` records the store's encoder, so that a run never continues on
vectors of another one.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from filelock import FileLock, Timeout

from pipeline.core.errors import UserError
from pipeline.core.fsutil import atomic_write_bytes
from train.config import TrainConfig, differences, saved_config, to_dict
from train.runtime import Runtime, agreed

CONFIG = "config.yaml"
INDEX = "index.parquet"
TEXT_ENCODER = "text_encoder.json"


def prepare_run(cfg: TrainConfig, run: Path, rt: Runtime, store_dir: Path | None) -> FileLock | None:
    """Create RUN and lock it (rank 0); refuse a RUN made with a different config.

    The lock (an flock, gone with the process even on SIGKILL) stops a second trainer
    from writing into a run that is still going. `config.yaml` is written later, by `save_config`, once the
    settings proved valid on the data: a RUN without it holds at most what a refused start left (its index and
    text-encoder record), which is removed here so that a corrected retry into the same RUN starts clean.
    """
    saved_path = run / CONFIG
    if saved_path.exists():
        saved = saved_config(yaml.safe_load(saved_path.read_text()) or {})
        changed = differences(saved, cfg)
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} → {to_dict(cfg)[k]!r}" for k in changed[:4])
            raise UserError(f"{run} holds a run with another config ({details}); use a new --out or the same settings")

    def claim() -> FileLock:
        if not saved_path.exists() and run.exists() and any(not _left_by_a_start(p) for p in run.iterdir()):
            raise UserError(f"--out {run} is a non-empty directory that is not a tcjepa run; choose a new directory")
        run.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(run / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise UserError(
                f"{run} is in use by another `tcjepa train` (it holds {run / '.lock'}); wait for it or stop it"
            ) from None
        if not saved_path.exists():
            for leftover in run.iterdir():
                if leftover.name != ".lock":
                    leftover.unlink()
        if store_dir is not None:
            check_text_encoder(store_dir, cfg.store, run)
        return lock

    return agreed(rt, claim, on=rt.main)


def _left_by_a_start(path: Path) -> bool:
    """What a start refused before it saved its config leaves in RUN: the lock, the index, the encoder record and
    their temporaries."""
    name = path.name
    return path.is_file() and (
        name in (".lock", INDEX, TEXT_ENCODER) or name.startswith((f".{INDEX}.", f".{TEXT_ENCODER}."))
    )


def save_config(cfg: TrainConfig, run: Path, rt: Runtime) -> None:
    """Write RUN/config.yaml (the settings as asked, automatic ones as 0): the mark of a run whose settings work."""
    agreed(
        rt, lambda: atomic_write_bytes(run / CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode()), rt.main
    )


def check_text_encoder(store_dir: Path, given: str | None, run: Path) -> None:
    """Record the store's encoder in RUN, and refuse to continue on vectors of another one (a store rebuilt in
    place)."""
    from embedding_cache.store import EmbeddingStore

    store = EmbeddingStore(store_dir)
    record = run / TEXT_ENCODER
    if record.exists():
        trained_on = json.loads(record.read_text())["encoder_hash"]
        if trained_on != store.encoder_hash:
            raise UserError(
                f"{run} was trained on embeddings of encoder {trained_on[:12]}, but --store {given} now holds "
                f"encoder {store.encoder_hash[:12]}'s; use a new --out, or the store the run started with"
            )
        return
    atomic_write_bytes(
        record,
        json.dumps({"encoder_hash": store.encoder_hash, "encoder": store.encoder, "d_model": store.width}).encode(),
    )
