"""Keeping a process at one OpenMP team: why the engine cares which thread runs torch work.

torch's CPU kernels run their parallel regions on an OpenMP team, and libgomp (the runtime torch's Linux wheels ship)
gives every thread that starts parallel work a team of its own, which lives as long as that thread. While the
process holds more OpenMP threads than it has cores, libgomp cuts its spin-wait between regions to a few hundred
iterations, so each region puts its workers to sleep and wakes them again. For the engine's many small ops per decode
step that is expensive (benchmarks/RESULTS.md, "Thread teams"). Three rules follow:

- whoever waits for the engine anyway steps it in its own thread (the manager's `stepping_in_caller`);
- one-off torch work beside a running engine (loading a model, copying uploaded weights) runs in a thread that ends
  when the work does (`run_in_fresh_thread`), so its team is gone with it;
- a thread stepping the engine for others adopts the intra-op thread count of whoever submitted last
  (`adopt_thread_count`), and threads that only submit for others (a rollout producer's workers) never step it
  (`leave_stepping_to_loop`): the loop thread keeps the engine's one team.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

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


def adopt_thread_count(count: int) -> None:
    """Give this thread `count` intra-op threads (0 leaves torch's). torch's count is per thread and an OpenMP team is
    sized at its first parallel region, so a trainer's later `torch.set_num_threads` would never reach the engine's
    loop otherwise: a colocated trainer and engine must agree on how many cores they take in turn."""
    if count and torch.get_num_threads() != count:
        torch.set_num_threads(count)


_marks = threading.local()


@contextlib.contextmanager
def leave_stepping_to_loop() -> Iterator[None]:
    """In this block the calling thread never steps an engine itself, even inside `stepping_in_caller`: it is one of
    many threads that submit and wait, and each would start an OpenMP team of its own."""
    before = getattr(_marks, "leave_to_loop", False)
    _marks.leave_to_loop = True
    try:
        yield
    finally:
        _marks.leave_to_loop = before


def may_step_here() -> bool:
    """False inside `leave_stepping_to_loop`."""
    return not getattr(_marks, "leave_to_loop", False)


def split_threads(total: int, engine_threads: int | None, what: str = "engine_threads") -> tuple[int, int]:
    """(engine, trainer) intra-op threads when an engine and a trainer run at once in one process: the engine gets
    `engine_threads` (default half of `total`), the trainer the rest, so their two OpenMP teams never hold more threads
    than `total`. `what` names the setting in the error for a bad value."""
    engine = engine_threads if engine_threads is not None else max(1, total // 2)
    if engine < 1:
        raise ValueError(f"{what} must be >= 1, got {engine}")
    return engine, max(1, total - engine)
