"""Keeping a process at one OpenMP team: why the engine cares which thread runs torch work.

torch's CPU kernels run their parallel regions on an OpenMP team, and libgomp (the runtime torch's Linux wheels ship)
gives every thread that starts parallel work a team of its own, which lives as long as that thread. While the
process holds more OpenMP threads than it has cores, libgomp cuts its spin-wait between regions to a few hundred
iterations, so each region puts its workers to sleep and wakes them again. For the engine's many small ops per decode
step that is expensive: on 2 cores one 32-row decode step of a 26M-parameter model took 12 ms in the only thread with
a team and 18 ms once a second thread (a trainer, a model load) owned one; a single-sequence step in a server took
~2.5x longer. Two rules follow:

- whoever waits for the engine anyway steps it in its own thread (the manager's `stepping_in_caller`);
- one-off torch work beside a running engine (loading a model, copying uploaded weights) runs in a thread that ends
  when the work does (`run_in_fresh_thread`), so its team is gone with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[[], T], name: str = "rollout-oneoff") -> T:
    """`fn()` in a new thread that ends with it (its OpenMP team ends too); returns its result or raises its error.

    The calling thread blocks until `fn` returns. KeyboardInterrupt in the caller stops waiting, not `fn`.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # re-raised in the caller, with its traceback
            error.append(err)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
