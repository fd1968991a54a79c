"""Kept KV: a finished sequence's blocks carried into the request that continues it, and given up when needed."""

import pytest

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import LLMEngine
from tests.helpers.models import random_prompts, run_engine, tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _engine(model, num_blocks=64, **kw):
    return LLMEngine(model, config=ContinuousBatchingConfig(page_size=8, num_blocks=num_blocks, **kw))


def _run(engine, max_steps=500):
    """Step until idle, checking the block accounting (kept blocks included) after every step."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.is_finished():
                done[out.request_id] = out
        engine.check_invariants()
    raise AssertionError("the engine did not finish")


def _reference(model, ids, params=GREEDY):
    engine = _engine(model)
    engine.add_request(ids, "ref", params)
    return run_engine(engine)["ref"]


@pytest.mark.parametrize("prompt_len", [13, 16])  # a partial last block, and none
def test_a_continuation_prefills_only_what_was_appended(model, prompt_len):
    engine = _engine(model)
    prompt = random_prompts([prompt_len], seed=1)[0]
    engine.add_request(prompt, "a", GREEDY, keep_kv=True)
    first = _run(engine)["a"]
    before = engine.stats()
    assert before.used_blocks == engine.scheduler.kv.blocks_for(prompt_len + 4)  # held for the continuation
    appended = [7, 8, 9]
    conversation = prompt + first.generated_tokens + appended
    engine.add_request(conversation, "b", GREEDY, continues="a")
    second = _run(engine)["b"]
    after = engine.stats()
    assert after.prefill_tokens - before.prefill_tokens == 1 + len(appended)  # "a"'s last token + the appended
    assert after.used_blocks == 0  # "b" was not kept: everything released (full blocks stay cached)
    ref = _reference(model, conversation)
    assert second.generated_tokens == ref.generated_tokens
    assert second.policy_logprobs == pytest.approx(ref.policy_logprobs, abs=1e-5)


def test_a_group_keeps_each_member_and_release_frees_it(model):
    engine = _engine(model)
    engine.add_request(random_prompts([10], seed=2)[0], "g",
                       SamplingParams(temperature=1.0, max_new_tokens=4, seed=0, n=3, ignore_eos=True), keep_kv=True)
    outs = _run(engine)
    assert sorted(outs) == ["g#0", "g#1", "g#2"] and engine.stats().used_blocks > 0
    assert [engine.release_kept(rid) for rid in sorted(outs)] == [True, True, True]
    assert engine.release_kept("g#0") is False  # released once
    assert engine.stats().used_blocks == 0
    engine.check_invariants()


def test_failed_cancelled_and_mismatched_sequences_keep_nothing(model):
    engine = _engine(model)
    prompt = random_prompts([12], seed=3)[0]
    engine.add_request(prompt, "c", GREEDY, keep_kv=True)
    engine.step()
    engine.cancel("c")
    assert engine.stats().used_blocks == 0 and engine.release_kept("c") is False
    engine.add_request(prompt, "k", GREEDY, keep_kv=True)
    kept = _run(engine)["k"]
    other = prompt[:5] + [1, 2, 3]  # does not extend "k": served like a new prompt, "k"'s blocks released
    engine.add_request(other, "x", GREEDY, continues="k")
    out = _run(engine)["x"]
    assert out.generated_tokens == _reference(model, other).generated_tokens
    assert engine.stats().used_blocks == 0 and engine.release_kept("k") is False
    assert kept.generated_tokens


def test_kept_sequences_give_way_when_the_cache_runs_dry(model):
    """Kept KV is a cache: with few blocks, new work evicts it (oldest first) rather than waiting or preempting, and a
    continuation whose kept sequence was evicted is still served exactly (through the prefix cache)."""
    engine = _engine(model, num_blocks=12, safety_margin=0.0)
    prompts = random_prompts([14, 14, 14], seed=4)
    for j, p in enumerate(prompts[:2]):
        engine.add_request(p, f"k{j}", GREEDY, keep_kv=True)
    kept = _run(engine)
    assert engine.stats().used_blocks == 6  # 2 x 3 blocks held
    engine.add_request(prompts[2] + list(range(60)), "big", GREEDY)  # needs 10 blocks: both kept ones must go
    _run(engine)
    assert engine.stats().preemptions == 0 and engine.stats().used_blocks == 0
    conversation = prompts[0] + kept["k0"].generated_tokens + [5, 6]
    engine.add_request(conversation, "k0-next", GREEDY, continues="k0")
    assert _run(engine)["k0-next"].generated_tokens == _reference(model, conversation).generated_tokens


def test_a_recompute_weight_update_drops_kept_kv(model):
    engine = _engine(model)
    engine.add_request(random_prompts([9], seed=6)[0], "k", GREEDY, keep_kv=True)
    _run(engine)
    assert engine.stats().used_blocks > 0
    engine.set_weight_version(1, recompute=False)
    assert engine.stats().used_blocks > 0  # "keep": like running requests, kept KV stays
    engine.set_weight_version(2, recompute=True)
    assert engine.stats().used_blocks == 0 and engine.release_kept("k") is False


def test_the_generator_carries_kv_between_calls(model):
    """generate(keep_kv=True) then generate(continues=...): the second call prefills only what was appended."""
    from rollout import RolloutGenerator

    prompts = random_prompts([13, 21], seed=7)
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64)
    with RolloutGenerator(model, continuous_batching_config=config) as gen:
        first = gen.generate(prompts, sampling_params=GREEDY, keep_kv=True)
        follow = [s.prompt_ids + s.completion_ids + [3, 4] for s in first.samples]
        second = gen.generate(follow, sampling_params=GREEDY, keep_kv=True,
                              continues=[s.sequence_id for s in first.samples])
        assert second.stats["prefill_tokens"] == 2 * (1 + 2)
        assert gen.stats().used_blocks > 0
        assert gen.release_kv([s.sequence_id for s in second.samples]) == 2
        assert gen.stats().used_blocks == 0
        with pytest.raises(ValueError, match="one sequence id"):
            gen.generate(follow, continues=[None])
    for s, prompt in zip(second.samples, follow, strict=True):
        assert s.completion_ids == _reference(model, prompt).generated_tokens
