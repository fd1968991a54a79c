"""Waiting in tests without asserting on elapsed time.

A test waits for an event (a counter reaching a value, a thread parking, a worker owing work), never for a duration,
and never asserts how long something took: on a shared 2-core machine any duration can stretch. `wait_for` polls a
condition and gives up only after HANG_GUARD_S, a bound no correct run comes near (it turns a hang into a failure
instead of a stuck suite). Code whose behaviour depends on elapsed time (timeouts, expiry) takes an injectable clock,
and tests drive it with `FakeClock`. This module is the only place in tests/ that reads the real clock
(tests/test_lint.py checks that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

HANG_GUARD_S = 120.0


def wait_for(condition: Callable[[], T], what: str, poll_s: float = 0.02) -> T:
    """Poll `condition` until it returns something truthy and return that; fail naming `what` if it never does."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(poll_s)


class FakeClock:
    """A monotonic clock that moves only when the test says so, for code with a `clock` attribute. It starts at the
    real monotonic time, so times the code took from the real clock before stay in the past."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
