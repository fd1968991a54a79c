"""EngineStats: the engine's counters and cache state, and every figure derived from them, defined once.

The generator's per-call stats, the server's /metrics and the trainer's rollout metrics all read this object, so a
"prefix-cache hit rate" or "KV usage" means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Monotonic counters: a window of work (one generate call, one training step) is the difference of two snapshots.
COUNTERS = ("steps", "prompt_tokens", "generated_tokens", "prefill_tokens", "decode_tokens", "prefix_hit_tokens",
            "forward_errors", "preemptions", "chunked_prefills", "swapped_out_blocks", "swapped_in_blocks")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine. Counters grow from engine creation; the rest is the state now."""

    num_blocks: int
    page_size: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    peak_used_blocks: int  # most blocks referenced at once since the engine started or `reset_peak`
    running: int
    waiting: int
    weight_version: int
    steps: int = 0
    prompt_tokens: int = 0  # submitted prompt tokens, once per request (an n-group counts its prompt once)
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    decode_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache instead of a forward
    forward_errors: int = 0
    preemptions: int = 0
    chunked_prefills: int = 0
    # CPU offload (cpu_offload_space): the swap space's size and free blocks, the sequences waiting in it now, and the
    # blocks copied out to it and back in (a preemption that swaps recomputes nothing)
    swap_blocks: int = 0
    swap_free_blocks: int = 0
    swapped: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    queued: int = 0  # submitted to a manager but not yet handed to the engine
    uncollected: int = 0  # finished in a manager but not yet collected by a caller

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt work served from the prefix cache: hits / (hits + prefilled tokens)."""
        work = self.prefix_hit_tokens + self.prefill_tokens
        return self.prefix_hit_tokens / work if work else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks referenced by live requests now."""
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def peak_kv_cache_usage(self) -> float:
        """Largest `kv_cache_usage` since the engine started or its peak was last reset."""
        return self.peak_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def since(self, before: EngineStats) -> EngineStats:
        """This snapshot with every counter replaced by its growth since `before` (state fields stay as now)."""
        return dataclasses.replace(self, **{name: getattr(self, name) - getattr(before, name) for name in COUNTERS})

    def as_dict(self) -> dict[str, float]:
        """Every field and derived figure, flat (for logs, JSON and benchmarks)."""
        out: dict[str, float] = dataclasses.asdict(self)
        out.update(prefix_cache_hit_rate=self.prefix_cache_hit_rate, kv_cache_usage=self.kv_cache_usage,
                   peak_kv_cache_usage=self.peak_kv_cache_usage)
        return out
