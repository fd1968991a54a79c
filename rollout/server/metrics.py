"""Prometheus text exposition of the engine's state, written by hand (no client library needed)."""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "rollout_"


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _metric(lines: list[str], name: str, kind: str, help_text: str, value: float | None = None,
            samples: Mapping[str, float] | None = None, label: str = "") -> None:
    full = PREFIX + name
    lines.append(f"# HELP {full} {help_text}")
    lines.append(f"# TYPE {full} {kind}")
    if samples is not None:
        for key, val in sorted(samples.items()):
            lines.append(f'{full}{{{label}="{key}"}} {_fmt(val)}')
    else:
        lines.append(f"{full} {_fmt(value)}")


def render_metrics(stats: Mapping, finished: Mapping[str, int], counters: Mapping[str, int], model_name: str) -> str:
    """The /metrics body: gauges for the engine's state now, counters since start."""
    num_blocks = max(int(stats["num_blocks"]), 1)
    prompt_tokens = int(stats.get("prompt_tokens", 0))
    lines: list[str] = []
    _metric(lines, "info", "gauge", "Served model (value is always 1).", samples={model_name: 1}, label="model_name")
    _metric(lines, "num_requests_running", "gauge", "Sequences scheduled in the engine.", stats["running"])
    _metric(lines, "num_requests_waiting", "gauge", "Sequences queued (engine queue plus manager inbox).",
            int(stats["waiting"]) + int(stats.get("queued", 0)))
    _metric(lines, "kv_cache_usage_perc", "gauge", "Fraction of KV blocks referenced by live requests.",
            int(stats["used_blocks"]) / num_blocks)
    _metric(lines, "kv_cache_num_blocks", "gauge", "KV cache blocks in the pool.", int(stats["num_blocks"]))
    _metric(lines, "kv_cache_free_blocks", "gauge", "KV blocks that can be allocated now (free or evictable).",
            int(stats["free_blocks"]))
    _metric(lines, "kv_cache_page_size", "gauge", "Tokens per KV block.", int(stats["page_size"]))
    _metric(lines, "prefix_cache_blocks", "gauge", "Blocks registered in the prefix cache.",
            int(stats["cached_blocks"]))
    _metric(lines, "prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / prompt tokens.",
            int(stats["prefix_hit_tokens"]) / prompt_tokens if prompt_tokens else 0.0)
    _metric(lines, "prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
            int(stats["prefix_hit_tokens"]))
    _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens submitted.", prompt_tokens)
    _metric(lines, "generation_tokens_total", "counter", "Tokens generated.", int(stats["generated_tokens"]))
    _metric(lines, "tokens_per_second", "gauge", "Generated tokens per second since the previous scrape.",
            float(stats.get("tokens_per_second", 0.0)))
    _metric(lines, "engine_steps_total", "counter", "Engine steps (forward passes).", int(stats["steps"]))
    _metric(lines, "preemptions_total", "counter", "Requests preempted for lack of KV blocks.",
            int(stats["preemptions"]))
    _metric(lines, "weight_version", "gauge", "Version of the weights new tokens are generated with.",
            int(stats["weight_version"]))
    _metric(lines, "weight_updates_total", "counter", "Weight updates applied.", int(counters.get("weight_updates", 0)))
    _metric(lines, "weight_update_failures_total", "counter", "Weight updates rejected.",
            int(counters.get("weight_update_failures", 0)))
    _metric(lines, "paused", "gauge", "1 while generation is paused.", bool(stats.get("paused", False)))
    reasons = {r: 0 for r in ("stop", "length", "cancelled", "error")}
    reasons.update(finished)
    _metric(lines, "request_finished_total", "counter", "Sequences finished, by finish reason.", samples=reasons,
            label="finish_reason")
    return "\n".join(lines) + "\n"
