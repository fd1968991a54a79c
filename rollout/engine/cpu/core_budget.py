"""How many threads an engine step may use on CPU, including when other processes share the cores.

OpenMP workers spin-wait between parallel regions. When another process (a trainer, a second server, a build) keeps
the same cores busy, a spinning worker burns the time slice its partner needs, and a decode step made of hundreds of
small parallel regions slows down by an order of magnitude (benchmarks/results-history.md, "Serving"). The `"auto"`
budget watches, per core this process may run on, how busy the other processes keep it, and steps with as many
threads as there are free cores (at least one, at most the stepping thread's own count).

The reading must be recent. Measured only when a step runs, the window of the first step after a quiet spell reached
back over the whole spell: a server that waited while a neighbour worked stepped its next requests with one thread,
however idle the neighbour had become by then. So a daemon thread reads /proc every `interval` whether or not the
engine steps, and a step uses the last complete window, never older than two intervals.

`ContinuousBatchingConfig.cpu_threads`: None leaves the stepping thread's count alone, an int fixes it, "auto" adapts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A partly busy core still gets a thread when at least this fraction of it is free.
_USABLE_FRACTION = 0.6


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks of these CPUs since boot (everything but idle and iowait), from /proc/stat; None if absent."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()]
        busy += sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
    return busy


def _own_ticks() -> int | None:
    """Clock ticks this process used (user + system), from /proc/self/stat; None if absent."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the full line)


class CoreBudget:
    """Threads for the next step: a fixed count, or (auto) the cores other processes left free over the last complete
    `interval`, read from /proc by a sampling thread (where /proc is missing, auto keeps the stepping thread's count).
    """

    def __init__(self, setting: int | str, interval: float = 0.25) -> None:
        self.setting = setting
        self.interval = interval
        self._cpus = _allowed_cpus()
        self._lock = threading.Lock()
        self._last: tuple[float, int, int] | None = None
        self.free_cores = float(len(self._cpus))  # over the last complete window (auto)
        self._logged: int | None = None
        if setting == AUTO:
            self.sample()  # the first window starts now
            _start_sampler(self)

    def threads(self, wanted: int) -> int:
        """The thread count to step with, for a stepping thread whose own count is `wanted`."""
        if self.setting != AUTO:
            return int(self.setting)
        free = max(1, int(self.free_cores + (1 - _USABLE_FRACTION)))
        chosen = max(1, min(wanted, free))
        if chosen != self._logged:
            logger.info("engine steps with %d of %d threads (other processes leave %.1f of %d cores free)", chosen,
                        wanted, self.free_cores, len(self._cpus))
            self._logged = chosen
        return chosen

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Step with the budget's thread count; the stepping thread's own count is restored afterwards."""
        before = torch.get_num_threads()
        chosen = self.threads(before)
        if chosen == before:
            yield
            return
        torch.set_num_threads(chosen)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def sample(self) -> None:
        """Read /proc now; the window since the previous reading becomes `free_cores` (the sampling thread calls this
        every `interval`)."""
        now = time.monotonic()
        with self._lock:
            busy, own = _busy_ticks(self._cpus), _own_ticks()
            if busy is None or own is None:
                return
            if self._last is not None:
                elapsed_ticks = (now - self._last[0]) * _TICKS
                others = max(0, (busy - self._last[1]) - (own - self._last[2])) / max(elapsed_ticks, 1e-9)
                self.free_cores = max(0.0, len(self._cpus) - others)
            self._last = (now, busy, own)


def _start_sampler(budget: CoreBudget) -> None:
    """A daemon thread that samples `budget` every interval and ends once the budget is garbage (it holds the budget
    weakly; the finalizer wakes it at once)."""
    stop = threading.Event()
    ref = weakref.ref(budget)
    interval = budget.interval

    def run() -> None:
        while not stop.wait(interval):
            target = ref()
            if target is None:
                return
            target.sample()
            del target

    weakref.finalize(budget, stop.set)
    threading.Thread(target=run, name="rollout-core-budget", daemon=True).start()
