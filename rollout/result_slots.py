"""ResultSlots: where the manager keeps the outputs of requests submitted without a callback, until a caller reads them.

Each sequence has a slot from submission until a caller collected its final output: a finished output waits in an
ordered dict (`get_result`, iteration), a streaming sequence has a queue its reader drains as tokens arrive. Every slot
is guarded by the manager's condition variable, so a caller waiting on request A is never disturbed by request B.

The slots never decide how to wait: the manager passes `wait_for` (it knows whether the caller steps the engine itself
and whether the loop is alive) and `raise_if_dead`.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from rollout.engine.core.request import RequestOutput

MAX_UNCLAIMED = 4096
POLL_S = 0.5  # safety net: how often blocked stream readers re-check that the loop is alive
_DEAD = object()  # pushed into every stream queue when the loop dies

WaitFor = Callable[[Callable[[], bool], "float | None"], bool]
"""`wait_for(predicate, timeout)`, called with the condition variable held: True once the predicate holds, False on
timeout; raises if results can no longer arrive."""


class ResultSlots:
    """Uncollected outputs by sequence id; every method but the readers' expects the caller to hold `cv`."""

    def __init__(self, cv: threading.Condition, wait_for: WaitFor, raise_if_dead: Callable[[], None],
                 stepping_here: Callable[[], bool], keep_unclaimed: bool = False) -> None:
        self._cv = cv
        self._wait_for = wait_for
        self._raise_if_dead = raise_if_dead
        self._stepping_here = stepping_here  # True when the calling thread steps the engine while it waits
        self._finished: OrderedDict[str, RequestOutput] = OrderedDict()
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._pending: set[str] = set()  # submitted, final output not yet handed to a caller
        # A tensor-parallel follower gets rank 0's requests, possibly before its own caller submitted the same ones:
        # their outputs wait here (the most recent MAX_UNCLAIMED sequences) until `claim`.
        self._unclaimed: OrderedDict[str, list[RequestOutput]] | None = OrderedDict() if keep_unclaimed else None

    # ------------------------------------------------ writers (caller holds cv)
    def in_use(self, sequence_id: str) -> bool:
        return sequence_id in self._pending or sequence_id in self._streams

    def open(self, sequence_ids: Iterable[str], streaming: bool) -> None:
        for sequence_id in sequence_ids:
            self._pending.add(sequence_id)
            if streaming:
                self._streams[sequence_id] = queue.SimpleQueue()

    def put(self, outputs: Iterable[RequestOutput]) -> None:
        """File outputs in their slots: every output of a streaming sequence, the final one of the others. Outputs
        of sequences without a slot (already collected, or never submitted here) are dropped."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
            elif out.is_finished() and out.request_id in self._pending:
                self._finished[out.request_id] = out
            elif self._unclaimed is not None and out.request_id not in self._pending:
                self._unclaimed.setdefault(out.request_id, []).append(out)
                if len(self._unclaimed) > MAX_UNCLAIMED:
                    self._unclaimed.popitem(last=False)

    def claim(self, sequence_ids: Iterable[str]) -> list[RequestOutput]:
        """The outputs that arrived for these sequences before they were submitted here (tensor-parallel followers)."""
        if self._unclaimed is None:
            return []
        return [out for sequence_id in sequence_ids for out in self._unclaimed.pop(sequence_id, [])]

    def wake_streams(self) -> None:
        """The loop died: wake every stream reader so it raises the loop's error."""
        for stream in self._streams.values():
            stream.put(_DEAD)

    @property
    def uncollected(self) -> int:
        return len(self._finished)

    # -------------------------------------------------- readers (take cv themselves)
    def get(self, request_id: str | None, timeout: float | None) -> RequestOutput | None:
        """The next finished output, or `request_id`'s; None on timeout."""
        with self._cv:
            if request_id is not None and request_id not in self._pending:
                raise KeyError(f"unknown request id {request_id!r}: never submitted, already collected, streaming "
                               "(read it with request_id_iter) or routed (its on_output callback gets it)")
            ready = (lambda: request_id in self._finished) if request_id else (lambda: bool(self._finished))
            if not self._wait_for(ready, timeout):
                return None
            return self._take(request_id)

    def drain(self) -> Iterator[RequestOutput]:
        """Finished outputs as they come, until every non-streaming sequence submitted so far was collected."""
        while True:
            with self._cv:
                self._wait_for(lambda: bool(self._finished) or not self._non_streaming_pending(), None)
                if not self._finished:
                    return
                out = self._take(None)
            yield out

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """Partial outputs of a streaming sequence as tokens arrive, then its final output (the final output alone
        for a sequence submitted without streaming)."""
        with self._cv:
            stream = self._streams.get(request_id)
            if stream is None and request_id not in self._pending:
                raise KeyError(f"unknown request id {request_id!r}: never submitted, already collected, or routed "
                               "(its on_output callback gets its outputs)")
        if stream is None:
            out = self.get(request_id, None)
            if out is not None:
                yield out
            return
        while True:
            if self._stepping_here():
                with self._cv:
                    self._wait_for(lambda: not stream.empty(), POLL_S)
            try:
                out = stream.get(timeout=POLL_S)
            except queue.Empty:
                self._raise_if_dead()
                continue
            if out is _DEAD:
                self._raise_if_dead()
            if out.is_finished():
                with self._cv:
                    self._streams.pop(request_id, None)
                    self._pending.discard(request_id)
            yield out
            if out.is_finished():
                return

    def _take(self, request_id: str | None) -> RequestOutput:
        out = self._finished.pop(request_id) if request_id else self._finished.popitem(last=False)[1]
        self._pending.discard(out.request_id)
        return out

    def _non_streaming_pending(self) -> bool:
        return any(rid not in self._streams for rid in self._pending)

    def nothing_to_collect(self) -> bool:
        return not self._finished
