"""RolloutPool on a real local Ray cluster: the same results as one RolloutGenerator, weights on every worker or none,
lost and hung workers' groups re-run elsewhere, and TRL training through a pool.

One small cluster (2 CPUs) and one pool of two half-CPU workers serve the whole module; tests that take a worker
away add a replacement before they end.
"""

import logging
import threading

import pytest
import torch

ray = pytest.importorskip("ray", reason="the RolloutPool tests need Ray: pip install 'rollout[ray]'")

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams, WeightUpdateError  # noqa: E402
from rollout.distributed import RolloutPool, init_local_ray  # noqa: E402
from tests.helpers.models import perturbed, random_prompts, tiny_model  # noqa: E402
from tests.helpers.waiting import HANG_GUARD_S, FakeClock, wait_for  # noqa: E402
from trainer_hooks import WeightSync, rollout_metrics  # noqa: E402

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=123, ignore_eos=True)
POOL_SEED = 7


@pytest.fixture(scope="module")
def cluster():
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster, model, tok):
    with RolloutPool(model, workers=2, tokenizer=tok, continuous_batching_config=CB, num_cpus=0.5, torch_threads=1,
                     seed=POOL_SEED, hang_timeout=60) as pool:
        yield pool


def _reference(model, prompts, n, params):
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        return gen.generate(prompts, n=n, sampling_params=params)


def _assert_same_batch(got, expected, version=0):
    """Same samples in the same order; `version`: the pool's weight version (the reference generator is at 0)."""
    assert got.group_sizes == expected.group_sizes
    assert [s.prompt_index for s in got.samples] == [s.prompt_index for s in expected.samples]
    for a, b in zip(got.samples, expected.samples):
        assert a.prompt_ids == b.prompt_ids
        assert a.completion_ids == b.completion_ids, a.prompt_index
        assert a.weight_versions == [v + version for v in b.weight_versions] and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.policy_logprobs), torch.tensor(b.policy_logprobs), atol=1e-5)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def _worker_versions(pool) -> set[int]:
    return {stats.weight_version for stats in pool.worker_stats().values()}


def test_pool_returns_what_one_generator_returns(pool, model, tok):
    prompts = random_prompts([5, 17, 9, 30, 12], seed=1) + ["w3 w4 w5 w6", [{"role": "user", "content": "w1 w2"}]]
    sizes = [3, 1, 2, 4, 2, 1, 3]
    before = pool.weight_version
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    # Calls without a seed draw their base seed from the pool's generator, as one RolloutGenerator built with the
    # same seed does: the same sequence of calls (the pool's first) gives the same samples.
    with RolloutGenerator(model, tokenizer=tok, continuous_batching_config=CB, seed=POOL_SEED) as one:
        for params in (GREEDY, SEEDED, unseeded):
            batch = pool.generate(prompts, n=sizes, sampling_params=params)
            _assert_same_batch(batch, one.generate(prompts, n=sizes, sampling_params=params))
    assert batch.samples[-1].text == tok.decode(batch.samples[-1].completion_ids, skip_special_tokens=True)
    stats = batch.stats
    prompt_tokens = sum(len(batch.group(j)[0].prompt_ids) for j in range(len(prompts)))
    assert stats["prefill_tokens"] + stats["prefix_hit_tokens"] == prompt_tokens  # each group prefilled once
    workers = stats["workers"]
    assert len(workers) == 2 and sum(w["groups"] for w in workers) == len(prompts)
    biggest = max(len(batch.group(j)[0].prompt_ids) + k * 10 for j, k in enumerate(sizes))
    assert abs(workers[0]["queued_tokens"] - workers[1]["queued_tokens"]) <= biggest  # balanced by queued tokens
    metrics = rollout_metrics(batch)
    for worker in pool.worker_ids:
        assert metrics[f"rollout/worker{worker}/tokens_per_second"] > 0
        assert metrics[f"rollout/worker{worker}/weight_version"] == before
    assert metrics["rollout/workers"] == 2 and metrics["rollout/generated_tokens"] == 10 * sum(sizes)


def test_a_bad_prompt_rejects_the_batch_before_any_worker_runs(pool):
    steps = pool.stats().steps
    with pytest.raises(ValueError, match=r"prompt 2.*nothing was submitted|nothing was submitted.*prompt 2"):
        pool.generate([[1, 2], [3, 4], [5, 10_000]], sampling_params=GREEDY)
    assert pool.stats().steps == steps


