"""What the tests share besides fixtures, one role per module; `tests/conftest.py` keeps the fixtures and hooks.

- `repo`: `REPO`, the repository's root.
- `processes`: starting a command in a session of its own, waiting for it, freezing and killing it with everything
  it started.
- `commands`: command lines (`cli`, `torchrun`, `python_module`) and running them: `tcjepa` (wait), `start_tcjepa`
  (a process to watch), `refused` (in this process, for commands refused before any work).
- `training`: tiny `tcjepa train` runs (`TINY_TRAIN`, `train_args`, the reference and exact runs' steps) and
  comparing their metrics.
- `training_step`: the training step in one process on synthetic batches (test_step, test_compile).
- `stores`: embedding stores: comparing them, stores of made-up vectors written through the Python API.
- `images`: PNGs of one colour and a catalogue of bad images.
- `captions`: captioning with the tiny VLM on vLLM, and reading a caption cache's rows.
- `models`: variants of the session's tiny models.
- `s3`: buckets on the session's S3 server.
- `builds`: what a test session builds once and shares, under pytest-xdist across workers.
- `logs`: the levels of a torchrun rank for the length of a test (`logging_as_rank`).
"""
