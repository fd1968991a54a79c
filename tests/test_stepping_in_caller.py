"""ContinuousBatchingManager.stepping_in_caller: a blocked caller steps the engine itself, the loop thread stays
parked, and every other guarantee of the manager (other threads' requests, streams, pauses, stops, a dying step)
still holds."""

import threading

import pytest
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus, generate_batch
from rollout.engine.core.request import ErrorKind
from rollout.manager import ManagerError
from tests.helpers.models import random_prompts, tiny_model

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)
CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture
def manager(model):
    manager = ContinuousBatchingManager(model, GREEDY, CB)
    manager.start()
    yield manager
    manager.destroy()


def _record_stepping_threads(manager, monkeypatch) -> list[str]:
    names: list[str] = []
    step = manager.engine.step

    def recording_step():
        names.append(threading.current_thread().name)
        return step()

    monkeypatch.setattr(manager.engine, "step", recording_step)
    return names


def test_the_caller_steps_and_the_loop_thread_never_does(model, manager, monkeypatch):
    prompts = random_prompts([5, 17, 9], seed=1)
    expected = generate_batch(model, prompts, GREEDY, progress_bar=False)
    names = _record_stepping_threads(manager, monkeypatch)
    with manager.stepping_in_caller():
        ids = [manager.add_request(p) for p in prompts]
        threading.Event().wait(0.2)  # the loop thread had time to step, if it were allowed to
        outs = [manager.get_result(rid, timeout=60) for rid in ids]
    assert [o.generated_tokens for o in outs] == [r.generated_tokens for r in expected.values()]
    assert names and set(names) == {threading.current_thread().name}


def test_the_loop_takes_over_when_the_block_ends(manager, monkeypatch):
    names = _record_stepping_threads(manager, monkeypatch)
    with manager.stepping_in_caller():
        mine = manager.add_request([1, 2, 3], max_new_tokens=4)
        left = manager.add_request([4, 5, 6], max_new_tokens=40)
        assert manager.get_result(mine, timeout=60).status == RequestStatus.FINISHED
    assert manager.get_result(left, timeout=60).status == RequestStatus.FINISHED
    assert "rollout-cb-loop" in names  # the rest of `left` ran on the loop thread
    assert names[0] == threading.current_thread().name


def test_other_threads_requests_progress_while_the_caller_steps(manager, monkeypatch):
    names = _record_stepping_threads(manager, monkeypatch)
    other_result = []
    submitted = threading.Event()

    def other():
        rid = manager.add_request([7, 8, 9], max_new_tokens=3)
        submitted.set()
        other_result.append(manager.get_result(rid, timeout=60))

    with manager.stepping_in_caller():
        mine = manager.add_request([1, 2, 3], max_new_tokens=60)
        thread = threading.Thread(target=other, name="other")
        thread.start()
        submitted.wait(30)
        assert manager.get_result(mine, timeout=60).status == RequestStatus.FINISHED
        thread.join(60)
    assert other_result and other_result[0].status == RequestStatus.FINISHED
    assert set(names) == {threading.current_thread().name}  # the waiting caller stepped both


def test_a_second_thread_does_not_claim_while_one_steps(manager, monkeypatch):
    names = _record_stepping_threads(manager, monkeypatch)
    got = []

    def second():
        with manager.stepping_in_caller():  # another thread steps already: this one just waits
            got.append(manager.get_result(manager.add_request([5, 5], max_new_tokens=3), timeout=60))

    with manager.stepping_in_caller():
        mine = manager.add_request([1, 2, 3], max_new_tokens=30)
        worker = threading.Thread(target=second, name="second")
        worker.start()
        assert manager.get_result(mine, timeout=60) is not None
        worker.join(60)
    assert got and got[0].status == RequestStatus.FINISHED
    assert "second" not in names


def test_streams_are_stepped_by_the_caller(manager):
    with manager.stepping_in_caller():
        rid = manager.add_request([1, 2, 3], max_new_tokens=5, streaming=True)
        outs = list(manager.request_id_iter(rid))
    assert [len(o.generated_tokens) for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].is_finished()


def test_a_pause_from_another_thread_parks_the_stepping_caller(manager):
    with manager.stepping_in_caller():
        rid = manager.add_request([1, 2, 3], max_new_tokens=200)
        paused = threading.Event()
        steps_seen = []

        def pauser():
            with manager.pause():
                steps = manager.engine.stats().steps
                paused.set()
                threading.Event().wait(0.3)
                steps_seen.append(manager.engine.stats().steps - steps)

        thread = threading.Thread(target=pauser)
        thread.start()
        assert manager.get_result(rid, timeout=60).status == RequestStatus.FINISHED
        thread.join(60)
    assert paused.is_set() and steps_seen == [0]


def test_a_timeout_while_stepping_returns_none_and_keeps_the_request(manager):
    with manager.stepping_in_caller():
        rid = manager.add_request([1, 2, 3], max_new_tokens=400)
        assert manager.get_result(rid, timeout=0.05) is None
        assert manager.get_result(rid, timeout=120).status == RequestStatus.FINISHED


def test_a_hard_stop_fails_the_callers_requests(manager):
    with manager.stepping_in_caller():
        rid = manager.add_request([1, 2, 3], max_new_tokens=400)
        threading.Timer(0.1, lambda: manager.stop(hard_stop=True, timeout=30)).start()
        out = manager.get_result(rid, timeout=60)
    assert out.status == RequestStatus.FAILED and out.error_kind == ErrorKind.SHUTDOWN


def test_a_step_that_dies_in_the_caller_fails_everyone_with_an_error(manager, monkeypatch):
    def broken_step():
        raise SystemError("scheduler bug")

    waiter_errors = []
    with manager.pause():
        other = manager.add_request([9, 9], max_new_tokens=3)
    monkeypatch.setattr(manager.engine, "step", broken_step)

    def waiter():
        try:
            manager.get_result(other, timeout=60)
        except ManagerError as err:
            waiter_errors.append(err)

    with manager.stepping_in_caller():
        rid = manager.add_request([1, 2, 3])
        thread = threading.Thread(target=waiter)
        thread.start()
        with pytest.raises(ManagerError, match="scheduler bug"):
            manager.get_result(rid, timeout=60)
    thread.join(60)
    assert waiter_errors and "scheduler bug" in str(waiter_errors[0])
    with pytest.raises(ManagerError):
        manager.add_request([1])
