"""The engine end to end: schedule -> run -> sample -> update with a real model.

Random traces (prompts with shared prefixes, n-sample groups, a cache small enough to force preemption, chunked
prefills, random cancellations and late arrivals) keep the queues and the block accounting exact after every step and
end with exactly one terminal output per sequence; a failed forward fails only its step's requests; the prefix cache
only hits under the weights that computed it.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.engine.core.request import RequestStatus
from rollout.engine.engine import LLMEngine
from tests.helpers.models import greedy, random_prompts, run_engine, tiny_model

# --------------------------------------------------------------------------------------------------------------------
# The engine under random traces
# --------------------------------------------------------------------------------------------------------------------

PROMPT_MAX = 40
NEW_MAX = 10


def _blocks_for(tokens: int, page: int) -> int:
    return -(-tokens // page)


def run_random_trace(model, page: int, policy: str, sharing: bool, slack: int, budget: int | None, seed: int):
    """Drive an engine through one random trace; assert the accounting after every step and at the end."""
    rng = random.Random(seed)
    # Small enough to preempt, big enough that any single sequence fits alone: nothing may fail.
    num_blocks = _blocks_for(PROMPT_MAX + NEW_MAX, page) + slack
    engine = LLMEngine(model, GenerationConfig(do_sample=False),
                       ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, scheduler_type=policy,
                                                allow_block_sharing=sharing))
    if budget is not None:
        # The public knob is floored at 256 tokens; a smaller budget here forces chunked prefills of these prompts.
        engine.scheduler.max_batch_tokens = budget

    bases = random_prompts([PROMPT_MAX] * 3, seed=seed % 1000)
    num_requests = rng.randint(4, 16)
    arrivals = []  # (step at which it is submitted, prompt, params)
    for _ in range(num_requests):
        shared = rng.choice([0, 0, 4, 8, 17, PROMPT_MAX])
        prompt = bases[rng.randrange(3)][:shared]
        prompt += random_prompts([rng.randint(0 if shared else 1, PROMPT_MAX - len(prompt))],
                                 seed=rng.randrange(10**6))[0]
        n = rng.choice([1, 1, 1, 2, 3])
        greedy = rng.random() < 0.5
        params = SamplingParams(max_new_tokens=rng.randint(1, NEW_MAX), n=n, ignore_eos=True,
                                temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.5]),
                                top_k=0 if greedy else rng.choice([0, 5]),
                                seed=None if greedy else rng.randrange(1000))
        arrivals.append((rng.choice([0, 0, 0, rng.randint(1, 30)]), prompt, params))
    arrivals.sort(key=lambda a: a[0])

    expected: dict[str, tuple[list[int], int]] = {}  # sequence id -> (prompt, max_new_tokens)
    terminal: dict[str, list] = {}
    cancelled: set[str] = set()
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, prompt, params = arrivals.pop(0)
            for sid in engine.add_request(prompt, sampling_params=params):
                assert sid not in expected, f"sequence id {sid} handed out twice"
                expected[sid] = (prompt, params.max_new_tokens)
        live = [sid for sid in expected if sid not in terminal]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            (out,) = engine.cancel(victim)
            assert out.request_id == victim
            assert out.status == RequestStatus.CANCELLED and out.finish_reason == "cancelled"
            terminal.setdefault(victim, []).append(out)
            cancelled.add(victim)
            assert engine.cancel(victim) == [], "a finished request cannot be cancelled twice"
            engine.check_invariants()
        for out in engine.step():
            if out.is_finished():
                terminal.setdefault(out.request_id, []).append(out)
        engine.check_invariants()
        assert 0 <= engine.stats().free_blocks <= num_blocks
        step += 1
        assert step < 3000, "the engine made no progress"

    stats = engine.stats()
    assert stats.free_blocks == stats.num_blocks == num_blocks, "KV blocks leaked"
    assert stats.running == 0 and stats.waiting == 0
    assert not engine.requests, f"requests left behind: {list(engine.requests)}"
    assert set(terminal) == set(expected), f"missing terminal outputs for {sorted(set(expected) - set(terminal))}"
    for sid, outs in terminal.items():
        assert len(outs) == 1, f"{sid} got {len(outs)} terminal outputs"
        out = outs[0]
        prompt, max_new = expected[sid]
        assert out.prompt_ids == prompt
        n = len(out.generated_tokens)
        assert len(out.logprobs) == len(out.policy_logprobs) == len(out.kept_logmass) == len(out.weight_versions) == n
        assert all(0 <= t < 256 for t in out.generated_tokens)
        if sid in cancelled:
            assert out.status == RequestStatus.CANCELLED and n <= max_new
        else:
            assert out.status == RequestStatus.FINISHED, f"{sid} ended {out.status.name}: {out.error}"
            assert out.finish_reason == "length" and n == max_new, (sid, n, max_new)
    return stats


# Each example runs a real engine: few examples, and no shrinking (a failure prints its draws, which replay it).
ENGINE_SETTINGS = settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@ENGINE_SETTINGS
@given(page=st.sampled_from([4, 8]), policy=st.sampled_from(["fifo", "prefill_first"]), sharing=st.booleans(),
       slack=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_engine_random_trace_keeps_block_accounting_exact(qwen3, page, policy, sharing, slack, seed):
    run_random_trace(qwen3, page, policy, sharing, slack, None, seed)


@ENGINE_SETTINGS
@given(page=st.sampled_from([4, 8]), policy=st.sampled_from(["fifo", "prefill_first"]), sharing=st.booleans(),
       slack=st.integers(0, 6), budget=st.sampled_from([8, 24]), seed=st.integers(0, 2**31 - 1))
def test_engine_random_trace_with_chunked_prefill(qwen3, page, policy, sharing, slack, budget, seed):
    run_random_trace(qwen3, page, policy, sharing, slack, budget, seed)


def test_engine_small_cache_preempts_and_recovers_every_block(qwen3):
    """A deterministic trace that surely preempts, cancels mid-flight and forks n-sample groups."""
    engine = LLMEngine(qwen3, GenerationConfig(do_sample=False),
                       ContinuousBatchingConfig(page_size=4, num_blocks=14))
    prompts = random_prompts([20, 9, 33, 12, 5, 27], seed=4)
    prompts[3] = prompts[0][:16] + [7, 7]  # shares four full blocks with prompt 0
    ids = []
    for i, p in enumerate(prompts):
        ids += engine.add_request(p, sampling_params=SamplingParams(
            max_new_tokens=12, n=3 if i == 1 else 1, temperature=1.0, seed=i, ignore_eos=True))
    done = {}
    for step in range(2000):
        if step in (3, 6):
            victim = ids[2] if step == 3 else ids[0]  # a follower of the n=3 group, then a plain request
            (out,) = engine.cancel(victim)
            assert out.status == RequestStatus.CANCELLED
            done[victim] = out
        for out in engine.step():
            if out.is_finished():
                assert out.request_id not in done
                done[out.request_id] = out
        engine.check_invariants()
        if not engine.has_unfinished():
            break
    stats = engine.stats()
    assert stats.preemptions > 0, "this cache is meant to force preemption"
    assert stats.free_blocks == stats.num_blocks
    assert set(done) == set(ids)
    for rid, out in done.items():
        if rid in (ids[0], ids[2]):
            assert out.status == RequestStatus.CANCELLED
        else:
            assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == 12, (rid, out.error)


@pytest.mark.parametrize("prompt_len", [37, 36])  # 36: every block full, the last one must still be recomputed
def test_prefix_cache_hits_only_under_the_same_weight_version(qwen3, prompt_len):
    prompt = random_prompts([prompt_len], seed=9)[0]
    engine = LLMEngine(qwen3, GenerationConfig(do_sample=False, max_new_tokens=3),
                       ContinuousBatchingConfig(page_size=4, num_blocks=64))

    def run():
        before = engine.stats().prefix_hit_tokens
        (rid,) = engine.add_request(prompt)
        outs = [o for o in run_steps(engine) if o.request_id == rid]
        return engine.stats().prefix_hit_tokens - before, outs[0].generated_tokens

    def assert_full_hit(result):
        hits, tokens = result
        assert tokens == first
        if prompt_len == 37:
            assert hits == 36, "a repeated prompt must reuse its nine full cached blocks"
        else:  # at least one token is computed to get logits: the last block (or its last token) is recomputed
            assert 32 <= hits <= 35

    hits, first = run()
    assert hits == 0
    assert_full_hit(run())
    engine.set_weight_version(1)
    assert run() == (0, first), "KV computed under old weights must not be reused"
    assert_full_hit(run())
    engine.reset_prefix_cache()
    assert run() == (0, first)
    assert engine.stats().free_blocks == 64


def run_steps(engine):
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.is_finished()]
        engine.check_invariants()
    return outs


# ---------------------------------------------------------------------------------------- a failing forward


class FailOnce:
    """Wraps a module's forward: the `fail_at`-th call raises, every other call runs normally."""

    def __init__(self, model, fail_at: int = 1):
        self.model, self.fail_at, self.calls = model, fail_at, 0
        self.original = model.forward

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        return self.original(*args, **kwargs)

    def __enter__(self):
        self.model.forward = self
        return self

    def __exit__(self, *exc):
        del self.model.forward  # back to the class's forward