def test_weights_reach_every_worker_together(pool, model):
    prompts = random_prompts([13, 6, 22, 9], seed=2)
    new = perturbed(model, seed=3)
    pool.generate(prompts, n=2, sampling_params=GREEDY)  # fills the prefix cache under the old weights
    sync = WeightSync(pool, new)
    old = pool.weight_version
    assert sync() and pool.weight_version == old + 1 and _worker_versions(pool) == {old + 1}
    after = pool.generate(prompts, n=2, sampling_params=GREEDY)
    assert after.stats["prefix_hit_tokens"] == 0  # no KV computed under the old weights is reused
    expected = _reference(new, prompts, 2, GREEDY)
    assert [s.completion_ids for s in after.samples] == [s.completion_ids for s in expected.samples]
    assert all(s.weight_versions == [old + 1] * 10 for s in after.samples)
    assert sync.log(after)["rollout/weight_sync_seconds"] == sync.last_seconds
    assert set(pool.last_update_timing) == {"collect", "publish", "stage", "commit"}

    def reused_buffers():  # a stream that overwrites each tensor once the next is asked for (ZeRO-3 style)
        for name, tensor in model.state_dict().items():
            buffer = tensor.clone()
            yield name, buffer
            buffer.fill_(float("nan"))

    assert pool.update_weights(reused_buffers()) == old + 2 and _worker_versions(pool) == {old + 2}
    back = pool.generate(prompts, sampling_params=GREEDY)
    assert [s.completion_ids for s in back.samples] == [
        s.completion_ids for s in _reference(model, prompts, 1, GREEDY).samples]


def test_an_update_every_worker_rejects_changes_nothing(pool, model):
    prompts = random_prompts([11, 8], seed=4)
    before = pool.generate(prompts, sampling_params=GREEDY)
    version = pool.weight_version
    state = perturbed(model, seed=5).state_dict()
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(WeightUpdateError) as info:
        pool.update_weights(state)
    message = str(info.value)
    assert "rejected by 2 of 2" in message and "none applied" in message and "non-finite" in message
    assert all(f"worker {w}" in message for w in pool.worker_ids)
    assert pool.weight_version == version and _worker_versions(pool) == {version}
    again = pool.generate(prompts, sampling_params=GREEDY)
    assert [s.completion_ids for s in again.samples] == [s.completion_ids for s in before.samples]


class _RefusingActor:
    """A worker's handle whose staging fails as a worker with other weights would refuse an update; every other
    call goes to the real worker."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        return getattr(self._actor, name)

    @property
    def stage_weights(self):
        @ray.remote(num_cpus=0)
        def refuse(payload):
            raise WeightUpdateError("shape mismatch for 'lm_head.weight' (this worker's model differs)")

        return refuse


def test_an_update_one_worker_rejects_is_applied_by_none(pool, model):
    version = pool.weight_version
    refusing, accepting = pool._workers
    real = refusing.actor
    refusing.actor = _RefusingActor(real)
    try:
        with pytest.raises(WeightUpdateError) as info:
            pool.update_weights(perturbed(model, seed=6))
    finally:
        refusing.actor = real
    message = str(info.value)
    assert "rejected by 1 of 2" in message and f"worker {refusing.id}: shape mismatch" in message
    assert pool.weight_version == version and _worker_versions(pool) == {version}
    with pytest.raises(WeightUpdateError, match="no staged update"):  # the accepting worker dropped what it staged
        ray.get(accepting.actor.commit_weights.remote("keep"))


def _generate_in_thread(pool, prompts, n, params):
    out = {}

    def run():
        try:
            out["batch"] = pool.generate(prompts, n=n, sampling_params=params)
        except BaseException as err:  # surfaced by the test
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _wait_until_owing(pool, worker_id):
    wait_for(lambda: any(w.id == worker_id and w.owed for w in pool._workers), f"worker {worker_id} got work")


def test_a_killed_workers_groups_run_again_on_the_others(pool, model, caplog):
    prompts = random_prompts([9, 14, 6, 20, 11, 8], seed=7)
    expected = _reference(model, prompts, 2, SEEDED)
    victim, survivor = pool.worker_ids
    ray.get(pool.actors[0].pause.remote())  # it takes groups but cannot finish them before it is killed
    with caplog.at_level(logging.WARNING, logger="rollout.distributed.pool"):
        thread, out = _generate_in_thread(pool, prompts, 2, SEEDED)
        _wait_until_owing(pool, victim)
        ray.kill(pool.actors[0])
        thread.join(60)
    assert "error" not in out, out.get("error")
    batch = out["batch"]
    _assert_same_batch(batch, expected, pool.weight_version)  # nothing lost, nothing twice, same tokens
    assert pool.worker_ids == [survivor] and [w["worker"] for w in batch.stats["workers"]] == [survivor]
    assert pool.lost[-1][0] == victim and any("left the pool" in r.getMessage() for r in caplog.records)
    new = pool.add_worker()
    assert pool.worker_ids == [survivor, new] and _worker_versions(pool) == {pool.weight_version}
    again = pool.generate(prompts, n=2, sampling_params=SEEDED)
    _assert_same_batch(again, expected, pool.weight_version)
    assert {w["worker"] for w in again.stats["workers"]} == {survivor, new}


def _checked_at(pool, worker, clock) -> None:
    """Wait until the pool has sent `worker` a heartbeat at the clock's present time and read the reply: its hang
    check at that time has run."""
    wait_for(lambda: (worker.beat_sent == clock.now and worker.beat is None) or worker not in pool._workers,
             f"the pool checked worker {worker.id} at clock {clock.now}")


def test_a_hung_worker_is_detected_killed_and_its_groups_run_elsewhere(pool, model):
    """A worker that answers but makes no engine step is kept while it is within hang_timeout and lost once it is
    past it; its groups then run on the other worker. Hang detection runs on the pool's clock, driven here."""
    prompts = random_prompts([10, 7, 16, 12], seed=8)
    expected = _reference(model, prompts, 3, GREEDY)
    hung, healthy = pool.worker_ids
    ray.get(pool.actors[0].pause.remote())  # alive and answering, but its engine makes no step
    real_clock, clock = pool.clock, FakeClock()
    pool.hang_timeout, pool.clock = 2.0, clock
    try:
        thread, out = _generate_in_thread(pool, prompts, 3, GREEDY)
        wait_for(lambda: [w.id for w in pool._workers if w.owed] == [hung],
                 "the healthy worker done, the hung one still owing")
        worker = next(w for w in pool._workers if w.id == hung)
        clock.advance(1.9)
        _checked_at(pool, worker, clock)
        assert pool.worker_ids == [hung, healthy]  # within the limit: a slow worker is not a hung one
        for _ in range(8):  # past it (however late the pool saw its last step), the worker is lost
            clock.advance(0.5)
            _checked_at(pool, worker, clock)
        thread.join(HANG_GUARD_S)
    finally:
        pool.hang_timeout, pool.clock = 60, real_clock
    assert "error" not in out, out.get("error")
    _assert_same_batch(out["batch"], expected, pool.weight_version)
    assert pool.worker_ids == [healthy] and pool.lost[-1][0] == hung and "no engine step" in pool.lost[-1][1]
    pool.add_worker()
    assert pool.size == 2


