"""Joining or starting Ray for `--executor ray`, and what each actor asks of it."""

from __future__ import annotations

import logging

from pipeline.core.errors import UserError


def start_ray(address: str | None) -> None:
    """Join the cluster at `address` (or the one RAY_ADDRESS names), or start a local instance; Ray's own logging kept
    quiet."""
    import ray

    logging.getLogger("ray").setLevel(logging.ERROR)
    try:
        ray.init(
            address=address,
            ignore_reinit_error=True,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except ConnectionError as exc:
        raise UserError(f"--ray-address {address}: {str(exc).splitlines()[0]}") from None
    import ray.data

    # its per-run INFO lines and progress bars would interleave with ours
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ray.data.DataContext.get_current().enable_progress_bars = False


def actor_resources(device: str, actors: int | None, gpus_per_actor: int = 1) -> tuple[int, dict[str, float]]:
    """How many model actors, and what each asks for: `gpus_per_actor` GPUs when the cluster has GPUs (and --device
    allows), else a CPU."""
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = gpus > 0 and not device.startswith("cpu")
    size = actors if actors is not None else (max(gpus // gpus_per_actor, 1) if use_gpu else 1)
    if size < 1:
        raise UserError("--num-workers must be at least 1")
    return size, ({"num_gpus": gpus_per_actor} if use_gpu else {"num_cpus": 1})
