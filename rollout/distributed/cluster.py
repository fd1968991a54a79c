"""The Ray cluster a RolloutPool runs on: starting a local one, placing workers, and getting results with the
workers' own errors."""

from __future__ import annotations

import os

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError("rollout.distributed.RolloutPool needs Ray: pip install 'rollout[ray]'") from _err

from rollout.manager import ManagerError

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
WORKER_NICENESS = "RAY_worker_niceness"


def init_local_ray(**options) -> None:
    """`ray.init(**options)` for a cluster this process starts, with its workers at the driver's priority.

    Ray starts its workers at nice 15. Beside a trainer, or any other busy process on the same cores, a worker then
    gets a few percent of a core: with two busy processes on a 2-core machine a rollout worker took minutes to start
    and generated as slowly. $RAY_worker_niceness, if set, is left as it is.
    """
    unset = WORKER_NICENESS not in os.environ
    if unset:
        os.environ[WORKER_NICENESS] = "0"
    try:
        ray.init(**options)
    finally:
        if unset:
            del os.environ[WORKER_NICENESS]


def ready_placement_group(resources: dict, bundles: int, strategy: str, timeout: float):
    """A placement group of `bundles` bundles of `resources`, once Ray has placed it; TimeoutError saying what is
    available otherwise."""
    group = placement_group([dict(resources) for _ in range(bundles)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except GetTimeoutError:
        remove_placement_group(group)
        raise TimeoutError(f"the Ray cluster cannot place {bundles} worker(s) with {resources} each ({strategy}) "
                           f"within {timeout:g}s; available: {ray.available_resources()}. Use fewer workers, "
                           "smaller num_cpus/num_gpus, or add nodes") from None
    return group


def ray_get(ref, timeout: float | None = None):
    """ray.get that raises a worker's own ValueError (WeightUpdateError too) and ManagerError as themselves."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as err:
        if isinstance(err.cause, (ValueError, ManagerError)):
            raise err.cause from None
        raise


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]
