"""OutputRouter: per-request output callbacks for the ContinuousBatchingManager.

A caller that submits with a callback gets every output of its sequences pushed to it (partials when streaming, then
exactly one final output per sequence, failures included), instead of waiting on the manager for them. The server
uses it to hand outputs to its event loop without a thread per request.

Deliveries are serialized, so a callback sees its outputs in the order they were produced, and an output that comes
after its sequence's final one (a partial racing a cancel) is dropped. Callbacks run on the thread that produced the
outputs (the manager's loop, or a thread that cancelled), never under the engine lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from rollout.engine.core.request import ErrorKind, RequestOutput

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
"""Receives a routed request's outputs on the manager's threads: it must be cheap and must not block (hand the output
to a queue or an event loop); an exception it raises is logged and otherwise ignored."""


class OutputRouter:
    """Callbacks by sequence id, from submission until each sequence's final output has been handed over."""

    def __init__(self) -> None:
        self._routes: dict[str, OutputCallback] = {}
        self._lock = threading.Lock()  # guards _routes
        self._delivering = threading.RLock()  # one delivery at a time (re-entrant: a callback may cancel)

    def __contains__(self, sequence_id: str) -> bool:
        with self._lock:
            return sequence_id in self._routes

    def register(self, sequence_ids: Iterable[str], callback: OutputCallback) -> None:
        with self._lock:
            for sequence_id in sequence_ids:
                self._routes[sequence_id] = callback

    def route(self, outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """Hand each routed output to its callback; returns the outputs of sequences nobody registered."""
        unrouted: list[RequestOutput] = []
        with self._delivering:
            calls: list[tuple[OutputCallback, RequestOutput]] = []
            with self._lock:
                for out in outputs:
                    callback = self._routes.get(out.request_id)
                    if callback is None:
                        unrouted.append(out)
                        continue
                    if out.is_finished():
                        del self._routes[out.request_id]
                    calls.append((callback, out))
            for callback, out in calls:
                _call(callback, out)
        return unrouted

    def fail_all(self, reported: list[RequestOutput], error: str) -> None:
        """Give every routed sequence its final output after the manager died: `reported` holds what the engine
        could still say; a sequence it misses gets a bare SHUTDOWN failure carrying `error`."""
        covered = {out.request_id for out in reported}
        with self._lock:
            missing = [sequence_id for sequence_id in self._routes if sequence_id not in covered]
        self.route(reported + [RequestOutput.failure(rid, [], error, ErrorKind.SHUTDOWN) for rid in missing])


def _call(callback: OutputCallback, out: RequestOutput) -> None:
    """Run one callback; a failing callback is logged and must not take the manager's loop down with it."""
    try:
        callback(out)
    except Exception:
        logger.exception("the on_output callback of request %r raised; the output was dropped (callbacks must not "
                         "raise: catch inside the callback)", out.request_id)
