"""AsyncRollouts: bounded staleness with weight updates in flight, whole partial rollouts, and faults that fail one
group or reach the trainer as an error, never a hang."""

import asyncio
import threading

import pytest
import torch

from rollout import AsyncRollouts, ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from rollout.rl.async_rollouts import ProducerError
from rollout.rl.batch import RolloutBatch, RolloutSample
from rollout.rl.staleness import StalenessError
from tests.helpers.models import perturbed, random_prompts, tiny_model
from tests.helpers.waiting import HANG_GUARD_S, FakeClock, wait_for

CB = ContinuousBatchingConfig(page_size=8, num_blocks=512)


def length_reward(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]


class FakeBackend:
    """A backend whose groups generate on the test's cue: token versions are read as they are 'generated'."""

    shared_by_processes = False
    keeps_kv = False
    dtype = None

    def __init__(self, tokens: int = 4):
        self.tokens = tokens
        self.version = 0
        self.cv = threading.Condition()
        self.lag_for: dict[str, int] = {}  # prompt -> versions to wait for between its two halves
        self.fail_with: dict[str, BaseException] = {}
        self.block: set[str] = set()  # prompts that never finish

    @property
    def weight_version(self) -> int:
        return self.version

    def check_sampling(self, params):
        pass

    def generate(self, prompts, n=1, sampling_params=None):
        (prompt,) = prompts
        if prompt in self.fail_with:
            raise self.fail_with[prompt]
        with self.cv:
            if prompt in self.block:
                self.cv.wait_for(lambda: False, timeout=HANG_GUARD_S)
            start = self.version
            first = [self.version] * (self.tokens // 2)
            self.cv.wait_for(lambda: self.version >= start + self.lag_for.get(prompt, 0), timeout=HANG_GUARD_S)
            versions = first + [self.version] * (self.tokens - len(first))
        samples = [RolloutSample(0, [1], list(range(self.tokens)), [0.0] * self.tokens, [0.0] * self.tokens,
                                 [0.0] * self.tokens, list(versions), "length", text=prompt) for _ in range(n)]
        return RolloutBatch(samples, [n])

    def update_weights(self, source, on_update="keep"):
        with self.cv:
            self.version += 1
            self.cv.notify_all()
            return self.version


def _drain(producer, update=True):
    batches = []
    for batch in producer:
        batches.append(batch)
        if update:
            producer.update_weights(None)
    return batches


def test_a_group_started_under_v_and_finished_under_v_plus_2_comes_back_whole():
    backend = FakeBackend()
    backend.lag_for["slow"] = 2
    prompts = ["slow"] + [f"p{i}" for i in range(5)]
    with AsyncRollouts(backend, prompts, length_reward, groups_per_batch=1, n=2, max_staleness=2) as producer:
        batches = _drain(producer)
    groups = [g for b in batches for g in b.groups]
    assert sorted(g.index for g in groups) == list(range(6)), "every group exactly once"
    slow = next(g for g in groups if g.row == "slow")
    assert (slow.oldest_version, slow.newest_version) == (0, 2)
    assert all(s.weight_versions == [0, 0, 2, 2] for s in slow.samples), "per-token versions kept"
    for batch in batches:
        assert max(batch.versions_behind()) <= 2
    taken_at = next(b.trainer_version for b in batches if slow in b.groups)
    assert taken_at == 2, "the straggler is taken at its last chance, not dropped"


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_the_engine_under_in_flight_updates_keeps_the_bound_and_every_sample(max_staleness):
    torch.manual_seed(0)
    model = tiny_model("qwen3")
    rows = [{"prompt": p, "row": i} for i, p in enumerate(random_prompts([3, 9, 17, 5, 30, 11] * 3, seed=4))]
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    seen_rows = []

    def reward(prompts, completions, completion_ids, row, **kw):
        seen_rows.extend(row[:1])
        return [float(len(ids)) for ids in completion_ids]

    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        with AsyncRollouts(gen, rows, reward, groups_per_batch=3, n=4, sampling_params=params,
                           max_staleness=max_staleness, seed=7) as producer:
            batches = []
            for k, batch in enumerate(producer):
                batches.append(batch)
                producer.update_weights(perturbed(model, seed=k + 1))
        stats = gen.manager.stats()
        assert stats.free_blocks == stats.num_blocks, "KV blocks held after the producer closed"
    groups = [g for b in batches for g in b.groups]
    assert sorted(g.index for g in groups) == list(range(len(rows)))
    assert sorted(g.row["row"] for g in groups) == sorted(seen_rows) == list(range(len(rows)))
    assert all(len(b) == 3 for b in batches)
    for batch in batches:
        assert max(batch.versions_behind()) <= max_staleness, batch.metrics
        assert batch.metrics["async/versions_behind/max"] <= max_staleness
        for group in batch.groups:
            assert len(group.samples) == 4 and group.rewards == [float(len(s.completion_ids)) for s in group.samples]
            for s in group.samples:
                assert s.weight_versions == sorted(s.weight_versions), "versions only move forward"
                assert all(group.admitted_version <= v <= batch.trainer_version for v in s.weight_versions)
    if max_staleness == 0:  # synchronous: every token under the trainer's current weights
        assert all(v == b.trainer_version for b in batches for g in b.groups for s in g.samples
                   for v in s.weight_versions)


def test_a_raising_or_hanging_reward_fails_only_its_group():
    release = threading.Event()

    def reward(prompts, completions, completion_ids, **kw):
        if prompts[0] == "raise":
            raise KeyError("no answer column")
        if prompts[0] == "hang":
            release.wait(HANG_GUARD_S)
        return [1.0] * len(prompts)

    async def judge(prompts, completions, **kw):
        if prompts[0] == "hang-async":
            await asyncio.sleep(HANG_GUARD_S)
        return [0.5] * len(prompts)

    prompts = ["a", "raise", "b", "hang", "c", "hang-async", "d", "e"]
    try:
        with AsyncRollouts(FakeBackend(), prompts, [reward, judge], groups_per_batch=1, n=2, max_staleness=1,
                           reward_timeout=2.0) as producer:
            batches = _drain(producer)
    finally:
        release.set()
    assert sorted(g.row for b in batches for g in b.groups) == ["a", "b", "c", "d", "e"]
    assert all(g.rewards == [1.5, 1.5] and g.reward_columns == {"reward": [1.0, 1.0], "judge": [0.5, 0.5]}
               for b in batches for g in b.groups)
    assert producer.counts["failed_reward"] == 3 and producer.counts["failed_generation"] == 0


def test_a_refused_group_fails_alone_and_a_dead_backend_reaches_the_trainer():
    backend = FakeBackend()
    backend.fail_with["bad"] = ValueError("prompt 0 is too long for the model")
    with AsyncRollouts(backend, ["a", "bad", "b", "c"], length_reward, groups_per_batch=1, max_staleness=0) as p:
        assert sorted(g.row for b in _drain(p) for g in b.groups) == ["a", "b", "c"]
        assert p.counts["failed_generation"] == 1

    backend = FakeBackend()
    backend.fail_with["dies"] = RuntimeError("engine process died")
    with AsyncRollouts(backend, ["a", "dies", "b", "c"], length_reward, groups_per_batch=2, max_staleness=0) as p:
        with pytest.raises(ProducerError, match="engine process died"):
            _drain(p)


def test_a_hung_backend_is_an_error_after_stall_timeout():
    backend = FakeBackend()
    backend.block.add("stuck")
    clock = FakeClock()
    producer = AsyncRollouts(backend, ["stuck", "x"], length_reward, groups_per_batch=2, max_staleness=0,
                             stall_timeout=30.0, clock=clock)
    errors = []

    def trainer():
        try:
            producer.next_batch()
        except ProducerError as err:
            errors.append(err)

    thread = threading.Thread(target=trainer)
    thread.start()
    wait_for(lambda: producer._gate.ready == 1, "the healthy group finished")
    clock.advance(31.0)
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive() and "stall_timeout" in str(errors[0])
    producer.close(timeout=0)


def test_close_stops_generation_and_frees_every_kv_block():
    model = tiny_model("qwen3")
    params = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        producer = AsyncRollouts(gen, random_prompts([12] * 50, seed=1), length_reward, groups_per_batch=2, n=2,
                                 sampling_params=params, max_staleness=1)
        wait_for(lambda: gen.manager.stats().used_blocks > 0, "generation started")
        producer.close()
        assert not any(w.is_alive() for w in producer._workers)
        stats = gen.manager.stats()
        assert stats.free_blocks == stats.num_blocks and not gen.manager.engine.has_unfinished()
        with pytest.raises(ProducerError, match="closed"):
            producer.next_batch()


def test_taking_batches_without_updates_is_refused_with_what_to_do():
    with AsyncRollouts(FakeBackend(), [f"p{i}" for i in range(6)], length_reward, groups_per_batch=2,
                       max_staleness=0) as producer:
        producer.next_batch()
        with pytest.raises(StalenessError, match="call update_weights once after each batch"):
            producer.next_batch()


def test_bad_settings_are_refused_before_anything_runs():
    model = tiny_model("qwen3")
    with RolloutGenerator(model, continuous_batching_config=CB, share_weights=True) as shared:
        with pytest.raises(ValueError, match="share_weights=False"):
            AsyncRollouts(shared, ["a"], length_reward, groups_per_batch=1)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        AsyncRollouts(FakeBackend(), ["a"], length_reward, groups_per_batch=1, n=0)
    with pytest.raises(ValueError, match="reward_funcs must be a callable"):
        AsyncRollouts(FakeBackend(), ["a"], [], groups_per_batch=1)
    with AsyncRollouts(FakeBackend(), [{"text": "a"}], length_reward, groups_per_batch=1) as producer:
        assert _drain(producer) == [] and producer.counts["failed_generation"] == 1
