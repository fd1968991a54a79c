"""KeptSequences: finished sequences whose KV blocks stay referenced so a later request can continue them exactly.

A multi-turn episode (the model answers, an environment appends tokens, the model goes on) would otherwise re-prefill
its whole conversation every turn, or, through the page-granular prefix cache, at least its last partial block. A
sequence submitted with `keep_kv` is parked here when it finishes; a request that `continues` it takes over its block
table, so only the tokens appended since (the sequence's last sampled token, whose KV was never computed, and the
environment's tokens) are prefilled.

Kept blocks are a cache, not a reservation: when the pool runs dry the scheduler releases the oldest kept sequences
first (their full blocks stay in the prefix cache, so a continuation still finds those), and a continuation whose kept
sequence is gone, or whose tokens do not extend it, is served like any new prompt.
"""

from __future__ import annotations

from collections import OrderedDict

from rollout.engine.core.request import Request


class KeptSequences:
    """Finished sequences holding their blocks, oldest first; the scheduler releases what leaves."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, Request] = OrderedDict()
        self._wanted: set[str] = set()  # live sequence ids to keep once they finish

    def __len__(self) -> int:
        return len(self._kept)

    def want(self, sequence_ids: list[str]) -> None:
        """Keep these sequences' KV when they finish (not when they fail or are cancelled)."""
        self._wanted.update(sequence_ids)

    def keeps(self, request: Request) -> bool:
        """Whether a sequence that just finished should be parked instead of released (asked once per sequence)."""
        if request.request_id not in self._wanted:
            return False
        self._wanted.discard(request.request_id)
        return True

    def forget_wish(self, sequence_id: str) -> None:
        """A live sequence ended otherwise (failed, cancelled): nothing to keep."""
        self._wanted.discard(sequence_id)

    def park(self, request: Request) -> Request | None:
        """Park a finished sequence; returns one parked earlier under the same id, which the caller must release."""
        previous = self._kept.pop(request.request_id, None)
        self._kept[request.request_id] = request
        return previous

    def take(self, sequence_id: str) -> Request | None:
        """Remove and return a parked sequence (None if it is not parked: never kept, released or evicted)."""
        return self._kept.pop(sequence_id, None)

    def oldest(self) -> Request | None:
        """Remove and return the sequence parked longest ago (None if none)."""
        if not self._kept:
            return None
        return self._kept.popitem(last=False)[1]

    def take_all(self) -> list[Request]:
        kept = list(self._kept.values())
        self._kept.clear()
        return kept

    def requests(self) -> list[Request]:
        return list(self._kept.values())