@pytest.fixture()
def fresh_model():
    return tiny_model("qwen3")


def test_forward_error_fails_only_that_steps_requests(fresh_model):
    prompts = random_prompts([12, 7, 12, 25, 4], seed=17)
    prompts[2] = list(prompts[0])  # same prompt as a request that fails: must not reuse its never-written KV
    ref = generate_batch(fresh_model, prompts, sampling_params=greedy(), progress_bar=False)

    engine = LLMEngine(fresh_model, GenerationConfig(),
                       ContinuousBatchingConfig(page_size=4, num_blocks=64, max_requests_per_batch=2))
    for p in prompts:
        engine.add_request(p, sampling_params=greedy())
    with FailOnce(fresh_model, fail_at=1) as wrapper:
        outputs = run_engine(engine)
    assert wrapper.calls > 1
    assert engine.stats().forward_errors == 1
    failed = sorted(rid for rid, o in outputs.items() if o.status == RequestStatus.FAILED)
    assert failed == ["req_0", "req_1"], "exactly the requests of the failing step fail"
    for rid in failed:
        assert outputs[rid].finish_reason == "error"
        assert f"'{rid}'" in outputs[rid].error and "injected forward failure" in outputs[rid].error
    for rid in ("req_2", "req_3", "req_4"):
        assert outputs[rid].status == RequestStatus.FINISHED
        assert outputs[rid].generated_tokens == ref[rid].generated_tokens, rid


def test_forward_error_mid_generation_in_generate_batch(fresh_model):
    prompts = random_prompts([6, 11, 3, 8], seed=23)
    ref = generate_batch(fresh_model, prompts, sampling_params=greedy(), progress_bar=False)
    config = ContinuousBatchingConfig(page_size=4, max_requests_per_batch=2)
    with FailOnce(fresh_model, fail_at=3):  # a decode step of the first two requests
        outputs = generate_batch(fresh_model, prompts, sampling_params=greedy(), progress_bar=False,
                                 continuous_batching_config=config)
    assert list(outputs) == list(ref)
    assert [o.status for o in outputs.values()] == [RequestStatus.FAILED] * 2 + [RequestStatus.FINISHED] * 2
    for rid in ("req_0", "req_1"):
        assert "injected forward failure" in outputs[rid].error and f"'{rid}'" in outputs[rid].error
    for rid in ("req_2", "req_3"):
        assert outputs[rid].generated_tokens == ref[rid].generated_tokens

