"""The scheduler alone, with no model: fake prompts, fake sampled tokens, real block pool.

It owns the request lifecycle, so every rule is checked here directly: what a step runs, appending and stopping,
forking n-sample groups off one prefill, identical prompts joining it, cancel hand-over, chunking, preemption, failures.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from rollout.engine.core.block_pool import BlockPool
from rollout.engine.core.request import ErrorKind, RequestStatus
from rollout.engine.core.scheduler import Scheduler
from rollout.engine.core.sequence_group import SequenceGroup, sequence_ids
from rollout.engine.core.stopping import StopChecker
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.sample.rows import SampleResult
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed

EOS = 99
PAGE = 4


def make_scheduler(num_blocks=32, budget=64, share=True, max_positions=None, policy="fifo", copies=None):
    def copy_block(src, dst, tokens):
        if copies is not None:
            copies.append((src, dst, tokens))
    return Scheduler(BlockPool(num_blocks, enable_prefix_cache=share), PAGE, budget, 64, policy=policy,
                     stop=StopChecker(max_positions), copy_block=copy_block, share_prefills=share)


def group(request_id, prompt, n=1, **params):
    params.setdefault("max_new_tokens", 4)
    sampling = resolve_sampling(SamplingParams(n=n, **params), GenerationConfig(eos_token_id=EOS))
    return SequenceGroup.create(request_id, list(prompt), sampling, n)


def tokens_for(plan, token=7):
    n = len(plan.sampled)
    return SampleResult([token] * n, [-0.5] * n, [-1.0] * n, [-0.5] * n)


def step(sched, token=7, version=0):
    plan = sched.schedule()
    outputs = sched.update(plan, tokens_for(plan, token), version)
    sched.check_invariants()
    return plan, outputs


def run_to_end(sched, token=7, limit=200):
    finished = {}
    for _ in range(limit):
        if not sched.has_work():
            return finished
        _, outputs = step(sched, token)
        finished.update({o.request_id: o for o in outputs if o.is_finished()})
    raise AssertionError("the scheduler made no progress")


def test_prefill_then_decode_appends_with_the_logprob_contract():
    sched = make_scheduler()
    sched.add(group("a", range(10)))
    plan, outputs = step(sched, token=5, version=3)
    assert plan.query_lens == [10] and plan.start_positions == [0] and plan.sample_rows == [0]
    req = sched.requests["a"]
    assert req.num_computed == 10 and req.generated_tokens == [5] and req.weight_versions == [3]
    assert (req.logprobs, req.policy_logprobs, req.kept_logmass) == ([-0.5], [-1.0], [-0.5])
    assert req.status == RequestStatus.DECODING and outputs == []
    plan, _ = step(sched)
    assert plan.query_lens == [1] and plan.start_positions == [10] and plan.token_ids == [5]
    assert sched.counters["prefill_tokens"] == 10 and sched.counters["decode_tokens"] == 1


@pytest.mark.parametrize("params, token, reason, generated", [
    (dict(max_new_tokens=3), 7, "length", 3),
    (dict(max_new_tokens=5), EOS, "stop", 1),
    (dict(max_new_tokens=5, min_new_tokens=3), EOS, "stop", 3),  # EOS ignored until min_new_tokens are out
    (dict(max_new_tokens=5, ignore_eos=True), EOS, "length", 5),
    (dict(max_new_tokens=5, stop_token_ids=[7]), 7, "stop", 1),
])
def test_stop_rule(params, token, reason, generated):
    sched = make_scheduler()
    sched.add(group("a", [1, 2, 3], **params))
    out = run_to_end(sched, token)["a"]
    assert out.finish_reason == reason and len(out.generated_tokens) == generated
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.requests and not sched.groups


def test_model_context_ends_a_sequence():
    sched = make_scheduler(max_positions=6)
    sched.add(group("a", [1, 2, 3], max_new_tokens=50))
    assert run_to_end(sched)["a"].generated_tokens == [7, 7, 7]


def test_group_prefills_once_and_forks_sharing_full_blocks():
    copies = []
    sched = make_scheduler(copies=copies)
    g = group("g", range(6), n=3, temperature=1.0, seed=11)
    assert g.ids == sequence_ids("g", 3) == ["g#0", "g#1", "g#2"]
    assert [m.sampling.seed for m in g.members] == [11, derive_seed(11, 1, SeedStream.SAMPLE),
                                                    derive_seed(11, 2, SeedStream.SAMPLE)]
    sched.add(g)
    plan, _ = step(sched)
    assert plan.query_lens == [6], "one prefill for the whole group"
    assert [m.request_id for m in plan.sampled] == ["g#0", "g#1", "g#2"] and plan.logit_rows == [0, 0, 0]
    leader, a, b = g.members
    (lead,), (first,), (second,) = leader.block_tables, a.block_tables, b.block_tables
    assert first[0] == second[0] == lead[0], "the full block is shared"
    assert sched.pool.ref_counts[lead[0]] == 3
    assert len({lead[1], first[1], second[1]}) == 3, "the partial block is copied"
    assert copies == [(lead[1], first[1], 2), (lead[1], second[1], 2)]
    plan, _ = step(sched)
    assert plan.query_lens == [1, 1, 1]
    assert run_to_end(sched).keys() == {"g#0", "g#1", "g#2"}
    assert sched.pool.num_free == sched.pool.num_blocks


def test_identical_prompts_join_one_prefill_until_it_starts():
    sched = make_scheduler()
    sched.add(group("a", range(8)))
    sched.add(group("b", range(8), n=2))
    plan, _ = step(sched)
    assert plan.query_lens == [8] and {m.request_id for m in plan.sampled} == {"a", "b#0", "b#1"}
    sched.add(group("c", range(8)))  # "a" started: "c" gets its own entry (and reuses the cached full blocks)
    plan, _ = step(sched)
    assert sorted(plan.query_lens) == [1, 1, 1, 4]
    assert sched.requests["c"].num_prefix_hit_tokens == 4


def test_no_joining_without_sharing():
    sched = make_scheduler(share=False)
    sched.add(group("a", range(8)))
    sched.add(group("b", range(8)))
    plan, _ = step(sched)
    assert plan.query_lens == [8, 8]


def test_cancelling_a_queued_leader_hands_its_group_over():
    sched = make_scheduler()
    sched.add(group("a", range(8)))
    sched.add(group("b", range(8), n=2))
    (out,) = sched.cancel("a")
    assert out.status == RequestStatus.CANCELLED and out.finish_reason == "cancelled"
    assert sched.waiting[0].request_id == "b#0"
    sched.add(group("c", range(8)))  # still joins: the heir keeps the group open
    plan, _ = step(sched)
    assert plan.query_lens == [8] and {m.request_id for m in plan.sampled} == {"b#0", "b#1", "c"}
    assert sched.cancel("a") == [] and sched.cancel("nope") == []


def test_cancel_by_request_id_cancels_every_live_member():
    sched = make_scheduler()
    sched.add(group("g", range(5), n=3))
    step(sched)
    outputs = sched.cancel("g")
    assert sorted(o.request_id for o in outputs) == ["g#0", "g#1", "g#2"]
    assert not sched.requests and not sched.groups and sched.pool.num_free == sched.pool.num_blocks


def test_cancelling_a_waiting_fork_leaves_the_rest():
    sched = make_scheduler()
    sched.add(group("g", range(5), n=3))
    (out,) = sched.cancel("g#1")
    assert out.request_id == "g#1"
    plan, _ = step(sched)
    assert [m.request_id for m in plan.sampled] == ["g#0", "g#2"]


def test_chunked_prefill_samples_only_after_the_last_chunk():
    sched = make_scheduler(budget=4)
    sched.add(group("a", range(10)))
    lens = []
    while not sched.requests["a"].generated_tokens:
        plan, _ = step(sched)
        lens.append(plan.query_lens[0])
        assert bool(plan.sampled) == (sum(lens) == 10)
    assert lens == [4, 4, 2] and sched.num_chunked_prefills == 2


def test_preemption_recomputes_and_everything_completes():
    sched = make_scheduler(num_blocks=6, budget=64)
    for i in range(4):
        sched.add(group(f"r{i}", [i + 1] * 5, max_new_tokens=8))
    finished = run_to_end(sched)
    assert sched.num_preemptions > 0, "this pool is meant to force preemption"
    assert all(len(finished[f"r{i}"].generated_tokens) == 8 for i in range(4))
    assert sched.pool.num_free == sched.pool.num_blocks


def test_a_prompt_that_can_never_fit_fails_with_its_group():
    sched = make_scheduler(num_blocks=2)
    sched.add(group("big", range(20), n=2))
    sched.add(group("ok", [1, 2]))
    finished = run_to_end(sched)
    for rid in ("big#0", "big#1"):
        assert finished[rid].status == RequestStatus.FAILED and finished[rid].error_kind == ErrorKind.CAPACITY
        assert f"request {rid!r}" in finished[rid].error and "num_blocks" in finished[rid].error
    assert finished["ok"].status == RequestStatus.FINISHED


def test_a_failed_forward_fails_its_requests_and_hands_forks_over():
    sched = make_scheduler()
    sched.add(group("g", range(6), n=2))
    plan = sched.schedule()
    (out,) = sched.fail_step(plan, "RuntimeError('boom')")
    assert out.request_id == "g#0" and out.error_kind == ErrorKind.FORWARD and "boom" in out.error
    sched.check_invariants()
    assert [r.request_id for r in sched.waiting] == ["g#1"], "the fork gets a prefill of its own"
    assert run_to_end(sched)["g#1"].status == RequestStatus.FINISHED


def test_fail_all_and_duplicate_ids():
    sched = make_scheduler()
    sched.add(group("g", range(6), n=2))
    with pytest.raises(ValueError, match="'g' is already in use"):
        sched.add(group("g", [1]))
    step(sched)
    outputs = sched.fail_all("stopped")
    assert {o.error_kind for o in outputs} == {ErrorKind.SHUTDOWN} and len(outputs) == 2
    assert not sched.has_work() and sched.pool.num_free == sched.pool.num_blocks


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(8, 40), budget=st.sampled_from([4, 16, 64]),
       policy=st.sampled_from(["fifo", "prefill_first"]))
def test_random_traces_keep_every_invariant(seed, blocks, budget, policy):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=blocks, budget=budget, policy=policy)
    prompts = [[rng.randint(0, 50) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    expected, finished = set(), {}
    for step_no in range(600):
        if step_no < 40 and rng.random() < 0.4:
            rid = f"r{step_no}"
            g = group(rid, rng.choice(prompts), n=rng.choice([1, 1, 3]), max_new_tokens=rng.randint(1, 6))
            sched.add(g)
            expected.update(g.ids)
        if sched.requests and rng.random() < 0.1:
            for out in sched.cancel(rng.choice(list(sched.requests))):
                finished[out.request_id] = out
        if step_no > 40 and not sched.has_work():
            break
        _, outputs = step(sched, token=rng.choice([7, 8, EOS]))
        record_once(finished, outputs)
    assert_drained(sched, finished, expected)


def record_once(finished: dict, outputs) -> None:
    """Keep a trace's terminal outputs; no sequence may finish twice."""
    for out in outputs:
        assert out.request_id not in finished, f"{out.request_id} finished twice"
        finished[out.request_id] = out


def assert_drained(sched, finished: dict, expected: set) -> None:
    """A trace ended: every sequence finished once and every block is back in the pool."""
    assert not sched.has_work(), "the trace did not drain"
    assert set(finished) == expected
    assert sched.pool.num_free == sched.pool.num_blocks and not sched.groups
