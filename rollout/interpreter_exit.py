"""Stopping manager loops before the interpreter tears threads down.

A manager's loop is a daemon thread, and Python (<= 3.13) ends a daemon thread that is still inside a torch op at
teardown with `pthread_exit`, whose forced unwind through a C++ destructor (torch releasing the GIL) aborts the whole
process ("terminate called without an active exception", exit code 134). So every started manager is kept in a weak
registry, and an atexit hook hard-stops their loops (bounded join) first: each finishes the step it is in and fails
what is left, and the process exits with the script's own status.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class StoppableLoop(Protocol):
    """What interpreter exit needs of a loop (ContinuousBatchingManager has it): this module sits below the manager
    and never imports it."""

    def is_running(self) -> bool: ...

    def signal_stop(self, hard_stop: bool, error: str | None = None) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...

EXIT_JOIN_TIMEOUT_S = 30.0  # how long interpreter exit waits for the loops to finish their current step
EXIT_ERROR = "RuntimeError: the Python interpreter is exiting; the manager was hard-stopped"

# Managers whose loop was started. Weak: the registry never keeps a manager alive (a running loop thread does, through
# its target, until it ends).
_live_managers: weakref.WeakSet[StoppableLoop] = weakref.WeakSet()
_registry_lock = threading.Lock()
_exit_hook_installed = False


def track(manager: StoppableLoop) -> None:
    """Remember a started manager so interpreter exit can stop its loop; installs the exit hook once."""
    global _exit_hook_installed
    with _registry_lock:
        _live_managers.add(manager)
        if not _exit_hook_installed:
            # Installed at the first start, so it runs before atexit hooks registered earlier (atexit is LIFO) and
            # after hooks registered later, which may still use their managers.
            atexit.register(stop_all_managers)
            _exit_hook_installed = True


def stop_all_managers(timeout: float = EXIT_JOIN_TIMEOUT_S) -> int:
    """Hard-stop every running manager loop and wait (at most `timeout` seconds in all) for them to end.

    Runs at interpreter exit: each loop finishes the step it is in, then fails its in-flight and queued requests, so
    no daemon thread is inside a torch op when the interpreter tears threads down. Returns how many loops are still
    running (0 unless a step outlasted the timeout).
    """
    with _registry_lock:
        managers = [m for m in list(_live_managers) if m.is_running()]
    for manager in managers:
        manager.signal_stop(hard_stop=True, error=EXIT_ERROR)
    deadline = time.monotonic() + timeout
    alive = 0
    for manager in managers:
        if not manager.join(max(0.0, deadline - time.monotonic())):
            alive += 1
    if alive:
        logger.warning("%d manager loop(s) were still inside a model step %.0fs after interpreter exit began; the "
                       "process may abort while Python tears their threads down. Call manager.stop() (or close the "
                       "RolloutGenerator) before exiting to avoid this.", alive, timeout)
    return alive
