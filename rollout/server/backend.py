"""The bridge between the asyncio server and the threaded ContinuousBatchingManager.

The event loop never blocks on the engine:

- generation goes through the manager's output router: every HTTP request's prompts are submitted with a callback
  (`RoutedRequest.on_output`) that hands each output to the event loop, so no thread waits per request or per
  stream, and the manager batches everything submitted;
- one control thread runs everything that waits on the engine lock (cancel, stats, pause/resume, applying weights,
  resetting the prefix cache); an HTTP `/pause` holds the manager's pause counter (`pause_generation`) across
  requests, and cancel, stats and weight updates keep working while generation is paused (pause -> update -> resume
  is the usual RL sequence);
- weight updates stage on worker threads and commit on the control thread (see `weight_updates`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.manager import ContinuousBatchingManager
from rollout.rl.generator import RolloutGenerator
from rollout.sampling_params import SamplingParams
from rollout.server.errors import OpenAIError
from rollout.server.routing import RoutedRequest
from rollout.server.settings import ServerSettings
from rollout.server.weight_updates import WeightUpdates
from rollout.thread_teams import run_in_fresh_thread

logger = logging.getLogger(__name__)

_PROBE_PARAMS = SamplingParams(max_new_tokens=1, temperature=0.0, do_sample=False, ignore_eos=True)


class BackendClosed(RuntimeError):
    """The server is shutting down or its manager stopped; no result can arrive."""


class ServerBackend:
    """Owns the RolloutGenerator (and so the manager and engine) behind one HTTP server.

    Generate through HTTP: the server's requests are routed to their callbacks, and in-process callers may use the
    manager only with routed requests of their own (`add_request(..., on_output=...)`).
    """

    def __init__(self, model: PreTrainedModel, tokenizer,
                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                 settings: ServerSettings | None = None) -> None:
        self.model = model
        self.settings = settings or ServerSettings()
        self.tokenizer = tokenizer
        # The server owns the model, so the generator runs on it directly (no second copy of the weights).
        self.generator = RolloutGenerator(model, tokenizer=tokenizer, share_weights=True,
                                          continuous_batching_config=continuous_batching_config)
        self.manager: ContinuousBatchingManager = self.generator.manager
        self.manager.start()
        self._control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-server-control")
        self.weights = WeightUpdates(self.generator, self.run_on_control, self.settings)
        self.clock: Callable[[], float] = time.monotonic  # the time source of the pause limit (tests drive it)
        self._paused_at: float | None = None  # clock time of the HTTP /pause holding a manager pause count
        self._closed = False
        self._count_lock = threading.Lock()
        self.finished: Counter[str] = Counter()  # sequences finished, by finish reason ("cancelled", "error" too)
        self.started = time.time()
        self._last_version = 0  # what /health reports once the engine is gone
        self._probe_id: str | None = None  # the /health recovery probe in flight, if any

    # ------------------------------------------------------------ engine facts
    @property
    def engine(self):
        return self.manager.engine

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_positions(self) -> int | None:
        return self.engine.max_positions

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.pool.num_blocks * self.engine.cache.page_size

    @property
    def weight_version(self) -> int:
        engine = self.manager.engine
        if engine is not None:
            self._last_version = engine.weight_version
        return self._last_version

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def pause_overdue(self) -> OpenAIError | None:
        """The 503 for requests parked behind a /pause that has outlasted `pause_timeout_s`, else None: a client
        without a timeout of its own is never left waiting forever."""
        paused_at, limit = self._paused_at, self.settings.pause_timeout_s
        if paused_at is None or self.clock() - paused_at <= limit:
            return None
        return OpenAIError(f"generation has been paused (POST /pause) for over {limit:g} s; this request was "
                           "cancelled: retry after POST /resume", status_code=503, code="generation_paused")

    # ------------------------------------------------------------------ health
    def healthy(self) -> bool:
        """True when /health would answer 200 (see `health`)."""
        return self.health()["status"] == "ok"

    def health(self) -> dict[str, Any]:
        """What /health reports: "ok"; "degraded" while the engine's most recent forward failed (the loop still runs
        and one successful forward makes it "ok" again); "unhealthy" once the loop is gone for good (closed, or died).

        Both non-ok states carry a one-line `reason`. While degraded, each poll queues (if none is in flight) a
        one-token probe request, so a server that stopped getting traffic because of its 503 still learns that
        forwards work again and recovers.
        """
        record = getattr(self.manager.engine, "health", None)
        details: dict[str, Any] = {}
        if record is not None:
            details = {"consecutive_failures": record.consecutive_failures, "last_error": record.last_error,
                       "last_error_time": record.last_error_time, "last_success_time": record.last_success_time}
        if self._closed:
            return {"status": "unhealthy", "reason": "the server is shutting down", **details}
        if not self.manager.is_running():
            fatal = self.manager.fatal_error
            reason = (f"the generation loop died: {fatal!r}" if fatal is not None
                      else "the generation loop is not running")
            return {"status": "unhealthy", "reason": reason, **details}
        if record is not None and record.failing:
            self._probe()
            n = record.consecutive_failures
            reason = (f"the last {n} model forwards failed" if n > 1 else "the last model forward failed") + \
                f"; most recent error: {_one_line(record.last_error)}"
            return {"status": "degraded", "reason": reason, **details}
        return {"status": "ok", **details}

    def _probe(self) -> None:
        """Queue a one-token greedy request whose only purpose is to run a forward (its output is not counted)."""
        if self._probe_id is not None or self.paused:
            return
        rid = f"health-probe-{uuid.uuid4().hex}"
        self._probe_id = rid
        try:
            if self.manager.add_request([0], request_id=rid, sampling_params=_PROBE_PARAMS,
                                        on_output=self._probe_done) is None:
                self._probe_id = None
        except Exception:  # never let a probe break /health
            logger.debug("health probe not queued", exc_info=True)
            self._probe_id = None

    def _probe_done(self, out: RequestOutput) -> None:
        if out.request_id == self._probe_id:
            self._probe_id = None

    # ---------------------------------------------------------------- threads
    async def run_on_control(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` on the control thread (for anything that waits on the engine lock) and await it.

        Each call runs in a thread of its own that ends with it: weight copies use torch's parallel kernels, and a
        long-lived control thread would keep an OpenMP team beside the engine loop's (see rollout.thread_teams)."""
        if self._closed:
            raise BackendClosed("the server is shutting down")
        call = functools.partial(run_in_fresh_thread, functools.partial(fn, *args), "rollout-server-control-op")
        return await asyncio.get_running_loop().run_in_executor(self._control, call)

    def _control_nowait(self, fn: Callable, *args) -> None:
        """Fire-and-forget on the control thread: usable from a cancelled task, where awaiting is not possible."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                self._control.submit(fn, *args)

    # ------------------------------------------------------------- generation
    def submit(self, request_id: str, prompts: Sequence[tuple[list[int], SamplingParams]],
               streaming: bool) -> RoutedRequest:
        """Queue each (prompt ids, params) as manager request `{request_id}-{j}`; read the outputs from the result.

        Cheap (only the manager's inbox lock is taken). If a submission fails half-way, what was queued is cancelled.
        """
        if self._closed:
            raise BackendClosed("the server is shutting down")
        overdue = self.pause_overdue()
        if overdue is not None:
            raise overdue
        routed = RoutedRequest(asyncio.get_running_loop(), self._cancel_nowait, self._count, self.pause_overdue)
        try:
            for j, (prompt_ids, params) in enumerate(prompts):
                rid = f"{request_id}-{j}"
                routed.expect(rid, params.n)
                if self.manager.add_request(prompt_ids, request_id=rid, sampling_params=params, streaming=streaming,
                                            on_output=routed.on_output) is None:
                    raise BackendClosed("the generation loop is stopped; the server is shutting down")
        except BaseException:
            routed.close()
            raise
        return routed

    def _cancel_nowait(self, request_ids: list[str]) -> None:
        self._control_nowait(self._cancel, request_ids)

    def _cancel(self, request_ids: list[str]) -> int:
        """Cancel every live sequence of these manager requests (their CANCELLED outputs reach their callbacks)."""
        cancelled = 0
        for rid in request_ids:
            try:
                cancelled += bool(self.manager.cancel_request(rid))
            except Exception:  # a destroyed manager has nothing left to free
                logger.debug("cancel of %s failed", rid, exc_info=True)
        return cancelled

    def _count(self, out: RequestOutput) -> None:
        """Count one final output by how it ended (called by the router, once per sequence)."""
        reason = "error" if out.status == RequestStatus.FAILED else out.finish_reason or "unknown"
        with self._count_lock:
            self.finished[reason] += 1

    def finished_counts(self) -> dict[str, int]:
        """A consistent copy of `finished` (the router updates it from the manager's threads)."""
        with self._count_lock:
            return dict(self.finished)

    # ------------------------------------------------------------ pause, cache
    def _pause(self) -> bool:
        if not self.paused:
            self.manager.pause_generation()
            self._paused_at = self.clock()
            logger.info("generation paused")
        return True

    def _resume(self) -> bool:
        if self.paused:
            self._paused_at = None
            self.manager.resume_generation()
            logger.info("generation resumed")
        return False

    async def pause(self) -> bool:
        """Park the manager loop at a step boundary; running requests keep their state, new ones queue up."""
        return await self.run_on_control(self._pause)

    async def resume(self) -> bool:
        return await self.run_on_control(self._resume)

    def _reset_prefix_cache(self) -> int:
        with self.manager.pause():
            return self.engine.reset_prefix_cache()

    async def reset_prefix_cache(self) -> int:
        return await self.run_on_control(self._reset_prefix_cache)

    # --------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Fail what is left, stop the loop and free the cache. Idempotent."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self._control.submit(self._resume).result(timeout=10)
        self._closed = True
        self._control.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.manager.stop(hard_stop=True, timeout=10)
        with contextlib.suppress(Exception):
            self.manager.destroy()
        logger.info("rollout server backend closed")


def _one_line(text: str | None, limit: int = 300) -> str:
    """An exception repr squeezed onto one bounded line, for a status reason."""
    flat = " ".join((text or "unknown error").split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."
