"""SwapSpace: where a preempted sequence's KV waits, in CPU memory, instead of being dropped and recomputed.

When the cache runs out, the scheduler preempts the latest arrivals. Without a swap space their KV is freed and
recomputed later: prompt and generated tokens prefill again. With one, their blocks are copied to host blocks here and
copied back when they resume, if that is cheaper (`PreemptionCosts`). The host blocks are plain integers, like the
pool's; what they hold lives in the worker's `HostKVStorage`, which the two copy callbacks reach.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

CopyBlocks = Callable[[list[int], list[int]], None]  # (source block ids, target block ids), one list each side


@dataclass
class PreemptionCosts:
    """What swapping and recomputing cost here, learned from the engine's own steps and copies (a moving average, so
    a one-off stall does not flip the choice). Until both are seen, swapping wins: a copy of a token's KV is orders of
    magnitude less work than the forward that made it, for any transformer."""

    seconds_per_token: float | None = None  # one token through a forward (what a recompute pays per token)
    seconds_per_block: float | None = None  # one block copied one way between the cache and the swap space
    smoothing: float = 0.2

    def observe_forward(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.seconds_per_token = self._average(self.seconds_per_token, seconds / tokens)

    def observe_copy(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.seconds_per_block = self._average(self.seconds_per_block, seconds / blocks)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def swap_is_cheaper(self, recompute_tokens: int, block_copies: int) -> bool:
        """Whether `block_copies` one-way block copies (out, and back in) beat recomputing `recompute_tokens`."""
        if self.seconds_per_token is None or self.seconds_per_block is None:
            return True
        return block_copies * self.seconds_per_block < recompute_tokens * self.seconds_per_token


class SwapSpace:
    """A fixed set of host blocks with a free list, and the copies that move KV between them and the cache."""

    def __init__(self, num_blocks: int, copy_out: CopyBlocks, copy_in: CopyBlocks,
                 costs: PreemptionCosts | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._copy_out = copy_out
        self._copy_in = copy_in
        self.costs = costs or PreemptionCosts()
        self._free: deque[int] = deque(range(num_blocks))
        self.counters = dict(swapped_out_blocks=0, swapped_in_blocks=0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def copy_out(self, device_blocks: list[int]) -> list[int]:
        """Copy cache blocks into newly taken host blocks (the caller checked `num_free`); returns the host blocks."""
        host = [self._free.popleft() for _ in device_blocks]
        self._timed(self._copy_out, device_blocks, host)
        self.counters["swapped_out_blocks"] += len(host)
        return host

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks back into cache blocks (the host blocks stay taken until `release`)."""
        if host_blocks:
            self._timed(self._copy_in, host_blocks, device_blocks)
            self.counters["swapped_in_blocks"] += len(host_blocks)

    def _timed(self, copy: CopyBlocks, source: list[int], target: list[int]) -> None:
        start = time.perf_counter()
        copy(source, target)
        self.costs.observe_copy(len(source), time.perf_counter() - start)

    def release(self, host_blocks: Iterable[int]) -> None:
        self._free.extend(host_blocks)

    def check_invariants(self, owners: Iterable[Sequence[int]]) -> None:
        """Every host block is either free or held by exactly one swapped sequence (used by tests)."""
        held = [b for table in owners for b in table]
        assert len(set(held)) == len(held), "a host block is held twice"
        assert len(set(self._free)) == len(self._free), "a host block is twice in the swap free list"
        assert not set(held) & set(self._free), "a held host block is on the swap free list"
        assert len(held) + len(self._free) == self.num_blocks, "host blocks leaked"
