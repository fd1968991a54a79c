"""Stepping in the caller: a thread that waits for its results steps the engine itself instead of the loop thread.

Why: a caller that blocks on its results anyway (a trainer's rollout) steps with its own OpenMP team, so the process
keeps one team and libgomp keeps spin-waiting between parallel regions (see `rollout.thread_teams`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from rollout import thread_teams
from rollout.result_slots import POLL_S

logger = logging.getLogger(__name__)


class CallerStepping:
    """Mixed into ContinuousBatchingManager; uses its condition variable, flags and `_step_once`."""

    @contextlib.contextmanager
    def stepping_in_caller(self) -> Iterator[None]:
        """While this block runs, the calling thread steps the engine whenever it waits for a result (`get_result`,
        iteration, its streams) and the loop thread stays parked: submit and collect inside the block.

        Other threads' requests progress while the caller waits on its own; when the block ends the loop thread takes
        over whatever is left. If another thread is already stepping, or under tensor parallelism (the ranks' loops step
        together), the block changes nothing."""
        me = threading.current_thread()
        with self._cv:
            claimed = self._driver is None and self._tp is None and thread_teams.may_step_here()
            if claimed:
                self._driver = me
        try:
            yield
        finally:
            if claimed:
                with self._cv:
                    self._driver = None
                    self._cv.notify_all()

    def _drive(self, predicate, ready, timeout: float | None) -> bool:
        """Step in this thread until `predicate()` holds (caller holds the cv; released while stepping); False on
        timeout. Pauses are honoured as the loop thread honours them; a hard stop or a dead loop is left to the loop
        thread (it fails what is left), and this thread waits for `ready` like any other."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            remaining = None if deadline is None else deadline - time.monotonic()
            if self._fatal is not None or self._hard_stop:
                return self._cv.wait_for(ready, remaining)
            if remaining is not None and remaining <= 0:
                return False
            if self._pause_count or self._in_step or not (self._inbox or self._require_engine().has_unfinished()):
                # Parked by a pause, the loop finishing a step, or nothing to step: wait for another thread.
                self._cv.wait(remaining if remaining is not None else POLL_S)
                continue
            self._in_step = True
            self._cv.release()
            try:
                self._step_once(follow_submitter=False)
            except BaseException as err:
                logger.exception("continuous batching step died in the calling thread")
                self._die(err)
                self._raise_if_dead()  # a ManagerError from err
                raise
            finally:
                self._cv.acquire()
        return True
