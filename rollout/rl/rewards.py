"""RewardRunner: a group's rewards from the user's reward functions, off the engine's thread and within a timeout.

Reward functions take TRL's calling convention: keyword lists with one entry per completion (`prompts`,
`completions`, `completion_ids`, plus every other column of the prompt's dataset row, repeated), and return one
float per completion. Plain functions run on a small thread pool; `async def` functions run on one event loop thread,
so thousands of awaiting calls (a sandbox, a judge model behind HTTP) cost no threads. A function that raises, returns
the wrong number of values, or runs past the timeout fails that group alone with a RewardError.

A plain function that hangs cannot be interrupted: its thread stays busy until it returns, and later groups queue
behind the others. Give slow plain functions a timeout of their own, or write them `async`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence

RewardFunction = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """A reward function failed for one group (it raised, hung past the timeout, or returned bad values)."""


def reward_name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardRunner:
    """Runs every reward function on one group; `close()` ends its threads."""

    def __init__(self, reward_funcs: RewardFunction | Sequence[RewardFunction], weights: Sequence[float] | None = None,
                 timeout: float | None = 60.0, workers: int = 4) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if not funcs or not all(callable(f) for f in funcs):
            raise ValueError("reward_funcs must be a callable or a non-empty list of callables")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"reward_timeout must be > 0 seconds or None, got {timeout!r}")
        self.funcs, self.weights, self.timeout = funcs, weights, timeout
        self.names = [reward_name(f) for f in funcs]
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="rollout-reward")
        self._loop: asyncio.AbstractEventLoop | None = None
        if any(_is_async(f) for f in funcs):
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="rollout-reward-loop", daemon=True).start()

    def score(self, columns: Mapping[str, list]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per completion, each function's values by name) for one group; RewardError on failure.

        `columns` holds the keyword lists the functions get (all of one length: the group's completions)."""
        size = len(columns["completions"])
        futures = [self._start(fn, columns) for fn in self.funcs]
        per_function: dict[str, list[float]] = {}
        try:
            for name, future in zip(self.names, futures):
                try:
                    values = future.result(timeout=self.timeout)
                except concurrent.futures.TimeoutError:
                    raise RewardError(f"reward function {name!r} ran past reward_timeout={self.timeout:g}s") from None
                except Exception as err:
                    raise RewardError(f"reward function {name!r} raised {type(err).__name__}: {err}") from err
                per_function[name] = _floats(name, values, size)
        finally:
            for future in futures:
                future.cancel()
        totals = [sum(w * per_function[name][i] for w, name in zip(self.weights, self.names)) for i in range(size)]
        return totals, per_function

    def _start(self, fn: RewardFunction, columns: Mapping[str, list]) -> concurrent.futures.Future:
        if self._loop is not None and _is_async(fn):
            return asyncio.run_coroutine_threadsafe(fn(**columns), self._loop)
        return self._pool.submit(fn, **columns)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _is_async(fn: RewardFunction) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _floats(name: str, values, size: int) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward function {name!r} must return one float per completion: {err}") from None
    if len(out) != size:
        raise RewardError(f"reward function {name!r} returned {len(out)} values for {size} completions")
    if not all(math.isfinite(v) for v in out):
        raise RewardError(f"reward function {name!r} returned a value that is not finite: {out}")
    return out
