"""Pooled and per-worker figures: several engines' EngineStats read as one, plus what each worker did in a batch.

Pooled counters and block counts are sums over the workers, so every derived figure keeps EngineStats's definition
(KV usage is used blocks over all blocks; the pooled peak sums each worker's peak, an upper bound of the pool's
simultaneous peak). Per-worker figures go under `batch.stats["workers"]` and reach trainer logs as
`rollout/worker<id>/...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from rollout.engine.core.stats import EngineStats

_SHARED = ("page_size", "weight_version")  # the same on every worker of a pool: taken, not summed
WORKER_FIGURES = ("tokens_per_second", "generated_tokens", "seconds", "groups", "queued_tokens", "peak_kv_cache_usage",
                  "weight_version")


def engine_stats(figures: Mapping[str, float]) -> EngineStats:
    """EngineStats from its `as_dict()` (or any mapping with its fields; missing ones are 0)."""
    return EngineStats(**{f.name: int(figures.get(f.name, 0)) for f in dataclasses.fields(EngineStats)})


def pooled(stats: Sequence[EngineStats]) -> EngineStats:
    """One EngineStats for several engines: counters, blocks and queues summed; page size and version shared."""
    if not stats:
        raise ValueError("no worker stats to pool")
    summed = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
              if f.name not in _SHARED}
    return dataclasses.replace(stats[0], weight_version=max(s.weight_version for s in stats), **summed)


def queue_depth(stats: EngineStats) -> int:
    """Sequences an engine holds that are not finished: running, waiting, and submitted but not yet scheduled."""
    return stats.running + stats.waiting + stats.queued


def worker_metrics(stats: Mapping, prefix: str = "rollout/") -> dict[str, float]:
    """Flat per-worker metrics of a pool's batch stats ({} for a single engine's): `rollout/worker<id>/<figure>`
    and the pool's size at the end of the batch (`rollout/workers`)."""
    workers = stats.get("workers")
    if not workers:
        return {}
    out = {f"{prefix}workers": float(stats.get("live_workers", len(workers)))}
    for worker in workers:
        for figure in WORKER_FIGURES:
            if figure in worker:
                out[f"{prefix}worker{worker['worker']}/{figure}"] = float(worker[figure])
    return out


def batch_stats(windows: Sequence[EngineStats], seconds: float, workers: list[dict], live_workers: int) -> dict:
    """A pool's `RolloutBatch.stats`: the pooled engine window with the keys one generator's batch has (so
    `rollout_metrics` reads it unchanged), tokens/s over the pool's wall time, and the per-worker entries."""
    stats: dict = pooled(windows).as_dict() if windows else {}
    generated = stats.get("generated_tokens", sum(w.get("generated_tokens", 0) for w in workers))
    stats.update(seconds=seconds, generated_tokens=generated, tokens_per_second=generated / max(seconds, 1e-9),
                 workers=workers, live_workers=live_workers)
    return stats