def _reward_w7(completions, **kwargs):
    return [c.count("w7") / 8 for c in completions]


def test_grpo_trains_through_a_pool(tmp_path, pool, tok):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig

    from trainer_hooks import RolloutGRPOTrainer

    policy = tiny_model("qwen3", lm_head_scale=2.0)
    for config in (policy.config, policy.generation_config):
        config.eos_token_id = tok.eos_token_id
    policy.generation_config.pad_token_id = tok.pad_token_id
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(16)]
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, report_to="none",
                      save_strategy="no", learning_rate=5e-3, seed=0, disable_tqdm=True)
    version = pool.weight_version
    trainer = RolloutGRPOTrainer(model=policy, reward_funcs=_reward_w7, args=args, processing_class=tok,
                                 train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_pool=pool,
                                 rollout_old_logprobs="recompute")
    assert trainer.rollout_generator is pool
    trainer.train()
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert [h["rollout/weight_version"] for h in logs] == [version + 1, version + 2]
    assert max(h["sampling/sampling_logp_difference/max"] for h in logs) < 1e-4  # the pool's logprobs are exact
    assert all(f"rollout/worker{w}/tokens_per_second" in logs[-1] for w in pool.worker_ids)
    assert logs[-1]["rollout/workers"] == 2
    assert trainer.vllm_generation.old_logprobs_static_reason is None  # same dtype: the pool counts as exact


def test_an_async_producer_over_the_pool_keeps_the_bound_with_updates_in_flight(pool, model):
    from rollout import AsyncRollouts

    def length(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    first = pool.weight_version
    with AsyncRollouts(pool, random_prompts([6, 11, 4, 9, 7, 5], seed=8), length, groups_per_batch=2, n=2,
                       sampling_params=params, max_staleness=1, seed=1) as producer:
        batches = []
        for k, batch in enumerate(producer):
            batches.append(batch)
            producer.update_weights(perturbed(model, seed=20 + k))
    assert _worker_versions(pool) == {first + len(batches)}
    groups = [g for b in batches for g in b.groups]
    assert sorted(g.index for g in groups) == list(range(6))
    for batch in batches:
        assert max(batch.versions_behind()) <= 1
        assert all(g.rewards == [12.0, 12.0] for g in batch.groups)
    pool.update_weights(model)  # the module's other tests expect the original weights
