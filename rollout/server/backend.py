"""The bridge between the asyncio server and the threaded ContinuousBatchingManager.

Three kinds of threads, so the event loop never blocks on the engine:

- one collector thread takes every finished non-streaming output (`get_result()` without an id) and resolves the
  asyncio future of its request: one waiter for any number of requests (per-request waiters on the manager's
  condition variable would all wake at every step). Streaming sequences each get a pump thread from a bounded pool
  that iterates `request_id_iter` into an asyncio queue. The manager batches everything submitted whatever the
  number of threads, so no request is serialized behind another;
- one control thread runs everything that waits on the engine lock (cancel, stats, pause/resume, applying weights,
  resetting the prefix cache), so none of it blocks the event loop or a worker pool; an HTTP `/pause` holds the
  manager's pause counter (`pause_generation`) across requests, and cancel, stats and weight updates keep working
  while generation is paused (pause -> update -> resume is the usual RL sequence);
- staging a weight update (reading files, validating, converting dtypes) runs on ordinary worker threads, so it
  never delays a cancel or a metrics scrape; only the final in-place copy runs on the control thread, under pause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.request import RequestOutput, RequestStatus
from rollout.manager import ContinuousBatchingManager, sequence_ids
from rollout.rl.generator import RolloutGenerator
from rollout.rl.weights import WeightUpdateError, apply_staged, normalize_name, stage_update
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ON_UPDATE_MODES = ("keep", "recompute")
UPDATE_SESSION_TTL_S = 3600.0


class BackendClosed(RuntimeError):
    """The server is shutting down or its manager died; no result can arrive."""


@dataclass
class UpdateSession:
    """A chunked weight upload: each chunk is validated and staged on arrival; commit applies them all at once."""

    update_id: str
    created: float = field(default_factory=time.monotonic)
    staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    num_tensors: int = 0
    num_chunks: int = 0
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class ServerBackend:
    """Owns the RolloutGenerator (and so the manager and engine) behind one HTTP server.

    The collector consumes every non-streaming result of the manager, so in-process code must not call
    `generator.generate` / `manager.get_result` on a served manager (their results would be taken); use the HTTP API.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, continuous_batching_config: ContinuousBatchingConfig | None
                 = None, max_streams: int = 512) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # The server owns the model, so the generator runs on it directly (no second copy of the weights).
        self.generator = RolloutGenerator(model, tokenizer=tokenizer, share_weights=True,
                                          continuous_batching_config=continuous_batching_config)
        self.manager: ContinuousBatchingManager = self.generator.manager
        self.manager.start()
        self._control = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-server-control")
        # One pump thread per streaming sequence; past `max_streams` pumps queue (their outputs wait in the manager).
        self._pumps = concurrent.futures.ThreadPoolExecutor(max_streams, thread_name_prefix="rollout-server-pump")
        self._paused = False  # whether an HTTP /pause holds one of the manager's pause counts
        self._sessions: dict[str, UpdateSession] = {}
        self._sessions_lock = threading.Lock()
        self._closed = False
        self._count_lock = threading.Lock()
        self.finished = Counter()  # sequences finished, by finish reason ("cancelled" and "error" included)
        self._expected: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._early: dict[str, RequestOutput] = {}  # results that arrived before anyone waited for them
        self._abandoned: set[str] = set()  # submitted, but nobody will wait: drop their results
        self._collector_lock = threading.Lock()
        self._collector_error: BaseException | None = None
        self._collector = threading.Thread(target=self._collect, name="rollout-server-collect", daemon=True)
        self._collector.start()
        self.counters = Counter()  # weight_updates, weight_update_failures, ...
        self._rate_sample: tuple[float, int] = (time.monotonic(), 0)
        self.started = time.time()
        self._last_version = 0  # what /health reports once the engine is gone

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
        return self._paused

    def healthy(self) -> bool:
        return not self._closed and self.manager.is_running()

    # ---------------------------------------------------------------- threads
    async def _on_control(self, fn: Callable, *args) -> Any:
        if self._closed:
            raise BackendClosed("the server is shutting down")
        return await asyncio.get_running_loop().run_in_executor(self._control, fn, *args)

    def _control_nowait(self, fn: Callable, *args) -> None:
        """Fire-and-forget on the control thread: usable from a cancelled task, where awaiting is not possible."""
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                self._control.submit(fn, *args)

    # ------------------------------------------------------------- generation
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, streaming: bool) -> list[str]:
        """Queue one prompt (n sequences); returns the sequence ids. Cheap: only the manager's inbox lock is taken."""
        if self._closed:
            raise BackendClosed("the server is shutting down")
        rid = self.manager.add_request(prompt_ids, request_id=request_id, sampling_params=params, streaming=streaming)
        if rid is None:
            raise BackendClosed("the manager is stopped")
        return sequence_ids(rid, params.n)

    async def results(self, seq_ids: list[str], disconnected: Callable[[], Any] | None = None,
                      poll_s: float = 0.5) -> list[RequestOutput] | None:
        """Final outputs of the sequences, in order; None (after cancelling them) if the client went away first."""
        loop = asyncio.get_running_loop()
        gathered = asyncio.gather(*[self._expect(rid, loop) for rid in seq_ids])
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=poll_s if disconnected else None)
                if done:
                    outputs = gathered.result()
                    self._count(outputs)
                    return outputs
                if disconnected is not None and await disconnected():
                    logger.info("client disconnected; cancelling %s", seq_ids)
                    await self.cancel(seq_ids)
                    return None
        except asyncio.CancelledError:
            self._control_nowait(self._cancel_all, seq_ids)
            raise

    def _expect(self, rid: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        future = loop.create_future()
        with self._collector_lock:
            if self._collector_error is not None:
                future.set_exception(BackendClosed(f"no results can arrive: {self._collector_error}"))
            elif rid in self._early:
                future.set_result(self._early.pop(rid))
            else:
                self._expected[rid] = (loop, future)
        return future

    def abandon(self, seq_ids: Iterable[str]) -> None:
        """Cancel sequences nobody will wait for (a submission that failed half-way) and drop their results."""
        seq_ids = list(seq_ids)
        with self._collector_lock:
            for rid in seq_ids:
                if self._early.pop(rid, None) is None:
                    self._abandoned.add(rid)
        self._control_nowait(self._cancel_all, seq_ids)

    def _collect(self) -> None:
        """Route every finished non-streaming output to the future of its request."""
        try:
            while not self._closed:
                out = self.manager.get_result(timeout=0.5)
                if out is None:
                    continue
                with self._collector_lock:
                    waiter = self._expected.pop(out.request_id, None)
                    if waiter is None and out.request_id not in self._abandoned:
                        self._early[out.request_id] = out
                    self._abandoned.discard(out.request_id)
                if waiter is not None:
                    _resolve(waiter, out)
        except BaseException as err:  # the manager died or was destroyed: fail every waiter now
            if not self._closed:
                logger.exception("result collector stopped")
            with self._collector_lock:
                self._collector_error = err
                waiters, self._expected = list(self._expected.values()), {}
            for waiter in waiters:
                _resolve(waiter, BackendClosed(f"generation stopped: {err!r}"))

    def open_stream(self, seq_ids: list[str]) -> OutputStream:
        """Start pumping the sequences' partial outputs now; iterate the result for (choice index, output).

        Pumps start before anyone iterates, so the manager's per-request queues are always drained. Closing the
        stream (or dropping it) before every sequence finished cancels the rest and frees their blocks.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: server shutting down
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump(index: int, rid: str) -> None:
            try:
                for out in self.manager.request_id_iter(rid):
                    put((index, out, None))
            except BaseException as err:  # a dead manager: tell the consumer instead of leaving it waiting
                put((index, None, err))

        for i, rid in enumerate(seq_ids):
            self._pumps.submit(pump, i, rid)
        return OutputStream(self, queue, seq_ids)

    def _cancel_all(self, seq_ids: Iterable[str]) -> int:
        cancelled = 0
        for rid in seq_ids:
            try:
                if self.manager.cancel_request(rid):
                    cancelled += 1
                    with self._count_lock:  # its final output goes to nobody: count it here
                        self.finished["cancelled"] += 1
            except Exception:  # a destroyed manager has nothing left to free
                logger.debug("cancel of %s failed", rid, exc_info=True)
        return cancelled

    async def cancel(self, seq_ids: list[str]) -> int:
        return await self._on_control(self._cancel_all, seq_ids)

    def _count(self, outputs: Iterable[RequestOutput]) -> None:
        with self._count_lock:
            for out in outputs:
                if out.status == RequestStatus.CANCELLED:
                    continue  # counted by _cancel_all, which is where every cancellation comes from
                self.finished["error" if out.status == RequestStatus.FAILED else out.finish_reason or "unknown"] += 1

    # ------------------------------------------------------------ pause, stats
    def _pause(self) -> bool:
        if not self._paused:
            self.manager.pause_generation()
            self._paused = True
            logger.info("generation paused")
        return True

    def _resume(self) -> bool:
        if self._paused:
            self._paused = False
            self.manager.resume_generation()
            logger.info("generation resumed")
        return False

    async def pause(self) -> bool:
        """Park the manager loop at a step boundary; running requests keep their state, new ones queue up."""
        return await self._on_control(self._pause)

    async def resume(self) -> bool:
        return await self._on_control(self._resume)

    async def stats(self) -> dict:
        stats = await self._on_control(self.manager.stats)
        now = time.monotonic()
        then, tokens = self._rate_sample
        stats["tokens_per_second"] = (stats["generated_tokens"] - tokens) / max(now - then, 1e-9)
        self._rate_sample = (now, stats["generated_tokens"])
        stats["paused"] = self.paused
        return stats

    def _reset_prefix_cache(self) -> int:
        with self.manager.pause():
            return self.engine.reset_prefix_cache()

    async def reset_prefix_cache(self) -> int:
        return await self._on_control(self._reset_prefix_cache)

    # ---------------------------------------------------------------- weights
    def _apply(self, staged: list[tuple[torch.Tensor, torch.Tensor]], on_update: str) -> int:
        """The in-place copy and version bump, at a step boundary (the same steps as RolloutGenerator.update_weights,
        split so that only this part runs on the control thread)."""
        with self.manager.pause():
            apply_staged(staged)
            engine = self.engine
            engine.set_weight_version(engine.weight_version + 1, recompute=on_update == "recompute")
            return engine.weight_version

    async def _commit_staged(self, staged: list[tuple[torch.Tensor, torch.Tensor]], on_update: str) -> int:
        version = await self._on_control(self._apply, staged, on_update)
        self.counters["weight_updates"] += 1
        logger.info("weights updated to version %d (%d tensors)", version, len(staged))
        return version

    @staticmethod
    def check_on_update(on_update: str) -> None:
        if on_update not in ON_UPDATE_MODES:
            raise WeightUpdateError(f"on_update must be one of {ON_UPDATE_MODES}, got {on_update!r}")

    async def update_from_path(self, path: str, on_update: str = "keep") -> int:
        """Load every *.safetensors file in `path` (or the one file), validate all, then apply atomically."""
        self.check_on_update(on_update)
        loop = asyncio.get_running_loop()
        try:
            staged = await loop.run_in_executor(None, lambda: stage_update(self.model, _iter_safetensors(path)))
        except WeightUpdateError:
            self.counters["weight_update_failures"] += 1
            raise
        return await self._commit_staged(staged, on_update)

    def begin_update(self) -> str:
        now = time.monotonic()
        with self._sessions_lock:
            for uid in [u for u, s in self._sessions.items() if now - s.created > UPDATE_SESSION_TTL_S]:
                logger.warning("dropping stale weight update session %s", uid)
                del self._sessions[uid]
            update_id = uuid.uuid4().hex
            self._sessions[update_id] = UpdateSession(update_id)
        return update_id

    def _session(self, update_id: str | None, pop: bool = False) -> UpdateSession:
        with self._sessions_lock:
            session = self._sessions.pop(update_id, None) if pop else self._sessions.get(update_id)
        if session is None:
            raise WeightUpdateError(f"unknown weight update id {update_id!r}: begin one with POST "
                                    "/update_weights/begin (sessions end at commit or abort)")
        return session

    def _stage_chunk(self, session: UpdateSession, body: bytes) -> int:
        with session.lock:
            if session.error is not None:
                raise WeightUpdateError(f"this update already failed: {session.error}")
            try:
                from safetensors.torch import load

                try:
                    tensors = load(body)
                except Exception as err:  # safetensors raises its own error types for bad headers
                    raise WeightUpdateError(f"chunk {session.num_chunks} is not a safetensors file: {err}") from err
                session.num_tensors += len(tensors)
                if any(normalize_name(name) is not None for name in tensors):  # adapter-only chunks stage nothing
                    for target, value in stage_update(self.model, tensors):
                        session.staged[target.data_ptr()] = (target, value)
                session.num_chunks += 1
            except WeightUpdateError as err:
                session.error = str(err)  # poisoned: commit will refuse, old weights stay
                raise
            return session.num_tensors

    async def add_chunk(self, update_id: str | None, body: bytes) -> int:
        """Validate and stage one safetensors chunk; returns tensors received so far."""
        session = self._session(update_id)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._stage_chunk, session, body)
        except WeightUpdateError:
            self.counters["weight_update_failures"] += 1
            raise

    async def commit_update(self, update_id: str | None, on_update: str = "keep",
                            num_tensors: int | None = None) -> int:
        """Apply every staged chunk at once, or nothing: returns the new weight version."""
        self.check_on_update(on_update)
        session = self._session(update_id, pop=True)
        with session.lock:
            if session.error is not None:
                raise WeightUpdateError(f"the update was rejected: {session.error}")
            if num_tensors is not None and num_tensors != session.num_tensors:
                raise WeightUpdateError(f"the client sent {num_tensors} tensors but {session.num_tensors} arrived "
                                        f"in {session.num_chunks} chunks; refusing a partial update")
            if not session.staged:
                raise WeightUpdateError("the update contained no weights of the generation model")
            staged = list(session.staged.values())
        return await self._commit_staged(staged, on_update)

    def abort_update(self, update_id: str | None) -> None:
        self._session(update_id, pop=True)

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
        self._pumps.shutdown(wait=False, cancel_futures=True)
        self._collector.join(timeout=2)
        logger.info("rollout server backend closed")


class OutputStream:
    """Async iterator of (choice index, RequestOutput) for one streaming request.

    Cancellation must not depend on the iterator having started or on awaiting anything (a disconnected client's
    task is cancelled, and a response that never began never iterates), so `close()` is synchronous and also runs
    when the stream is garbage-collected.
    """

    def __init__(self, backend: ServerBackend, queue: asyncio.Queue, seq_ids: list[str]) -> None:
        self._backend = backend
        self._queue = queue
        self._seq_ids = seq_ids
        self._remaining = set(range(len(seq_ids)))
        self._closed = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._remaining or self._closed:
            raise StopAsyncIteration
        try:
            index, out, err = await self._queue.get()
        except BaseException:  # cancelled while waiting: the client went away
            self.close()
            raise
        if err is not None:
            self.close()
            raise BackendClosed(f"generation stopped: {err}") from err
        if out.is_finished():
            self._remaining.discard(index)
            self._backend._count([out])
        return index, out

    def close(self) -> None:
        """Cancel every sequence that has not finished (idempotent, never blocks)."""
        if self._closed:
            return
        self._closed = True
        if self._remaining:
            left = [self._seq_ids[i] for i in sorted(self._remaining)]
            logger.info("stream closed early; cancelling %s", left)
            self._backend._control_nowait(self._backend._cancel_all, left)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _resolve(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future], value: Any) -> None:
    """Complete an asyncio future from another thread (a no-op if it was cancelled or its loop is gone)."""
    loop, future = waiter

    def done() -> None:
        if not future.done():
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(done)


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a checkpoint directory's *.safetensors files, read one tensor at a time."""
    from safetensors import safe_open

    root = Path(path)
    if root.is_file() and root.suffix == ".safetensors":
        files = [root]
    elif root.is_dir():
        files = sorted(root.glob("*.safetensors"))
    else:
        raise WeightUpdateError(f"{path!r} is neither a directory nor a .safetensors file on the server")
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {path!r} (save with save_pretrained(..., "
                                "safe_serialization=True))")
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:
            raise WeightUpdateError(f"cannot read {file.name}: {err}") from err
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
