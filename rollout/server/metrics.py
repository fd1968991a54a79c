"""/metrics: the engine's state in Prometheus format, through prometheus_client.

One collector per app, in the app's own CollectorRegistry (several apps in one process never clash), reads
`EngineStats` when scraped: nothing is kept in sync in between, and derived figures (KV usage, prefix-cache hit rate)
are EngineStats's own, so /metrics means what the generator's and the trainer's stats mean. Counters are exposed with
the `_total` suffix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from rollout.engine.core.stats import EngineStats
from rollout.server.backend import ServerBackend

PREFIX = "rollout_"
FINISH_REASONS = ("stop", "length", "cancelled", "error")  # always exposed, 0 until one happens
CONTENT_TYPE = CONTENT_TYPE_LATEST

# name, help, EngineStats field or property
_GAUGES = (
    ("num_requests_running", "Sequences scheduled in the engine.", "running"),
    ("kv_cache_usage_perc", "Fraction of KV blocks referenced by live requests.", "kv_cache_usage"),
    ("kv_cache_num_blocks", "KV cache blocks in the pool.", "num_blocks"),
    ("kv_cache_free_blocks", "KV blocks that can be allocated now (free or evictable).", "free_blocks"),
    ("kv_cache_page_size", "Tokens per KV block.", "page_size"),
    ("prefix_cache_blocks", "Blocks registered in the prefix cache.", "cached_blocks"),
    ("prefix_cache_hit_rate", "Share of prompt work served from the prefix cache: hits / (hits + prefilled).",
     "prefix_cache_hit_rate"),
    ("weight_version", "Version of the weights new tokens are generated with.", "weight_version"),
    ("num_requests_swapped", "Preempted sequences whose KV waits in the CPU swap space.", "swapped"),
    ("cpu_swap_free_blocks", "Free blocks of the CPU swap space (0 when offloading is off).", "swap_free_blocks"),
)
_COUNTERS = (
    ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", "prefix_hit_tokens"),
    ("prompt_tokens", "Prompt tokens submitted.", "prompt_tokens"),
    ("generation_tokens", "Tokens generated.", "generated_tokens"),
    ("engine_steps", "Engine steps (forward passes).", "steps"),
    ("preemptions", "Requests preempted for lack of KV blocks.", "preemptions"),
    ("cpu_swapped_out_blocks", "KV blocks preemptions copied to the CPU swap space.", "swapped_out_blocks"),
    ("cpu_swapped_in_blocks", "KV blocks copied back from the CPU swap space.", "swapped_in_blocks"),
)
_UPDATE_COUNTERS = (
    ("weight_updates", "Weight updates applied.", "weight_updates"),
    ("weight_update_failures", "Weight updates rejected.", "weight_update_failures"),
)


class EngineCollector(Collector):
    """Reads the backend's EngineStats and counters at each scrape (call it where the engine lock may be waited on)."""

    def __init__(self, backend: ServerBackend, model_name: str) -> None:
        self.backend = backend
        self.model_name = model_name
        self._rate_sample = (time.monotonic(), 0)  # (when, generated tokens) at the previous scrape

    def collect(self) -> Iterator[Metric]:
        stats = self.backend.manager.stats()
        info = GaugeMetricFamily(PREFIX + "info", "Served model (value is always 1).", labels=["model_name"])
        info.add_metric([self.model_name], 1)
        yield info
        for name, help_text, attr in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, help_text, value=getattr(stats, attr))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Sequences queued (engine queue plus manager inbox).",
                                value=stats.waiting + stats.queued)
        yield GaugeMetricFamily(PREFIX + "tokens_per_second", "Generated tokens per second since the previous scrape.",
                                value=self._tokens_per_second(stats))
        yield GaugeMetricFamily(PREFIX + "paused", "1 while generation is paused.", value=int(self.backend.paused))
        for name, help_text, attr in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, help_text, value=getattr(stats, attr))
        updates = self.backend.weights.counters
        for name, help_text, key in _UPDATE_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, help_text, value=updates.get(key, 0))
        finished = CounterMetricFamily(PREFIX + "request_finished", "Sequences finished, by finish reason.",
                                       labels=["finish_reason"])
        counts = {reason: 0 for reason in FINISH_REASONS} | self.backend.finished_counts()
        for reason, count in sorted(counts.items()):
            finished.add_metric([reason], count)
        yield finished

    def _tokens_per_second(self, stats: EngineStats) -> float:
        now = time.monotonic()
        then, tokens = self._rate_sample
        self._rate_sample = (now, stats.generated_tokens)
        return (stats.generated_tokens - tokens) / max(now - then, 1e-9)


class ServerMetrics:
    """The /metrics registry of one app."""

    def __init__(self, backend: ServerBackend, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(backend, model_name))
        self._backend = backend

    async def render(self) -> bytes:
        """The exposition text, collected on the backend's control thread (reading stats waits on the engine lock)."""
        return await self._backend.run_on_control(generate_latest, self.registry)
