"""StalenessGate under randomized traces: the bound holds, no group is lost or repeated, and it never deadlocks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.rl.staleness import StalenessError, StalenessGate


@settings(max_examples=150, deadline=None)
@given(staleness=st.integers(0, 3), per_batch=st.integers(1, 4), prompts=st.integers(1, 40),
       choices=st.lists(st.integers(0, 10**6), min_size=200, max_size=200), fail_every=st.integers(0, 7))
def test_random_completion_orders_keep_the_bound_and_every_group(staleness, per_batch, prompts, choices, fail_every):
    gate = StalenessGate(staleness, per_batch, version=5)
    admitted_at: dict[int, int] = {}
    running: list[int] = []
    taken: list[int] = []
    failed: set[int] = set()
    left = prompts
    picks = iter(choices * 20)
    while True:
        progressed = False
        while left and gate.can_admit():  # the producer admits whatever the gate allows
            index, version = gate.admit()
            admitted_at[index] = version
            running.append(index)
            left -= 1
            progressed = True
        assert gate.untaken <= (staleness + 1) * per_batch, "the buffer is bounded"
        assert len(gate.expiring()) <= per_batch, "never more groups owed at once than one batch holds"
        more = bool(left) or bool(running)
        chosen = gate.choose(more_can_come=more)
        if chosen is not None:
            for index in chosen:
                assert gate.version - admitted_at[index] <= staleness, "a group handed out too stale"
            gate.take(chosen)
            taken += chosen
            gate.check_update()  # one update per batch is always allowed
            gate.updated(gate.version + 1)
            continue
        if running:  # one running group finishes (or fails), in an order the trace picks
            index = running.pop(next(picks) % len(running))
            if fail_every and index % fail_every == fail_every - 1:
                gate.fail(index)
                failed.add(index)
            else:
                gate.finish(index)
            continue
        assert not progressed or not left
        break
    assert left == 0 and gate.untaken == 0, "the trace ended with groups never handed out (a deadlock)"
    assert sorted(taken + list(failed)) == list(range(len(admitted_at))), "a group lost or handed out twice"
    assert len(taken) == len(set(taken))


def test_zero_staleness_is_synchronous():
    gate = StalenessGate(0, 2, version=0)
    first = [gate.admit()[0] for _ in range(2)]
    assert not gate.can_admit(), "nothing starts before the update"
    gate.finish(first[1])
    assert gate.choose(more_can_come=True) is None, "the batch waits for its straggler"
    gate.finish(first[0])
    assert gate.choose(more_can_come=True) == first
    gate.take(first)
    gate.updated(1)
    assert gate.can_admit()


def test_expiring_groups_come_first_and_the_trainer_waits_for_them():
    gate = StalenessGate(1, 2, version=0)
    old = [gate.admit()[0] for _ in range(4)]  # capacity (1 + 0 + 1) * 2
    gate.finish(old[2])
    gate.finish(old[3])
    assert gate.choose(more_can_come=True) == [old[2], old[3]]  # nothing is expiring at version 0
    gate.take([old[2], old[3]])
    gate.updated(1)
    new = [gate.admit()[0] for _ in range(2)]
    for index in new:
        gate.finish(index)
    assert gate.expiring() == old[:2]
    assert gate.choose(more_can_come=True) is None, "the finished newer groups wait behind the expiring ones"
    gate.finish(old[0])
    gate.finish(old[1])
    assert gate.choose(more_can_come=True) == old[:2]


def test_an_update_that_would_strand_a_group_is_refused():
    gate = StalenessGate(1, 1, version=0)
    gate.admit()
    gate.updated(1)  # an update without taking the batch
    with pytest.raises(StalenessError, match="Take the next batch before each update"):
        gate.check_update()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_staleness": -1, "groups_per_batch": 1}, "max_staleness must be an int >= 0"),
    ({"max_staleness": 1.5, "groups_per_batch": 1}, "max_staleness must be an int >= 0"),
    ({"max_staleness": 1, "groups_per_batch": 0}, "groups_per_batch must be an int >= 1"),
])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StalenessGate(version=0, **kwargs)
