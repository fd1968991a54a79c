"""The warm-up before serving: one step per row bucket, and afterwards an engine that cannot tell it happened."""

import pytest

from rollout import ContinuousBatchingConfig
from rollout.engine.cpu.row_buckets import padded_rows
from rollout.engine.engine import LLMEngine
from rollout.engine.worker.warm_up import bucket_lengths, warm_up
from rollout.manager import ContinuousBatchingManager
from rollout.sampling_params import SamplingParams
from tests.helpers.models import greedy, random_prompts, run_engine, tiny_model


def _engine(model) -> LLMEngine:
    return LLMEngine(model, config=ContinuousBatchingConfig(num_blocks=64, page_size=16))


def test_bucket_lengths_are_every_row_bucket_up_to_the_limit():
    lengths = bucket_lengths(512)
    assert lengths[:7] == [1, 2, 4, 8, 16, 24, 32] and lengths[-4:] == [320, 384, 448, 512]
    assert lengths == sorted({padded_rows(n) for n in range(1, 513)})  # each bucket once, none past the limit
    assert bucket_lengths(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]
    assert bucket_lengths(0) == []


def test_warm_up_runs_each_bucket_once_as_a_prefill_and_leaves_no_trace():
    model = tiny_model()
    engine = _engine(model)
    before = engine.stats()
    rows = []
    run = engine.runner.run
    engine.runner.run = lambda plan: rows.append(sum(plan.query_lens)) or run(plan)
    report = warm_up(engine, 256)
    engine.runner.run = run
    assert report.prompt_lengths == tuple(bucket_lengths(256))
    assert [n for n in rows if n > 1] == [n for n in bucket_lengths(256) if n > 1]  # one prefill step per bucket
    assert rows.count(1) == len(bucket_lengths(256)) + 1  # a one-row decode after each, and the 1-token prompt
    assert engine.stats() == before  # no steps, tokens, cached or used blocks left to see
    engine.check_invariants()


def test_generation_after_a_warm_up_is_what_a_fresh_engine_gives():
    model = tiny_model()
    prompts = random_prompts([5, 17, 40], seed=3)

    def outputs(engine) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, request_id=f"g{i}", sampling_params=greedy(6))
            engine.add_request(prompt, request_id=f"s{i}", sampling_params=SamplingParams(temperature=1.0,
                                                                                          max_new_tokens=6))
        done = run_engine(engine)
        return [done[rid].generated_tokens for rid in sorted(done)]

    fresh = _engine(model)
    fresh.sampler.generator.manual_seed(7)
    warmed = _engine(model)
    warmed.sampler.generator.manual_seed(7)
    warm_up(warmed, 64)
    assert outputs(warmed) == outputs(fresh)  # greedy and unseeded sampled alike: the random state is restored


def test_warm_up_needs_an_idle_engine_and_fits_the_context():
    model = tiny_model()
    engine = _engine(model)
    engine.add_request([1, 2, 3], sampling_params=greedy(2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine, 64)
    run_engine(engine)
    engine.max_positions = 50
    assert max(warm_up(engine, 512).prompt_lengths) == 48  # room left for its two tokens
    small = LLMEngine(model, config=ContinuousBatchingConfig(num_blocks=8, page_size=8))  # 64 tokens of KV
    assert max(warm_up(small, 512).prompt_lengths) == 56  # 56 + 2 tokens fit, 64 + 2 would not


def test_the_manager_warms_up_on_the_calling_thread_and_then_serves():
    manager = ContinuousBatchingManager(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(
        num_blocks=64, page_size=16))
    manager.start()
    try:
        report = manager.warm_up(32)
        assert report.prompt_lengths == (1, 2, 4, 8, 16, 24, 32)
        assert manager.stats().steps == 0 and manager.stats().cached_blocks == 0
        rid = manager.add_request([4, 5, 6], max_new_tokens=3)
        assert len(manager.get_result(rid, timeout=60).generated_tokens) == 3
    finally:
        manager.stop()
