"""Rollout metrics for trainer logs and W&B: throughput, cache behaviour, weight sync, completion shape."""

from __future__ import annotations

import logging
from collections import Counter

from rollout.distributed.metrics import worker_metrics
from rollout.rl.batch import RolloutBatch

logger = logging.getLogger(__name__)


def rollout_metrics(batch: RolloutBatch, sync_seconds: float | None = None, prefix: str = "rollout/") -> dict:
    """Flat float metrics of one generation step (keys prefixed for the trainer's or W&B's namespace).

    `batch.stats` is the generator's window of `EngineStats.as_dict()` (plus seconds and tokens/s); a remote batch
    carries only what the server reports, and missing figures are 0. A pool's batch is pooled over its workers, and
    adds each worker's figures as `rollout/worker<id>/...` (see rollout.distributed.metrics)."""
    stats = batch.stats
    lengths = [len(s.completion_ids) for s in batch.samples] or [0]
    reasons = Counter(s.finish_reason for s in batch.samples)
    out = {
        "tokens_per_second": stats.get("tokens_per_second", 0.0),
        "generation_seconds": stats.get("seconds", 0.0),
        "prefill_tokens": stats.get("prefill_tokens", 0),
        "decode_tokens": stats.get("decode_tokens", 0),
        "generated_tokens": stats.get("generated_tokens", 0),
        "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate", 0.0),  # as defined by EngineStats
        "kv_cache_usage": stats.get("peak_kv_cache_usage", 0.0),  # the peak over the generation call
        "preemptions": stats.get("preemptions", 0),
        "weight_version": stats.get("weight_version", 0),
        "completion_length/mean": sum(lengths) / len(lengths),
        "completion_length/min": min(lengths),
        "completion_length/max": max(lengths),
    }
    for reason in ("stop", "length"):
        out[f"finish_reason/{reason}"] = reasons.get(reason, 0) / max(1, len(batch.samples))
    if sync_seconds is not None:
        out["weight_sync_seconds"] = sync_seconds
    return {**{prefix + k: float(v) for k, v in out.items()}, **worker_metrics(stats, prefix)}


def log_to_wandb(metrics: dict, step: int | None = None) -> bool:
    """Log to the active W&B run if there is one (offline runs included); False when wandb is absent or idle."""
    try:
        import wandb
    except ImportError:
        return False
    if wandb.run is None:
        return False
    wandb.log(metrics, step=step)
    return True
