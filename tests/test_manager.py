"""ContinuousBatchingManager: lifecycle, submission, results, streaming, cancellation, failure, thread safety."""

import logging
import random
import threading

import pytest
from transformers import GenerationConfig

from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    RequestStatus,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from rollout.engine.core.request import ErrorKind
from rollout.manager import ManagerError
from tests.helpers.models import random_prompts, tiny_model

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)
CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _assert_idle_and_clean(manager):
    stats = manager.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.free_blocks == stats.num_blocks, "blocks leaked"
    manager.engine.check_invariants()


def test_results_match_generate_batch_and_keep_input_order(model):
    prompts = random_prompts([5, 30, 12, 7], seed=3)
    expected = generate_batch(model, prompts, GREEDY, progress_bar=False)
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        ids = manager.add_requests(prompts)
        got = {r.request_id: r for r in manager}
        _assert_idle_and_clean(manager)
    assert ids == [f"req_{i}" for i in range(4)]
    for rid, ref in zip(ids, expected.values()):
        assert got[rid].generated_tokens == ref.generated_tokens
        assert got[rid].status == RequestStatus.FINISHED


def test_add_requests_submits_shared_prefixes_together(model):
    base = random_prompts([24], seed=4)[0]
    prompts = [base + [i] for i in range(3)] + random_prompts([20], seed=5) + [base + [9]]
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        manager.add_requests(prompts)
        list(manager)
        assert manager.stats().prefix_hit_tokens >= 3 * 24


def test_soft_stop_finishes_queued_work_then_drops_new_submissions(model, caplog):
    manager = init_continuous_batching(model, GREEDY, CB)
    manager.start()
    ids = [manager.add_request(p, max_new_tokens=16) for p in random_prompts([9] * 6, seed=6)]
    manager.stop()
    assert not manager.is_running()
    results = [manager.get_result(rid, timeout=0) for rid in ids]
    assert all(r.status == RequestStatus.FINISHED and len(r.generated_tokens) == 16 for r in results)
    with caplog.at_level(logging.WARNING):
        assert manager.add_request([1, 2, 3]) is None
    assert "dropping request" in caplog.text
    manager.start()  # restart after stop
    rid = manager.add_request([1, 2, 3], max_new_tokens=4)
    assert len(manager.get_result(rid, timeout=60).generated_tokens) == 4
    manager.destroy()
    assert manager.engine is None
    with pytest.raises(ManagerError):
        manager.start()
    with pytest.raises(ManagerError):
        manager.add_request([1])


def test_hard_stop_fails_queued_and_active_requests(model):
    manager = ContinuousBatchingManager(model, GREEDY, CB)
    with manager.pause():  # nothing runs until we hard-stop
        manager.start()
        ids = [manager.add_request(p, max_new_tokens=200) for p in random_prompts([9] * 5, seed=7)]
    manager.stop(hard_stop=True, timeout=30)
    assert not manager.is_running()
    for rid in ids:
        out = manager.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FAILED and "RuntimeError" in out.error
    assert manager.engine.stats().free_blocks == manager.engine.stats().num_blocks


def test_persistent_manager_is_reused_with_its_cache(model):
    with continuous_batching_context_manager(model, GREEDY, CB, persistent_manager=True) as first:
        first.add_request([1, 2, 3], request_id="a")
        first.get_result("a", timeout=60)
        ptrs = first.engine.cache.data_ptrs()
    with continuous_batching_context_manager(model, persistent_manager=True) as second:
        assert second is first and second.engine.cache.data_ptrs() == ptrs
        second.add_request([1, 2, 3], request_id="b")
        assert second.get_result("b", timeout=60).status == RequestStatus.FINISHED
    with continuous_batching_context_manager(model, GREEDY, CB) as third:
        assert third is not first
    first.destroy()


