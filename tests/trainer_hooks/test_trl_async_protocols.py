"""RolloutWorker and RolloutWeightTransfer against TRL's async GRPO protocols, driven the way TRL's AsyncGRPOTrainer
drives them (the trainer itself needs vLLM and NCCL, so it does not run here)."""

import inspect
import queue

import pytest

pytest.importorskip("trl")
from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

from rollout import ContinuousBatchingConfig, RolloutGenerator, SamplingParams
from tests.helpers.models import perturbed, random_prompts, tiny_model
from tests.helpers.waiting import HANG_GUARD_S, wait_for
from tests.rl.test_async_rollouts import FakeBackend
from trainer_hooks.trl_async_protocols import RolloutWeightTransfer, RolloutWorker

CB = ContinuousBatchingConfig(page_size=8, num_blocks=256)


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


@pytest.mark.parametrize("ours, theirs", [(RolloutWorker, RolloutWorkerProtocol),
                                          (RolloutWeightTransfer, WeightTransferProtocol)])
def test_every_protocol_method_is_there_with_trls_parameters(ours, theirs):
    methods = [name for name, value in vars(theirs).items() if callable(value) and not name.startswith("_")]
    assert methods
    for name in methods:
        assert list(inspect.signature(getattr(ours, name)).parameters) == list(
            inspect.signature(getattr(theirs, name)).parameters), name


def test_driven_like_trls_trainer_samples_stay_within_the_bound_and_the_engine_is_freed():
    model = tiny_model("qwen3")
    gen = RolloutGenerator(model, continuous_batching_config=CB)
    worker = RolloutWorker(gen, random_prompts([5, 8, 3, 11, 6, 9, 4, 7, 10, 12] * 2, seed=3), length_reward,
                           groups_per_step=2, n=2, sampling_params=SamplingParams(temperature=1.0, max_new_tokens=10),
                           max_staleness=1)
    transfer = RolloutWeightTransfer(worker)
    assert isinstance(worker.rollout_buffer, queue.Queue) and isinstance(worker.metrics_queue, queue.Queue)
    version = 0

    def sync(source):  # TRL's _sync_weights: pause, stream (name, tensor) pairs, resume, bump the version
        nonlocal version
        transfer.pause()
        transfer.send_weights(iter(source.named_parameters()))
        transfer.resume()
        version += 1
        worker.update_model_version(version)

    transfer.init_weight_transfer()
    sync(model)
    worker.start()
    for step in range(4):
        samples = [worker.rollout_buffer.get(timeout=HANG_GUARD_S) for _ in range(4)]
        for sample in samples:
            assert 0 <= version - sample.model_version <= 1, "TRL would drop it as stale"
            mask = sample.completion_mask
            assert len(sample.input_ids) == len(mask) == len(sample.old_log_probs)
            assert (sample.old_log_probs[mask == 0] == 0).all() and (sample.old_log_probs[mask == 1] < 0).all()
            assert sample.metrics["rewards/length_reward"] == float(mask.sum())
        by_group: dict[int, list[float]] = {}
        for sample in samples:
            by_group.setdefault(sample.group_id, []).append(sample.advantage)
        assert all(abs(sum(a)) < 1e-6 for a in by_group.values()), "advantages are normalised within each group"
        worker.check_health(stale_after_s=HANG_GUARD_S)
        sync(perturbed(model, seed=step + 1))
    assert not worker.metrics_queue.empty()
    worker.stop()
    transfer.destroy()
    stats = gen.manager.stats()
    assert stats.free_blocks == stats.num_blocks and not gen.manager.engine.has_unfinished()
    assert gen.weight_version == version
    gen.close()


def test_a_dead_backend_fails_check_health():
    backend = FakeBackend()
    backend.fail_with["dies"] = RuntimeError("engine process died")
    worker = RolloutWorker(backend, ["dies", "b"], length_reward, groups_per_step=1, n=2, max_staleness=0)
    worker.start()
    wait_for(lambda: worker._error is not None, "the pump saw the backend fail")
    with pytest.raises(RuntimeError, match="engine process died"):
        worker.check_health(stale_after_s=HANG_GUARD_S)
    worker.stop()


def test_stop_before_any_sample_is_taken_frees_everything():
    model = tiny_model("qwen3")
    with RolloutGenerator(model, continuous_batching_config=CB) as gen:
        worker = RolloutWorker(gen, random_prompts([6] * 30, seed=1), length_reward, groups_per_step=2, n=2,
                               sampling_params=SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True),
                               max_staleness=1, buffer_size=1)
        worker.start()
        wait_for(lambda: gen.manager.stats().used_blocks > 0, "generation started")
        worker.stop()
        stats = gen.manager.stats()
        assert stats.free_blocks == stats.num_blocks
