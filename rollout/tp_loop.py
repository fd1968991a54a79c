"""The manager's loop under tensor parallelism: every rank's loop meets the others before each step.

Each iteration all ranks exchange, in one small all-reduce over the CPU group (`rollout.engine.tensor_parallel`):
how many entries rank 0's inbox holds, the strongest stop any rank asked for, and whether any rank (and every rank)
is paused. Then rank 0's entries (submissions, cancellations, KV releases) are broadcast, every rank hands the same
entries to its engine in the same order, and all step together. So the engines stay identical wherever the calls
came from: rank 0 is the only one whose submissions count; a follower's `add_request` only opens the slot its caller
reads (SPMD scripts submit the same requests on every rank and read results on every rank).

A pause holds every rank: no rank steps while any is paused, and `pause_generation` returns once every rank is
paused, so a weight update made on every rank inside its pause lands at one step boundary everywhere. Rank 0 wakes
at least every HEARTBEAT_S, so an idle group keeps meeting well within `cpu_group_timeout`; a rank that died or hung
makes the collective raise, which kills the loop with that error (waiters get a ManagerError).
"""

from __future__ import annotations

import logging

from rollout.engine.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # longest an idle rank 0 waits before meeting the other ranks again
PAUSED_POLL_S = 0.01  # how often ranks meet while some rank is paused
NO_STOP, FLUSH_STOP, HARD_STOP = 0, 1, 2


class TensorParallelLoop:
    """Mixed into ContinuousBatchingManager; uses its condition variable, inbox and flags."""

    _tp: TensorParallelGroup | None
    _all_paused: bool = False  # the last meeting found every rank paused

    @property
    def _follower(self) -> bool:
        return self._tp is not None and not self._tp.is_driver

    def _run_tensor_parallel(self) -> None:
        try:
            while self._meet_and_step():
                pass
            if self._hard_stop:
                self._deliver(self._fail_everything(self._stop_error))
        except BaseException as err:
            logger.exception("tensor-parallel loop died (another rank failed, hung past cpu_group_timeout, or left)")
            self._die(err)

    def _meet_and_step(self) -> bool:
        """One iteration; False once the group stopped."""
        tp = self._tp
        with self._cv:
            if tp.is_driver:  # meet at once for work, or for a pause the other ranks have to see
                self._cv.wait_for(lambda: self._has_loop_work() or (self._pause_count and not self._all_paused),
                                  HEARTBEAT_S)
            paused = self._pause_count > 0
            self._in_step = not paused  # a pause arriving from now on waits for this iteration to end
            stop = HARD_STOP if self._hard_stop else FLUSH_STOP if self._stopping else NO_STOP
            queued = len(self._inbox) if tp.is_driver else 0
        try:
            queued, stop, any_paused, any_running = tp.max_state(queued, stop, int(paused), int(not paused))
            with self._cv:
                self._all_paused = not any_running
                self._cv.notify_all()
            if stop:
                self.signal_stop(stop == HARD_STOP)
            if stop == HARD_STOP:
                return False
            if any_paused:
                with self._cv:
                    self._in_step = False
                    self._cv.wait(PAUSED_POLL_S)
                return True
            return self._apply_and_step(queued, stop)
        finally:
            with self._cv:
                self._in_step = False
                self._cv.notify_all()

    def _apply_and_step(self, queued: int, stop: int) -> bool:
        with self._cv:
            items = [self._inbox.popleft() for _ in range(queued)] if self._tp.is_driver else []
        if queued:
            items = self._tp.broadcast(items)
        with self._engine_lock:
            engine = self._require_engine()
            outputs = [failure for item in items for failure in item.enter(engine)]
            busy = engine.has_unfinished()
            if busy:
                outputs += engine.step()
        self._deliver(outputs)
        return not (stop and not queued and not busy)

    def _wait_until_all_paused(self) -> None:
        """pause_generation under TP: wait for a meeting that finds every rank paused (each rank must pause)."""
        timeout = None if self._tp.timeout is None else self._tp.timeout.total_seconds()
        if not self._cv.wait_for(lambda: (self._all_paused and not self._in_step) or self._fatal is not None
                                 or not self.is_running(), timeout):
            self._pause_count -= 1
            raise RuntimeError(f"pause_generation: the other tensor-parallel ranks did not pause within "
                               f"cpu_group_timeout ({timeout} s); under tensor parallelism every rank must pause (and "
                               "update its weights) together")

    def _queue_event(self, event, request_id: str) -> bool:
        """Queue a cancellation or KV release on rank 0 for every rank's next step (a follower's does nothing);
        whether `request_id` was live here, or queued, when called (a release always counts)."""
        with self._engine_lock:
            engine = self._require_engine()
            known = request_id in engine.requests or request_id in engine.scheduler.groups
        with self._cv:
            known = known or any(getattr(item, "request_id", None) == request_id for item in self._inbox)
            if not self._follower:
                self._inbox.append(event)
                self._cv.notify_all()
        return known or not hasattr(event, "request_id")