def test_ids_duplicates_and_unknown(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        with manager.pause():
            assert manager.add_request([1, 2], request_id="x") == "x"
            with pytest.raises(ValueError, match="already in use"):
                manager.add_request([3, 4], request_id="x")
            auto = manager.add_request([5, 6])
            assert auto != "x"
        with pytest.raises(KeyError, match="unknown request id"):
            manager.get_result("nope")
        assert manager.get_result("x", timeout=60).request_id == "x"
        assert manager.get_result(auto, timeout=60).request_id == auto
        assert not manager.cancel_request("x")  # already finished


def test_get_result_by_id_waits_without_disturbing_others(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        with manager.pause():
            a = manager.add_request([1, 2, 3], max_new_tokens=2)
            b = manager.add_request([4, 5, 6], max_new_tokens=2)
            assert manager.get_result(b, timeout=0.2) is None  # cannot finish while paused
        assert manager.get_result(b, timeout=60).request_id == b
        assert manager.get_result(a, timeout=60).request_id == a
        assert manager.get_result(timeout=0.1) is None


def test_streaming_yields_growing_partials_then_the_final_output(model):
    prompt = random_prompts([11], seed=8)[0]
    expected = generate_batch(model, [prompt], GREEDY, progress_bar=False)["req_0"].generated_tokens
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        manager.add_request(prompt, request_id="s", streaming=True)
        chunks = list(manager.request_id_iter("s"))
    assert [len(c.generated_tokens) for c in chunks] == list(range(1, 9))
    assert all(c.status == RequestStatus.DECODING for c in chunks[:-1])
    assert chunks[-1].status == RequestStatus.FINISHED and chunks[-1].generated_tokens == expected


def test_cancel_frees_blocks_at_once_and_reports_cancelled(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        long_id = manager.add_request(random_prompts([40], seed=9)[0], max_new_tokens=10_000 // 40)
        waiting_id = manager.add_request([1, 2, 3], max_new_tokens=5)
        stream_id = manager.add_request([7, 8, 9], max_new_tokens=200, streaming=True)
        first = next(iter(manager.request_id_iter(stream_id)))
        assert first.status == RequestStatus.DECODING
        with manager.pause():
            used = manager.stats().used_blocks
            assert manager.cancel_request(long_id)
            assert manager.cancel_request(stream_id)
            assert manager.stats().used_blocks < used
        assert manager.get_result(long_id, timeout=60).status == RequestStatus.CANCELLED
        assert manager.get_result(waiting_id, timeout=60).status == RequestStatus.FINISHED
        last = list(manager.request_id_iter(stream_id))[-1]
        assert last.status == RequestStatus.CANCELLED and last.finish_reason == "cancelled"
        _assert_idle_and_clean(manager)


def test_invalid_request_fails_alone(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        good = manager.add_request([1, 2, 3])
        bad = manager.add_request([], request_id="empty")
        worse = manager.add_request([1, 2], temperature=-1.0)
        assert "empty" in manager.get_result(bad, timeout=60).error
        assert "temperature" in manager.get_result(worse, timeout=60).error
        assert manager.get_result(good, timeout=60).status == RequestStatus.FINISHED


def test_forward_error_fails_that_step_and_the_loop_keeps_serving(model, monkeypatch):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        runner = manager.engine.runner
        original = runner.run
        calls = {"n": 0}

        def flaky(plan):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom in forward")
            return original(plan)

        monkeypatch.setattr(runner, "run", flaky)
        with manager.pause():
            first = manager.add_request([1, 2, 3], max_new_tokens=5)
        out = manager.get_result(first, timeout=60)
        assert out.status == RequestStatus.FAILED and "boom in forward" in out.error
        later = manager.add_request([4, 5, 6], max_new_tokens=5)
        assert manager.get_result(later, timeout=60).status == RequestStatus.FINISHED
        assert manager.is_running()
        _assert_idle_and_clean(manager)


def test_dead_loop_wakes_every_waiter_with_an_error(model, monkeypatch):
    manager = ContinuousBatchingManager(model, GREEDY, CB)

    def broken_step():
        raise SystemError("scheduler bug")

    monkeypatch.setattr(manager.engine, "step", broken_step)
    errors = []

    def waiter(rid, streaming):
        try:
            if streaming:
                list(manager.request_id_iter(rid))
            else:
                manager.get_result(rid)
        except ManagerError as err:
            errors.append(err)

    with manager.pause():
        ids = [(manager.add_request([1, 2, 3], streaming=s), s) for s in (False, True, False)]
        manager.start()
    threads = [threading.Thread(target=waiter, args=item) for item in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a caller hung on a dead loop"
    assert len(errors) == 3 and "scheduler bug" in str(errors[0])
    with pytest.raises(ManagerError):
        manager.add_request([1])


def test_pause_parks_the_loop_between_steps(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        rid = manager.add_request([1, 2, 3], max_new_tokens=300)
        stream = manager.add_request([3, 2, 1], max_new_tokens=300, streaming=True)
        next(iter(manager.request_id_iter(stream)))
        with manager.pause():
            steps = manager.engine.stats().steps
            threading.Event().wait(0.3)
            assert manager.engine.stats().steps == steps
            assert manager.engine.stats().running == 2
        manager.cancel_request(rid)
        manager.cancel_request(stream)


def test_stats_keys(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        stats = manager.stats().as_dict()
    for key in ["num_blocks", "free_blocks", "cached_blocks", "running", "waiting", "weight_version", "steps",
                "prompt_tokens", "generated_tokens", "prefix_hit_tokens", "queued", "uncollected",
                "prefix_cache_hit_rate", "kv_cache_usage", "peak_kv_cache_usage"]:
        assert key in stats


def test_stress_many_threads_cancel_and_stream(model):
    config = ContinuousBatchingConfig(page_size=8, num_blocks=160, max_batch_tokens=256)
    submitted, cancelled, lock = {}, set(), threading.Lock()
    results, errors = {}, []
    with continuous_batching_context_manager(model, GREEDY, config) as manager:

        def submitter(worker):
            local = random.Random(worker)
            for i in range(50):
                prompt = [local.randrange(256) for _ in range(local.randint(1, 40))]
                max_new = local.randint(1, 24)
                streaming = local.random() < 0.2
                rid = manager.add_request(prompt, request_id=f"w{worker}-{i}", max_new_tokens=max_new,
                                          streaming=streaming)
                with lock:
                    submitted[rid] = (max_new, streaming)
                if local.random() < 0.15 and manager.cancel_request(rid):
                    with lock:
                        cancelled.add(rid)

        def reader(rid, streaming):
            try:
                if streaming:
                    chunks = list(manager.request_id_iter(rid))
                    assert [len(c.generated_tokens) for c in chunks[:-1]] == sorted(
                        len(c.generated_tokens) for c in chunks[:-1])
                    results[rid] = chunks[-1]
                else:
                    results[rid] = manager.get_result(rid, timeout=300)
            except Exception as err:
                errors.append(err)

        workers = [threading.Thread(target=submitter, args=(w,)) for w in range(6)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        readers = [threading.Thread(target=reader, args=(rid, s)) for rid, (_, s) in submitted.items()]
        for t in readers:
            t.start()
        for t in readers:
            t.join(300)
        assert not errors, errors
        assert len(results) == len(submitted) == 300
        for rid, (max_new, _) in submitted.items():
            out = results[rid]
            if rid in cancelled:
                assert out.status == RequestStatus.CANCELLED
            elif out.status == RequestStatus.CANCELLED:
                pytest.fail(f"{rid} reported CANCELLED but was never cancelled")
            else:
                assert out.status == RequestStatus.FINISHED, out.error
                assert len(out.generated_tokens) == max_new
        _assert_idle_and_clean(manager)


def test_pause_is_not_tied_to_a_thread_and_leaves_cancel_and_stats_usable(model):
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        rid = manager.add_request([1, 2, 3], max_new_tokens=400)
        keep = manager.add_request([4, 5, 6], max_new_tokens=3)
        paused = threading.Event()

        def pauser():
            manager.pause_generation()
            paused.set()

        t = threading.Thread(target=pauser)
        t.start()
        t.join(30)
        assert paused.is_set() and manager.paused
        steps = manager.stats().steps  # stats and cancel do not wait for the pause to end
        assert manager.cancel_request(rid)
        assert manager.get_result(rid, timeout=5).status == RequestStatus.CANCELLED
        threading.Event().wait(0.2)
        assert manager.stats().steps == steps  # parked: no step ran
        resumer = threading.Thread(target=manager.resume_generation)
        resumer.start()
        resumer.join(30)
        assert not manager.paused
        assert manager.get_result(keep, timeout=60).status == RequestStatus.FINISHED
        with pytest.raises(RuntimeError, match="without a matching"):
            manager.resume_generation()


# ------------------------------------------------------------------------------------------------ output router
class Recorder:
    """An on_output callback that keeps every output by sequence id and says when `expected` finals arrived."""

    def __init__(self, expected: int) -> None:
        self.outputs: dict[str, list] = {}
        self.threads: set[str] = set()
        self._expected = expected
        self._lock = threading.Lock()
        self.done = threading.Event()

    def __call__(self, out) -> None:
        with self._lock:
            self.outputs.setdefault(out.request_id, []).append(out)
            self.threads.add(threading.current_thread().name)
            if len(self.finals()) >= self._expected:
                self.done.set()

    def finals(self) -> dict:
        return {rid: outs[-1] for rid, outs in self.outputs.items() if outs[-1].is_finished()}

    def wait(self) -> dict:
        assert self.done.wait(60), f"only {len(self.finals())} of {self._expected} final outputs arrived"
        return self.finals()


def _assert_one_final_each(recorder: Recorder) -> None:
    for rid, outs in recorder.outputs.items():
        assert [o.is_finished() for o in outs] == [False] * (len(outs) - 1) + [True], rid


def test_routed_requests_get_every_output_once_beside_collected_ones(model):
    prompt = random_prompts([11], seed=8)[0]
    expected = generate_batch(model, [prompt], GREEDY, progress_bar=False)["req_0"].generated_tokens
    streamed, group = Recorder(1), Recorder(3)
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        manager.add_request(prompt, request_id="s", streaming=True, on_output=streamed)
        manager.add_request([4, 5, 6], request_id="g", n=3, max_new_tokens=4, temperature=1.0, seed=3,
                            on_output=group)
        plain = manager.add_request(prompt, request_id="plain")
        collected = list(manager)  # waits for the unrouted request only
        assert [o.request_id for o in collected] == [plain] and collected[0].generated_tokens == expected
        streamed.wait()
        finals = group.wait()
        with pytest.raises(KeyError, match="routed"):
            manager.get_result("s")
        _assert_idle_and_clean(manager)
    chunks = streamed.outputs["s"]
    assert [len(c.generated_tokens) for c in chunks] == list(range(1, 9))  # every partial, then the final
    assert chunks[-1].status == RequestStatus.FINISHED and chunks[-1].generated_tokens == expected
    assert sorted(finals) == ["g#0", "g#1", "g#2"]
    assert all(len(o.generated_tokens) == 4 for o in finals.values())
    assert all(len(outs) == 1 for outs in group.outputs.values()), "a non-streaming request gets its final only"
    assert streamed.threads == {"rollout-cb-loop"}


def test_a_raising_callback_is_logged_and_the_loop_keeps_serving(model, caplog):
    def broken(out):
        raise RuntimeError("callback bug")

    after = Recorder(1)
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        with caplog.at_level(logging.ERROR, logger="rollout.manager"):
            manager.add_request([1, 2, 3], request_id="bad", streaming=True, on_output=broken)
            manager.add_request([1, 2, 3], request_id="good", on_output=after)
            assert after.wait()["good"].status == RequestStatus.FINISHED
        assert manager.is_running()
        assert "on_output callback of request 'bad' raised" in caplog.text
        rid = manager.add_request([4, 5], max_new_tokens=2)
        assert manager.get_result(rid, timeout=60).status == RequestStatus.FINISHED
        _assert_idle_and_clean(manager)


def test_routed_failures_reach_callbacks_with_their_kind(model):
    recorder = Recorder(4)
    with continuous_batching_context_manager(model, GREEDY, CB) as manager:
        manager.add_request([], request_id="empty", on_output=recorder)
        manager.add_request([1, 2], request_id="hot", temperature=-1.0, on_output=recorder)
        manager.add_request([1, 2, 3], request_id="cut", max_new_tokens=500, streaming=True, on_output=recorder)
        with manager.pause():
            manager.add_request([1, 2, 3], request_id="dup", on_output=recorder)
            manager.engine.add_request([9, 9], request_id="dup")  # the engine already holds this id
            assert manager.cancel_request("cut")
        finals = recorder.wait()
        manager.cancel_request("dup")
    assert finals["empty"].error_kind == ErrorKind.INVALID_REQUEST and "empty" in finals["empty"].error
    assert finals["hot"].error_kind == ErrorKind.INVALID_REQUEST and "temperature" in finals["hot"].error
    assert finals["dup"].error_kind == ErrorKind.INVALID_REQUEST and "'dup'" in finals["dup"].error
    assert finals["cut"].status == RequestStatus.CANCELLED
    _assert_one_final_each(recorder)


def test_hard_stop_and_destroy_fail_routed_requests_as_shutdown(model):
    stopped = Recorder(4)
    manager = ContinuousBatchingManager(model, GREEDY, CB)
    with manager.pause():  # two run, two stay queued in the inbox, until the hard stop
        manager.start()
        manager.add_request([1, 2, 3], request_id="a", n=2, max_new_tokens=200, streaming=True, on_output=stopped)
    with manager.pause():
        manager.add_request([4, 5, 6], request_id="b", n=2, max_new_tokens=200, on_output=stopped)
        manager.stop(hard_stop=True, timeout=30)
    finals = stopped.wait()
    assert sorted(finals) == ["a#0", "a#1", "b#0", "b#1"]
    assert all(o.status == RequestStatus.FAILED and o.error_kind == ErrorKind.SHUTDOWN for o in finals.values())
    _assert_one_final_each(stopped)

    never_run = Recorder(1)
    idle = ContinuousBatchingManager(model, GREEDY, CB)  # never started: destroy must not leave it hanging
    idle.add_request([1, 2], request_id="q", on_output=never_run)
    idle.destroy()
    assert never_run.wait()["q"].error_kind == ErrorKind.SHUTDOWN


def test_a_dead_loop_fails_routed_requests_as_shutdown(model, monkeypatch):
    manager = ContinuousBatchingManager(model, GREEDY, CB)

    def broken_step():
        raise SystemError("scheduler bug")

    monkeypatch.setattr(manager.engine, "step", broken_step)
    recorder = Recorder(3)
    with manager.pause():
        manager.add_request([1, 2, 3], request_id="r", n=2, on_output=recorder)
        manager.add_request([4, 5, 6], request_id="s", streaming=True, on_output=recorder)
        plain = manager.add_request([7, 8])
        manager.start()
    finals = recorder.wait()
    assert sorted(finals) == ["r#0", "r#1", "s"]
    assert all(o.error_kind == ErrorKind.SHUTDOWN and "scheduler bug" in o.error for o in finals.values())
    _assert_one_final_each(recorder)
    with pytest.raises(ManagerError, match="scheduler bug"):  # unrouted callers still raise
        manager.get_result(plain, timeout=30)


def test_the_loop_steps_with_the_submitters_thread_count():
    """torch's intra-op thread count is per thread: the loop adopts the count of whoever submitted last, so a trainer
    that changes it (colocated training) is followed, whether or not the engine shares the trainer's module."""
    import torch

    model = tiny_model("qwen3")
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        with continuous_batching_context_manager(model, GREEDY, CB) as manager:
            for threads in (2, 1, 2):
                torch.set_num_threads(threads)
                seen.clear()
                rid = manager.add_request(random_prompts([5], seed=threads)[0], max_new_tokens=3)
                assert manager.get_result(rid, timeout=60) is not None
                assert set(seen) == {threads}
    finally:
        torch.set_num_threads(before)
