"""CPU offload at the scheduler level: preempted sequences' KV goes to a swap space and comes back, with no model.

A fake KV store stands in for the cache and the host storage: the "forward" writes each computed token into its slot,
forks and swaps copy slots, and after every step each running sequence's cached tokens must read back as its own
tokens. So a block swapped back into the wrong place, a leak in either pool, or a recompute where a swap was chosen
fails here.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.engine.core.block_pool import BlockPool
from rollout.engine.core.request import RequestStatus
from rollout.engine.core.scheduler import Scheduler
from rollout.engine.core.stopping import StopChecker
from rollout.engine.core.swap_space import PreemptionCosts, SwapSpace
from tests.engine.core.test_scheduler import EOS, PAGE, assert_drained, group, record_once, tokens_for


class FakeKV:
    """Slots of the device cache and of the host swap space, each holding the token whose KV it stands for."""

    def __init__(self):
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}
        self.copied_in = 0

    def copy_block(self, src, dst, tokens):
        for o in range(tokens):
            self.device[dst, o] = self.device.get((src, o))

    def copy_out(self, device_blocks, host_blocks):
        for d, h in zip(device_blocks, host_blocks, strict=True):
            for o in range(PAGE):
                self.host[h, o] = self.device.get((d, o))

    def copy_in(self, host_blocks, device_blocks):
        self.copied_in += len(host_blocks)
        for h, d in zip(host_blocks, device_blocks, strict=True):
            for o in range(PAGE):
                self.device[d, o] = self.host.get((h, o))

    def forward(self, plan):
        for req, num in zip(plan.requests, plan.query_lens):
            for table in req.block_tables:  # every KV group writes the step's tokens into its own blocks
                for pos in range(req.num_computed, req.num_computed + num):
                    self.device[table[pos // PAGE], pos % PAGE] = req.tokens[pos]

    def check(self, sched):
        for req in sched.running:
            for table, reclaimed in zip(req.block_tables, req.num_reclaimed):
                for pos in range(reclaimed * PAGE, req.num_computed):  # what a group still holds
                    assert self.device.get((table[pos // PAGE], pos % PAGE)) == req.tokens[pos], (
                        f"{req} reads the wrong KV at position {pos}")


def make(num_blocks=8, swap_blocks=16, budget=64, costs=None, share=True, windows=(None,)):
    kv = FakeKV()
    swap = SwapSpace(swap_blocks, kv.copy_out, kv.copy_in, costs) if swap_blocks else None
    sched = Scheduler(BlockPool(num_blocks, enable_prefix_cache=share), PAGE, budget, 64, stop=StopChecker(),
                      copy_block=kv.copy_block, share_prefills=share, windows=windows, swap=swap)
    return sched, kv


def step(sched, kv, token=7, version=0):
    plan = sched.schedule()
    kv.forward(plan)
    outputs = sched.update(plan, tokens_for(plan, token), version)
    sched.check_invariants()
    kv.check(sched)
    return plan, outputs


def drain(sched, kv, token=7, limit=400):
    finished = {}
    for _ in range(limit):
        if not sched.has_work():
            return finished
        _, outputs = step(sched, kv, token)
        finished.update({o.request_id: o for o in outputs if o.is_finished()})
    raise AssertionError("the scheduler made no progress")


def preemption_workload(sched):
    for i in range(4):
        sched.add(group(f"r{i}", [i + 1] * 9, max_new_tokens=10))


def until_one_is_swapped():
    """Three requests in a cache for two: stepped until the first preemption has swapped one out."""
    sched, kv = make(num_blocks=6)
    for i in range(3):
        sched.add(group(f"r{i}", [i + 1] * 7, max_new_tokens=12))
    while not any(r.host_blocks for r in sched.waiting):
        step(sched, kv)
    (swapped,) = [r for r in sched.waiting if r.host_blocks]
    return sched, kv, swapped


def test_a_preempted_sequence_swaps_out_and_resumes_without_recomputing():
    recompute, _ = make(swap_blocks=0)
    preemption_workload(recompute)
    baseline = drain(recompute, FakeKV())
    sched, kv = make()
    preemption_workload(sched)
    finished = drain(sched, kv)
    assert sched.num_preemptions > 0, "this cache is meant to force preemption"
    assert {rid: o.generated_tokens for rid, o in finished.items()} == {
        rid: o.generated_tokens for rid, o in baseline.items()}
    assert recompute.counters["prefill_tokens"] > sched.counters["prefill_tokens"] == 4 * 9, (
        "with room to swap, no prompt or generated token is computed twice")
    assert kv.copied_in == sched.kv.swap.counters["swapped_in_blocks"] > 0
    assert sched.pool.num_free == sched.pool.num_blocks and sched.kv.swap.num_free == sched.kv.swap.num_blocks


def test_a_swapped_sequence_keeps_its_computed_tokens_and_resumes_with_one():
    sched, kv, swapped = until_one_is_swapped()
    assert swapped.status == RequestStatus.PENDING and swapped.num_pending == 1
    assert swapped.block_tables == [[]] and len(swapped.host_blocks[0]) == -(-swapped.num_computed // PAGE)
    while swapped.host_blocks:
        plan, _ = step(sched, kv)
    assert plan.query_lens[plan.requests.index(swapped)] == 1, "it resumes as a decode, not a prefill"


def test_no_room_in_the_swap_space_means_recompute():
    sched, kv = make(swap_blocks=1)
    preemption_workload(sched)
    drain(sched, kv)
    assert sched.num_preemptions > 0 and sched.kv.swap.counters["swapped_out_blocks"] == 0
    assert sched.counters["prefill_tokens"] > 4 * 9


def test_the_cheaper_of_swap_and_recompute_is_chosen():
    slow_copies = PreemptionCosts(seconds_per_token=1e-6, seconds_per_block=1.0, smoothing=0.0)
    sched, kv = make(costs=slow_copies)
    preemption_workload(sched)
    drain(sched, kv)
    assert sched.num_preemptions > 0 and sched.kv.swap.counters["swapped_out_blocks"] == 0
    assert PreemptionCosts().swap_is_cheaper(1, 100), "before anything is measured, swapping wins"
    costs = PreemptionCosts(smoothing=0.5)
    costs.observe_forward(tokens=100, seconds=1.0)
    costs.observe_copy(blocks=10, seconds=0.001)
    assert costs.swap_is_cheaper(recompute_tokens=40, block_copies=20)
    assert not costs.swap_is_cheaper(recompute_tokens=0, block_copies=2)
    costs.observe_copy(blocks=1, seconds=1.0)  # a moving average: one slow copy moves it halfway
    assert costs.seconds_per_block == (0.0001 + 1.0) / 2


def test_a_weight_update_that_recomputes_drops_swapped_kv():
    sched, kv, _ = until_one_is_swapped()
    sched.weight_version = 1
    sched.preempt_all()
    assert all(not r.host_blocks and r.num_computed == 0 for r in sched.waiting)
    assert sched.kv.swap.num_free == sched.kv.swap.num_blocks
    sched.check_invariants()
    drain(sched, kv)


def test_cancelling_a_swapped_sequence_frees_its_host_blocks():
    sched, kv, swapped = until_one_is_swapped()
    (out,) = sched.cancel(swapped.request_id)
    assert out.status == RequestStatus.CANCELLED and sched.kv.swap.num_free == sched.kv.swap.num_blocks
    sched.check_invariants()
    drain(sched, kv)


def test_swapped_blocks_still_in_the_prefix_cache_are_not_copied_back():
    sched, kv = make(num_blocks=10, swap_blocks=32)
    sched.add(group("g", list(range(1, 10)), n=3, max_new_tokens=14))  # 2 full prompt blocks, shared by 3
    finished = drain(sched, kv)
    swap = sched.kv.swap
    assert sched.num_preemptions > 0 and len(finished) == 3
    assert swap.counters["swapped_in_blocks"] < swap.counters["swapped_out_blocks"], (
        "the shared prompt blocks stayed in the cache and were reused")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.integers(5, 24), swap_blocks=st.integers(0, 24),
       budget=st.sampled_from([4, 16, 64]), share=st.booleans(),
       windows=st.sampled_from([(None,), (6,), (None, 6), (6, None, 9)]))
def test_random_traces_with_swaps_cancels_and_weight_updates_leak_nothing(seed, blocks, swap_blocks, budget, share,
                                                                           windows):
    """Any mix of KV groups (one full, one sliding, a hybrid of both, two windows): every sequence reads back its own
    tokens from every group, and nothing leaks."""
    rng = random.Random(seed)
    sched, kv = make(num_blocks=blocks * len(windows), swap_blocks=swap_blocks * len(windows), budget=budget,
                     share=share, windows=windows)
    prompts = [[rng.randint(0, 50) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    expected, finished, version = set(), {}, 0
    for step_no in range(800):
        if step_no < 40 and rng.random() < 0.4:
            g = group(f"r{step_no}", rng.choice(prompts), n=rng.choice([1, 1, 3]), max_new_tokens=rng.randint(1, 9))
            sched.add(g)
            expected.update(g.ids)
        if sched.requests and rng.random() < 0.08:
            for out in sched.cancel(rng.choice(list(sched.requests))):
                finished[out.request_id] = out
        if rng.random() < 0.05:  # a weight update: KV kept (new prefix keys) or recomputed
            version += 1
            sched.weight_version = version
            if rng.random() < 0.5:
                sched.preempt_all()
            sched.check_invariants()
        if step_no > 40 and not sched.has_work():
            break
        _, outputs = step(sched, kv, token=rng.choice([7, 8, EOS]), version=version)
        record_once(finished, outputs)
    assert_drained(sched, finished, expected)
    if sched.kv.swap is not None:
        assert sched.kv.swap.num_free == sched.kv.swap.num_blocks


def test_a_group_swapped_in_after_its_prompt_left_the_cache_shares_it_again():
    sched, kv = make(num_blocks=16, swap_blocks=32)
    sched.add(group("g", list(range(1, 10)), n=3, max_new_tokens=8))  # 2 full prompt blocks, shared by 3
    while len(sched.running) < 3:
        step(sched, kv)
    for request in reversed(list(sched.running)):
        sched._preempt(request)
    assert all(r.host_blocks for r in sched.waiting)
    sched.pool.release(sched.pool.allocate(sched.pool.num_free))  # evicts every cached block: the prompt is gone
    assert sched.pool.num_cached == 0
    while sched.waiting:
        step(sched, kv)
    heads = {tuple(r.block_tables[0][:2]) for r in sched.running}
    assert len(heads) == 1, "the first to swap in publishes the prompt blocks, the others reuse them"
    drain(sched, kv)
