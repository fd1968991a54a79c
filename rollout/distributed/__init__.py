"""Scaling rollouts out: many engines behind the RolloutGenerator interface.

`RolloutPool` runs RolloutWorkers as Ray actors (the `rollout[ray]` extra); `RolloutServerPool` spreads the same work
over several `rollout serve` processes through `rollout.client` (the `rollout[serve]` extra). Both spread prompt
groups by queued tokens, return results in input order, update weights on every engine or none, and re-run the
groups of an engine that dies or hangs on the others. Names load on first use, so importing this package needs
neither Ray nor httpx. See docs/scaling.md.
"""

from __future__ import annotations

from rollout.lazy_exports import lazy_exports

_EXPORTS = {
    "ModelSpec": "rollout.distributed.spec",
    "ObjectStoreTransport": "rollout.distributed.broadcast",
    "RolloutPool": "rollout.distributed.pool",
    "RolloutServerPool": "rollout.distributed.server_pool",
    "RolloutWorker": "rollout.distributed.worker",
    "ServerLostError": "rollout.distributed.server_pool",
    "WeightTransport": "rollout.distributed.broadcast",
    "WorkersLostError": "rollout.distributed.pool",
    "init_local_ray": "rollout.distributed.cluster",
}


def _missing_extra(name: str, err: ModuleNotFoundError) -> ImportError:
    extra = "ray" if err.name == "ray" else "serve"
    return ImportError(f"rollout.distributed.{name} needs the {extra} extra: pip install 'rollout[{extra}]' "
                       f"({err.name} is not installed)")


__getattr__, __dir__ = lazy_exports("rollout.distributed", _EXPORTS, globals(), _missing_extra)


__all__ = sorted(_EXPORTS)
