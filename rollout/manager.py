"""ContinuousBatchingManager: a background thread that steps the engine, plus the request lifecycle around it.

Concurrency model: callers never touch the engine while it steps. Submissions go to an inbox the loop drains between
steps; cancellation and stats take the engine lock, which the loop holds only during a step, so they act at the next
step boundary. Pausing is a counter, not a lock: `pause()` (or `pause_generation()`/`resume_generation()` from any
thread) parks the loop between two steps, and cancel, stats and weight copies still work while it is parked.

A request submitted with `on_output` has its outputs pushed to that callback (`rollout.output_router`). Other results
land in per-request slots (`rollout.result_slots`). If the loop thread dies, every waiter is
woken and gets the error, and every routed sequence gets a final SHUTDOWN failure.

Interpreter exit: every started manager is registered with `rollout.interpreter_exit`, which hard-stops the loops
before the interpreter tears threads down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from rollout import interpreter_exit, thread_teams
from rollout.caller_stepping import CallerStepping
from rollout.config import ContinuousBatchingConfig
from rollout.engine.core.request import ErrorKind, RequestOutput, sequence_ids
from rollout.engine.core.stats import EngineStats
from rollout.engine.engine import LLMEngine, release_device_memory
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.worker.warm_up import WarmUp, warm_up
from rollout.output_router import OutputCallback, OutputRouter
from rollout.result_slots import ResultSlots
from rollout.sampling_params import SamplingParams
from rollout.submission import Cancellation, KVRelease, Submission, with_overrides
from rollout.tp_loop import TensorParallelLoop

logger = logging.getLogger(__name__)

_HARD_STOP_ERROR = "RuntimeError: the manager was hard-stopped"
_DESTROYED_ERROR = "RuntimeError: the manager was destroyed before this request finished"


class ManagerError(RuntimeError):
    """The manager cannot serve: its loop thread died, or it was destroyed."""


class ContinuousBatchingManager(CallerStepping, TensorParallelLoop):
    """Runs continuous batching in a background thread; submit, stream, cancel and collect from any thread.
    Under tensor parallelism every rank runs one, and the ranks' loops step together (rollout.tp_loop)."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, tokenizer=None,
                 tokens_hint: int | None = None) -> None:
        self.model = model
        self.engine: LLMEngine | None = LLMEngine(model, generation_config, continuous_batching_config, tokens_hint,
                                                  tokenizer)
        self._engine_lock = threading.RLock()
        self._cv = threading.Condition()  # guards everything below and wakes the loop and readers
        self._inbox: deque[Submission | Cancellation | KVRelease] = deque()
        self._tp = self.engine.tp_group
        self._slots = ResultSlots(self._cv, self._wait_for, self._raise_if_dead,
                                  lambda: self._driver is threading.current_thread(), keep_unclaimed=self._follower)
        self._router = OutputRouter()  # callbacks of requests submitted with on_output
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stopping = False
        self._hard_stop = False
        self._stop_error = _HARD_STOP_ERROR  # what a hard stop tells the requests it fails
        self._destroyed = False
        self._fatal: BaseException | None = None
        self._pause_count = 0
        self._in_step = False
        self._driver: threading.Thread | None = None  # a thread stepping the engine itself (stepping_in_caller)
        self._threads = 0  # intra-op threads of the last submitter, which the loop adopts (0: leave torch's)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start (or restart after `stop`) the background loop."""
        with self._cv:
            if self._destroyed:
                raise ManagerError("this manager was destroyed and cannot be restarted; create a new one")
            if self._fatal is not None:
                raise ManagerError(f"the manager's loop died earlier: {self._fatal!r}") from self._fatal
            if self.is_running():
                return
            self._accepting, self._stopping, self._hard_stop = True, False, False
            self._stop_error = _HARD_STOP_ERROR
            interpreter_exit.track(self)
            self._thread = threading.Thread(target=self._run, name="rollout-cb-loop", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def fatal_error(self) -> BaseException | None:
        """What killed the loop thread, if it died (the manager cannot serve again then)."""
        return self._fatal

    def stop(self, hard_stop: bool = False, timeout: float | None = None) -> None:
        """Stop accepting work; finish queued and active requests (or fail them at once with hard_stop); end the
        loop."""
        self.signal_stop(hard_stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            if not self.join(timeout):
                logger.warning("manager loop still running after stop(timeout=%s)", timeout)
        elif hard_stop and self.engine is not None:
            self._deliver(self._fail_everything(self._stop_error))

    def join(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` seconds) for the loop thread to end; True once it is not running."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return not self.is_running()

    def signal_stop(self, hard_stop: bool, error: str | None = None) -> None:
        """Tell the loop to stop at its next step boundary, without waiting for it (`join` waits); a hard stop fails
        what is left with `error`."""
        with self._cv:
            self._accepting = False
            self._stopping = True
            if hard_stop and not self._hard_stop and error is not None:
                self._stop_error = error
            self._hard_stop = self._hard_stop or hard_stop
            self._cv.notify_all()

    def destroy(self) -> None:
        """Stop if needed and free the KV cache (on CUDA back to the driver); the manager cannot be restarted."""
        if self._destroyed:
            return
        self.stop(hard_stop=False)
        with self._cv:
            self._destroyed = True
        if self.engine is not None and self._fatal is None:  # a loop that never ran leaves requests: fail them
            self._deliver(self._fail_everything(_DESTROYED_ERROR))
        with self._engine_lock:
            self.engine = None
        release_device_memory(next(self.model.parameters()).device)

    def __del__(self):  # pragma: no cover - best effort
        # Only a stopped (or never started) manager gets here (a running loop keeps it alive): fail what is queued.
        with contextlib.suppress(Exception):
            self.stop(hard_stop=True, timeout=1.0)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Park the loop between two steps (requests stay in flight) so weights can be changed safely."""
        self.pause_generation()
        try:
            yield
        finally:
            self.resume_generation()

    def pause_generation(self) -> None:
        """Park the loop at the next step boundary and return once it is parked. Pauses nest; any thread may resume."""
        with self._cv:
            self._pause_count += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: not self._in_step)
            if self._tp is not None and self.is_running():
                self._wait_until_all_paused()

    def resume_generation(self) -> None:
        with self._cv:
            if self._pause_count == 0:
                raise RuntimeError("resume_generation() without a matching pause_generation()")
            self._pause_count -= 1
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._pause_count > 0

    # -------------------------------------------------------------- submission
    def add_request(self, input_ids: Sequence[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, sampling_params: SamplingParams | ResolvedSampling | None = None,
                    on_output: OutputCallback | None = None, keep_kv: bool = False, continues: str | None = None,
                    **overrides) -> str | None:
        """Queue one prompt; returns its id (None if the manager was stopped: the request is dropped with a warning).

        `overrides` are SamplingParams fields (temperature=..., top_p=..., seed=..., n=...). An n-sample request
        yields outputs with ids `{id}#{i}` (see `sequence_ids`). With `on_output`, the request is routed: the callback
        gets every output of its sequences (partials too when `streaming`), ending with one final output per sequence,
        failures included (`error_kind` says why); `get_result` and `request_id_iter` do not know such a request.
        `keep_kv` and `continues` carry a conversation's KV from one request to the next (`LLMEngine.add_request`);
        free what a kept sequence holds with `release_kv`. Settings already resolved (`engine.validate_sampling`,
        for many requests alike) are used as they are and take no overrides."""
        params = with_overrides(sampling_params, max_new_tokens=max_new_tokens, **overrides)
        with self._cv:
            self._check_usable()
            if not self._accepting:
                logger.warning("manager is stopped; dropping request %r (call start() to accept work again)",
                               request_id)
                return None
            if request_id is None:
                request_id = self._require_engine().new_request_id()
            ids = sequence_ids(request_id, params.n)
            taken = [rid for rid in ids if self._slots.in_use(rid) or rid in self._router]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in use by a request that has not been "
                                 "collected; pass a unique request_id or None")
            if on_output is not None:
                self._router.register(ids, on_output)
            else:
                self._slots.open(ids, streaming)
            early = self._slots.claim(ids)  # a TP follower: rank 0's copy of this request may have run already
            if not self._follower:
                self._inbox.append(Submission(request_id, list(input_ids), params, streaming, keep_kv, continues))
            self._threads = torch.get_num_threads()  # the loop steps with the submitter's intra-op thread count
            self._cv.notify_all()
        self._deliver(early)
        return request_id

    def add_requests(self, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                     streaming: bool = False, sampling_params: SamplingParams | None = None,
                     **overrides) -> list[str]:
        """Queue many prompts, submitted in sorted order so shared prefixes meet in the cache; ids in input order."""
        with self._cv:
            engine = self._require_engine()
            ids = [engine.new_request_id() for _ in inputs]
        for i in sorted(range(len(inputs)), key=lambda i: list(inputs[i])):
            self.add_request(inputs[i], ids[i], max_new_tokens, streaming, sampling_params, **overrides)
        return ids

    def cancel_request(self, request_id: str) -> bool:
        """Cancel a queued or running request and free its blocks now; False if it is unknown or already done.
        Under tensor parallelism rank 0's cancellation acts at the next step on every rank (others' do nothing)."""
        if self._tp is not None:
            return self._queue_event(Cancellation(request_id), request_id)
        with self._engine_lock:
            engine = self._require_engine()
            rejected = self._drain_inbox(engine)
            outputs = engine.cancel(request_id)
        self._deliver(rejected + outputs)
        return bool(outputs)

    def release_kv(self, sequence_id: str) -> bool:
        """Free the KV a finished `keep_kv` sequence still holds (False if none: see `LLMEngine.release_kept`)."""
        if self._tp is not None:
            return self._queue_event(KVRelease(sequence_id), sequence_id)
        with self._engine_lock:
            engine = self._require_engine()
            rejected = self._drain_inbox(engine)  # a continuation still queued takes the KV before it is freed
            released = engine.release_kept(sequence_id)
        self._deliver(rejected)
        return released

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until `predicate()` holds (False after `timeout` seconds), stepping the engine meanwhile if this
        thread is `stepping_in_caller`. The predicate is re-checked after every step and every `notify()`: whoever
        makes it true from another thread without an engine step calls `notify()`."""
        with self._cv:
            return self._wait_for(predicate, timeout)

    def notify(self) -> None:
        """Wake `wait_until` callers so they re-check their predicates."""
        with self._cv:
            self._cv.notify_all()

    # ----------------------------------------------------------------- results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> RequestOutput | None:
        """The next finished output, or the one for `request_id`; waits up to `timeout` (None: forever), then None.
        Waiting for one id never disturbs results of others."""
        return self._slots.get(request_id, timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        """Yield outputs as they finish until every submitted non-streaming request has been collected."""
        return self._slots.drain()

    def request_id_iter(self, request_id: str) -> Iterator[RequestOutput]:
        """Partial outputs of a streaming request as tokens arrive, ending with its final output."""
        return self._slots.stream(request_id)

    def warm_up(self, max_tokens: int) -> WarmUp:
        """Run one throwaway step per row bucket up to `max_tokens` prompt tokens before serving (rollout.engine.
        warm_up), on the calling thread; the engine is left as it was. A RuntimeError if requests are already in."""
        with self._engine_lock:
            if self._inbox:
                raise RuntimeError("warm_up needs an idle manager: requests were already submitted; warm up first")
            return warm_up(self._require_engine(), max_tokens)

    def stats(self) -> EngineStats:
        with self._engine_lock:
            stats = self._require_engine().stats()
        with self._cv:
            return dataclasses.replace(stats, queued=len(self._inbox), uncollected=self._slots.uncollected)

    # -------------------------------------------------------------------- loop
    def _run(self) -> None:
        if self._tp is not None:
            return self._run_tensor_parallel()
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(self._has_loop_work)
                    if self._hard_stop:
                        break
                    self._in_step = True
                if self._step_once(follow_submitter=True):
                    break
            if self._hard_stop:
                self._deliver(self._fail_everything(self._stop_error))
        except BaseException as err:  # the loop died: fail everyone promptly instead of letting them hang
            logger.exception("continuous batching loop died")
            self._die(err)

    def _step_once(self, follow_submitter: bool) -> bool:
        """One engine step (the caller set `_in_step`); delivers its outputs. True when a stop has drained the work."""
        drained = False
        try:
            with self._engine_lock:
                engine = self._require_engine()
                outputs = self._drain_inbox(engine)
                if engine.has_unfinished():
                    if follow_submitter:
                        thread_teams.adopt_thread_count(self._threads)
                    outputs += engine.step()
                else:
                    drained = self._stopping
        finally:
            with self._cv:
                self._in_step = False
                self._cv.notify_all()
        self._deliver(outputs)  # outside the engine lock: see _deliver
        return drained

    def _die(self, err: BaseException) -> None:
        """The stepping thread hit an error no request explains: fail everyone promptly, refuse new work."""
        with self._cv:
            self._fatal = err
            self._accepting = False
        error = f"the manager's loop died: {err!r}"
        failed: list[RequestOutput] = []
        with contextlib.suppress(Exception):
            failed = self._fail_everything(error)  # frees blocks; waiters raise instead of getting these
        with self._cv:
            self._slots.wake_streams()
            self._cv.notify_all()
        self._router.fail_all(failed, error)

    def _has_loop_work(self) -> bool:
        if self._hard_stop:
            return True
        if self._pause_count or self._driver is not None:
            return False
        if self._stopping:
            return True
        return bool(self._inbox) or (self.engine is not None and self.engine.has_unfinished())

    def _drain_inbox(self, engine: LLMEngine) -> list[RequestOutput]:
        """Hand queued requests to the engine (caller holds the engine lock); returns the outputs of those it refused,
        for the caller to deliver once it released the lock."""
        with self._cv:
            items, self._inbox = list(self._inbox), deque()
        return [failure for item in items for failure in item.enter(engine)]

    def _fail_everything(self, error: str) -> list[RequestOutput]:
        with self._engine_lock:
            with self._cv:
                items, self._inbox = list(self._inbox), deque()
            outputs = [failure for item in items for failure in item.failures(error, ErrorKind.SHUTDOWN, False)]
            if self.engine is not None:
                outputs += self.engine.fail_all(error)
            return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Routed outputs to their callbacks, the rest to the slots `get_result` and streams read. Never called with
        the engine lock held, so a callback may call `cancel_request` or `add_request`."""
        if not outputs:
            return
        unrouted = self._router.route(outputs)
        with self._cv:
            self._slots.put(unrouted)
            self._cv.notify_all()

    # ----------------------------------------------------------------- helpers
    def _wait_for(self, predicate, timeout: float | None) -> bool:
        """cv.wait_for that also wakes up with an error if the loop thread is dead (caller holds the cv)."""
        def ready():
            return predicate() or self._fatal is not None or self._loop_gone_with_work()
        if self._driver is threading.current_thread():
            done = self._drive(predicate, ready, timeout)
        else:
            done = self._cv.wait_for(ready, timeout)
        if predicate():
            return True
        self._raise_if_dead()
        if self._loop_gone_with_work():
            raise ManagerError("the manager is not running (call start()); results cannot arrive")
        return done and predicate()

    def _loop_gone_with_work(self) -> bool:
        return self._thread is not None and not self._thread.is_alive() and self._slots.nothing_to_collect()

    def _raise_if_dead(self) -> None:
        if self._fatal is not None:
            raise ManagerError(f"the manager's loop died: {self._fatal!r}") from self._fatal

    def _check_usable(self) -> None:
        if self._destroyed:
            raise ManagerError("this manager was destroyed; create a new one")
        self._raise_if_dead()

    def _require_engine(self) -> LLMEngine:
        if self.engine is None:
            raise ManagerError("this manager was destroyed; create a new one")
        return self.engine

