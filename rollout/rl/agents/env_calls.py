"""EnvCalls: environment methods run concurrently, off the thread that steps the engine, each under a timeout.

While one episode waits for its environment (a tool, a sandbox, a remote service), the others must keep generating,
so no environment call runs on the stepping thread. Calls run as tasks on an asyncio loop in a private thread:
`async def` methods are awaited there, plain methods run in a thread pool, so a mix of both works (and so does a sync
wrapper returning a coroutine, as `per_episode` over an async environment does). A call that outlives its timeout is
abandoned with `EnvTimeout`: an async one is cancelled; a sync one cannot be, so it keeps its pool thread until it
returns (its result is dropped).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class EnvTimeout(TimeoutError):
    """An environment call took longer than its timeout."""


class EnvCalls:
    """A private event loop thread and a thread pool for environment calls; `close()` ends both."""

    def __init__(self, max_workers: int, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"env_timeout must be > 0 seconds or None (no limit), got {timeout!r}")
        if max_workers < 1:
            raise ValueError(f"env_workers must be >= 1, got {max_workers!r}")
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="rollout-env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-env-loop", daemon=True)
        self._thread.start()

    def submit(self, calls: list[tuple[Callable | None, tuple]], done: Callable[[concurrent.futures.Future], None]
               ) -> concurrent.futures.Future:
        """Run `fn(*args)` for each (fn, args) in order (None: skipped), each under the timeout; the future holds the
        last call's result or the first error, and `done(future)` runs when it is settled (on the loop's thread)."""
        future = asyncio.run_coroutine_threadsafe(self._sequence(calls), self._loop)
        future.add_done_callback(done)
        return future

    async def _sequence(self, calls: list[tuple[Callable | None, tuple]]) -> Any:
        result = None
        for fn, args in calls:
            if fn is not None:
                result = await self._timed(fn, args)
        return result

    async def _timed(self, fn: Callable, args: tuple) -> Any:
        try:
            return await asyncio.wait_for(self._call(fn, args), self.timeout)
        except asyncio.TimeoutError:
            raise EnvTimeout(f"{_name(fn)} did not return within env_timeout={self.timeout}s") from None

    async def _call(self, fn: Callable, args: tuple) -> Any:
        if inspect.iscoroutinefunction(fn):
            result = fn(*args)
        else:
            result = await self._loop.run_in_executor(self._pool, fn, *args)
        if inspect.isawaitable(result):
            result = await result
        return result

    def close(self) -> None:
        """Cancel what is still running on the loop and stop it; abandoned sync calls finish in their threads."""
        def stop() -> None:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.stop()

        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self._loop.close()


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
