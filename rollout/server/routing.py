"""RoutedRequest: how one HTTP request's outputs travel from the manager's loop thread to the event loop.

The manager calls `on_output` (its output router) for every output of the request's sequences, on its own thread;
`on_output` only hands the output to the event loop with `call_soon_threadsafe`, so the loop thread never waits on
the server. The HTTP side reads the outputs as (choice index, output) pairs, streamed or all at once, and closing
the request early (the client went away, or `stalled` says it waited too long) cancels the sequences that have not
finished.

A stream waits once per token, so that wait is a bare `await` on the queue: no Task or timer per token (what
`asyncio.wait_for` costs). A watchdog timer per request, re-armed every DISCONNECT_POLL_S, does the checking instead:
it puts the `stalled` error in the queue once there is one, while the queue is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable

from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.engine.core.sequence_group import sequence_ids
from rollout.server.errors import OpenAIError, from_failed_output

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response; nobody reads it
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there and it is not stalled
LOGGED_IDS = 5  # request ids named in one log line (a request may have a thousand)


class RoutedRequest:
    """The sequences of one HTTP request (one manager request per prompt) and the queue their outputs arrive on.

    `close()` must work without awaiting (a disconnected client's task is cancelled, and a streaming response that
    never started never iterates), so it is synchronous and also runs when the object is garbage-collected. The
    manager holds only `on_output` (which holds the queue, not this object), so dropping the object is enough.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: Callable[[list[str]], None],
                 on_final: Callable[[RequestOutput], None],
                 stalled: Callable[[], Exception | None] = lambda: None) -> None:
        self._loop = loop
        self._cancel = cancel
        self._stalled = stalled  # the error to give up with, when waiting longer makes no sense (an overdue pause)
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()  # an Exception: the stall error
        self.on_output = _router_callback(loop, self._queue, on_final)
        self._choice: dict[str, int] = {}  # sequence id -> choice index (prompt-major)
        self._owner: dict[str, str] = {}  # sequence id -> manager request id (what cancel takes)
        self._finals: dict[int, RequestOutput] = {}
        self._closed = False
        self._watchdog: asyncio.TimerHandle | None = None  # armed by the first streamed wait

    def expect(self, request_id: str, n: int) -> None:
        """Register a manager request of `n` sequences; its choices follow those registered before."""
        for seq_id in sequence_ids(request_id, n):
            self._choice[seq_id] = len(self._choice)
            self._owner[seq_id] = request_id

    @property
    def num_choices(self) -> int:
        return len(self._choice)

    # ------------------------------------------------------------ reading
    def __aiter__(self) -> RoutedRequest:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        """The next (choice index, output); ends once every sequence has its final output."""
        if self._closed or len(self._finals) == self.num_choices:
            if self._watchdog is not None:
                self._watchdog.cancel()
            raise StopAsyncIteration
        if self._watchdog is None:
            self._arm_watchdog()
        try:
            return await self._next()
        except BaseException:  # cancelled while waiting (the client went away), or stalled
            self.close()
            raise

    def _arm_watchdog(self) -> None:
        # the timer holds a weak reference: a dropped request is still collected (and closed) while it is armed
        self._watchdog = self._loop.call_later(DISCONNECT_POLL_S, _watch, weakref.ref(self))

    def _watch(self) -> None:
        """The streamed wait's watchdog: queue the `stalled` error once there is one while nothing is queued (the
        reader is waiting, not behind), else check again in DISCONNECT_POLL_S."""
        if self._closed or len(self._finals) == self.num_choices:
            return
        error = self._stalled() if self._queue.empty() else None
        if error is not None:
            self._queue.put_nowait(error)
            return
        self._arm_watchdog()

    async def _next_watched(self, disconnected: Callable[[], Awaitable[bool]] | None,
                            poll_s: float) -> tuple[int, RequestOutput] | None:
        """The next output; None if the client went away first. Raises the `stalled` error once there is one."""
        while True:
            try:
                return await asyncio.wait_for(self._next(), timeout=poll_s)
            except asyncio.TimeoutError:
                error = self._stalled()
                if error is not None:
                    raise error from None
                if disconnected is not None and await disconnected():
                    return None

    async def _next(self) -> tuple[int, RequestOutput]:
        out = await self._queue.get()
        if isinstance(out, Exception):
            raise out
        index = self._choice[out.request_id]
        if out.is_finished():
            self._finals[index] = out
        return index, out

    async def results(self, disconnected: Callable[[], Awaitable[bool]] | None = None,
                      poll_s: float = DISCONNECT_POLL_S) -> list[RequestOutput] | None:
        """Every final output in choice order; None (after cancelling the rest) if the client went away first.
        Raises the `stalled` error (after cancelling the rest) once there is one."""
        try:
            while len(self._finals) < self.num_choices:
                if await self._next_watched(disconnected, poll_s) is None:
                    logger.info("client disconnected; cancelling %s", _some(self._unfinished_requests()))
                    self.close()
                    return None
        except BaseException:
            self.close()
            raise
        return [self._finals[i] for i in range(self.num_choices)]

    async def succeeded(self, response_id: str, disconnected: Callable[[], Awaitable[bool]]) -> list[RequestOutput]:
        """`results()` for a non-streamed response: an OpenAIError (status 499) if the client left, the first failed
        sequence's error if one failed."""
        outputs = await self.results(disconnected)
        if outputs is None:  # the client left; its sequences were cancelled
            raise OpenAIError(f"client disconnected; request {response_id} was cancelled",
                              status_code=CLIENT_CLOSED_REQUEST)
        failed = next((out for out in outputs if out.status == RequestStatus.FAILED), None)
        if failed is not None:
            raise from_failed_output(failed)
        return outputs

    # ------------------------------------------------------------ closing
    def _unfinished_requests(self) -> list[str]:
        done = {seq_id for seq_id, index in self._choice.items() if index in self._finals}
        return sorted({self._owner[seq_id] for seq_id in self._choice if seq_id not in done})

    def close(self) -> None:
        """Cancel every sequence that has not finished (idempotent, never blocks)."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        left = self._unfinished_requests()
        if left:
            logger.info("request closed early; cancelling %s", _some(left))
            self._cancel(left)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _watch(request: weakref.ref[RoutedRequest]) -> None:
    alive = request()
    if alive is not None:
        alive._watch()


def _some(ids: list[str]) -> str:
    """A bounded description of a list of ids, for one log line."""
    more = f" and {len(ids) - LOGGED_IDS} more" if len(ids) > LOGGED_IDS else ""
    return ", ".join(ids[:LOGGED_IDS]) + more


def _router_callback(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
                     on_final: Callable[[RequestOutput], None]) -> Callable[[RequestOutput], None]:
    """The manager's on_output callback for one request: runs on the manager's threads and never blocks."""

    def on_output(out: RequestOutput) -> None:
        if out.is_finished():
            on_final(out)
        with contextlib.suppress(RuntimeError):  # the event loop is gone: the server is shutting down
            loop.call_soon_threadsafe(queue.put_nowait, out)

    return on_output
