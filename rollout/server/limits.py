"""How much a client may send, and how slowly: body size and body pace in the app, header size and header pace in
uvicorn's HTTP protocol.

- `BodyLimits` (ASGI middleware): a body larger than the limit is refused with 413, from its Content-Length before
  any of it is read, or as soon as a chunked body passes the limit; a client that stops sending half-way gets 408
  once `timeout_s` passes without a new piece. Routes in `exempt` (the weight-chunk upload) get the pace rule only
  and bound their body themselves with `read_body`.
- `h11_protocol(header_timeout_s)`: uvicorn's h11 protocol, plus a deadline for the request line and headers (uvicorn
  has none: a client that sends half a header would hold its connection forever). Header size is uvicorn's own
  `h11_max_incomplete_event_size`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout.server.errors import error_response

_CLOSE = {"Connection": "close"}  # the rest of a refused body is never read: the connection cannot be reused


def too_large(limit: int, what: str = "the request body") -> HTTPException:
    return HTTPException(413, f"{what} is larger than this server accepts ({limit} bytes)", headers=_CLOSE)


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


class BodyLimits:
    """Bounds every request body in size (except `exempt` paths) and in pace."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, exempt: Collection[str] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = None if scope["path"] in self.exempt else self.max_bytes
        length = _content_length(Headers(scope=scope))
        if limit is not None and length is not None and length > limit:
            await error_response(413, str(too_large(limit).detail), code="body_too_large",
                                 headers=_CLOSE)(scope, receive, send)
            return
        await self.app(scope, self._paced(receive, limit), send)

    def _paced(self, receive: Receive, limit: int | None) -> Receive:
        """`receive` that raises 408 when the next body piece is late and 413 past `limit` bytes; once the body is
        complete it waits as long as the app likes (a disconnect watch must not time out)."""
        received, done = 0, False

        async def paced_receive() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stalled: nothing arrived for {self.timeout_s:g} s",
                                    headers=_CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit is not None and received > limit:
                    raise too_large(limit)
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return paced_receive


async def read_body(request: Request, limit: int, what: str) -> bytes:
    """The body of a route exempt from BodyLimits' size rule, refused (413) past `limit` bytes: from its
    Content-Length before reading, or while it streams in."""
    length = _content_length(request.headers)
    if length is not None and length > limit:
        raise too_large(limit, what)
    parts, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise too_large(limit, what)
        parts.append(piece)
    return b"".join(parts)


def h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class, closing a connection whose request line and headers take longer than
    `header_timeout_s` (counted from the connection, or from the first byte of a keep-alive connection's next
    request). Pass it as uvicorn's `http=`."""

    class HeaderDeadlineH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._in_request():
                self._arm()
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self._in_request() and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %gs", header_timeout_s)
                self.transport.close()

    return HeaderDeadlineH11Protocol


__all__ = ["BodyLimits", "h11_protocol", "read_body", "too_large"]
