"""The KV manager alone, with no scheduler and no model: block tables over a real pool.

What it promises: `fit` says how many more tokens fit (freeing kept KV for them first) and allocates nothing;
`allocate` gives exactly the blocks those tokens need; prefix hits are attached only under the same weight version and
always leave a token to compute; full blocks are published once; a fork shares full blocks and copies the partial
one; `free` returns everything; kept sequences are adopted only by a continuation of all their tokens. A randomized
trace checks the pool's reference counts against the live tables after every operation and that nothing leaks.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import GenerationConfig

from rollout.engine.core.block_pool import BlockPool, hash_chain
from rollout.engine.core.kv_manager import KVManager
from rollout.engine.core.sequence_group import SequenceGroup
from rollout.engine.sample.resolve import resolve_sampling
from rollout.sampling_params import SamplingParams

PAGE = 4


def request(request_id: str, tokens, **params):
    sampling = resolve_sampling(SamplingParams(max_new_tokens=8, **params), GenerationConfig())
    return SequenceGroup.create(request_id, list(tokens), sampling, 1).leader


def manager(num_blocks=16, copies=None):
    return KVManager(BlockPool(num_blocks), PAGE, lambda src, dst, n: copies.append((src, dst, n))
                     if copies is not None else None)


def compute(kv: KVManager, req) -> None:
    """What a step does for `req`: room for its pending tokens, publish what becomes full, count them computed."""
    num = req.num_pending
    assert kv.fit(req, num) == num
    kv.allocate(req, num)
    kv.publish_full_blocks(req, req.num_computed + num)
    req.num_computed += num


def test_fit_counts_blocks_and_allocates_nothing():
    kv = manager(num_blocks=3)
    req = request("a", range(10))
    assert kv.blocks_for(10) == 3 and kv.blocks_for(12) == 3 and kv.blocks_for(13) == 4
    assert kv.fit(req, 10) == 10 and kv.pool.num_free == 3
    assert kv.fit(req, 20) == 12  # three blocks of four: the most that fits
    kv.allocate(req, 10)
    assert len(req.block_tables[0]) == 3 and kv.pool.num_free == 0
    req.num_computed = 10
    assert kv.fit(req, 2) == 2 and kv.fit(req, 3) == 2  # the last block has room for two more
    assert not kv.fits_ever(13) and kv.fits_ever(12)


def test_prefix_hits_need_the_same_weights_and_leave_a_token_to_compute():
    kv = manager()
    first = request("a", range(8))
    kv.attach_prefix(first, weight_version=0)
    compute(kv, first)
    kv.free(first)
    again = request("b", range(8))
    kv.attach_prefix(again, weight_version=0)
    assert again.num_computed == 4 and again.num_prefix_hit_tokens == 4  # the last block recomputes the last token
    kv.free(again)
    newer = request("c", range(8))
    kv.attach_prefix(newer, weight_version=1)
    assert newer.num_computed == 0 and newer.block_tables == [[]]
    longer = request("d", range(9))
    kv.attach_prefix(longer, weight_version=0)
    assert longer.num_computed == 8
    kv.free(longer)
    assert kv.pool.num_free == kv.pool.num_blocks


def test_full_blocks_are_published_once():
    kv = manager()
    req = request("a", range(10))
    kv.attach_prefix(req, 0)
    kv.allocate(req, 10)
    assert len(kv.publish_full_blocks(req, 10)) == 2
    assert kv.publish_full_blocks(req, 10) == [] and req.num_hashed_blocks == 2


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    copies = []
    kv = manager(num_blocks=4, copies=copies)
    leader = request("a", range(6))
    kv.attach_prefix(leader, 0)
    compute(kv, leader)
    follower = request("b", range(6))
    assert kv.fork(leader, follower)
    (lead,), (follow,) = leader.block_tables, follower.block_tables
    assert follow[0] == lead[0] and follow[1] != lead[1]
    assert copies == [(leader.block_tables[0][1], follower.block_tables[0][1], 2)]
    assert kv.pool.ref_counts[leader.block_tables[0][0]] == 2 and follower.num_computed == 6
    for _ in range(kv.pool.num_free):
        kv.pool.allocate(1)
    assert not kv.fork(leader, request("c", range(6)))  # no block for the partial copy: nothing changes
    assert kv.pool.ref_counts[leader.block_tables[0][0]] == 2


def test_kept_kv_is_adopted_only_by_a_continuation_and_freed_for_room():
    kv = manager(num_blocks=4)
    done = request("a#0", range(6))
    kv.attach_prefix(done, 0)
    compute(kv, done)
    kv.kept.want(["a#0"])
    kv.park(done)
    assert len(kv.kept) == 1 and kv.pool.num_free == 2
    other = request("b", [9, 9, 9, 9, 9, 9, 9])
    assert not kv.adopt_kept(other, "a#0")  # not its tokens: the kept sequence is freed
    assert len(kv.kept) == 0 and kv.pool.num_free == 4
    done = request("c#0", range(6))
    kv.attach_prefix(done, 0)
    compute(kv, done)
    kv.kept.want(["c#0"])
    kv.park(done)
    follow = request("d", [*range(6), 7, 8])
    assert kv.adopt_kept(follow, "c#0") and follow.num_computed == 6 and follow.num_prefix_hit_tokens == 6
    kv.free(follow)
    done = request("e#0", range(6))
    kv.attach_prefix(done, 0)
    compute(kv, done)
    kv.kept.want(["e#0"])
    kv.park(done)
    big = request("f", range(100, 116))
    assert kv.fit(big, 16) == 16 and len(kv.kept) == 0  # room was needed: kept KV went first


@pytest.mark.parametrize("prompt_logprobs_start", [1, 6, 7])
def test_kept_kv_is_not_adopted_past_logits_a_prompt_logprob_needs(prompt_logprobs_start):
    kv = manager()
    done = request("a#0", range(6))
    kv.attach_prefix(done, 0)
    compute(kv, done)
    kv.kept.want(["a#0"])
    kv.park(done)
    follow = request("b", [*range(6), 7, 8], prompt_logprobs=0, prompt_logprobs_start=prompt_logprobs_start)
    assert kv.adopt_kept(follow, "a#0") == (prompt_logprobs_start == 7)  # token 6 needs the logits at 5


class KVTrace(RuleBasedStateMachine):
    """Random admissions, growth, forks, parks, adoptions and frees; the pool always matches the live tables."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = manager(num_blocks=12, copies=[])
        self.live: list = []
        self.parked: list = []  # what was parked, oldest first (room may have freed it since)
        self.count = 0
        self.version = 0

    def _new(self, tokens):
        self.count += 1
        return request(f"r{self.count}#0", tokens)

    @rule(length=st.integers(1, 20), shared=st.booleans())
    def admit(self, length, shared):
        req = self._new(range(length) if shared else range(self.count * 100, self.count * 100 + length))
        self.kv.attach_prefix(req, self.version)
        num = self.kv.fit(req, req.num_pending)
        if num == 0:
            self.kv.free(req)
            return
        self.kv.allocate(req, num)
        self.kv.publish_full_blocks(req, req.num_computed + num)
        req.num_computed += num
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), grow=st.integers(1, 6))
    def grow(self, index, grow):
        req = self.live[index % len(self.live)]
        req.tokens.extend([7] * grow)
        num = self.kv.fit(req, req.num_pending)
        self.kv.allocate(req, num)
        req.num_computed += num

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def fork(self, index):
        leader = self.live[index % len(self.live)]
        follower = self._new(leader.tokens)
        if self.kv.fork(leader, follower):
            self.live.append(follower)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), keep=st.booleans())
    def finish(self, index, keep):
        req = self.live.pop(index % len(self.live))
        if keep:
            self.kv.kept.want([req.request_id])
            self.parked.append((req.request_id, list(req.tokens)))
            self.kv.park(req)
        else:
            self.kv.free(req)

    @precondition(lambda self: self.parked)
    @rule(index=st.integers(0, 100), extra=st.integers(0, 5))
    def continue_kept(self, index, extra):
        sequence_id, tokens = self.parked.pop(index % len(self.parked))
        req = self._new([*tokens, *([5] * extra)])
        if self.kv.adopt_kept(req, sequence_id):
            self.live.append(req)
            assert req.num_computed < len(req.tokens), "a continuation always has a token left to compute"

    @rule()
    def new_weights(self):
        self.version += 1

    @invariant()
    def pool_matches_tables(self):
        self.kv.check_invariants(self.live)
        assert all(r.num_computed <= len(r.block_tables[0]) * PAGE for r in self.live)

    def teardown(self):
        for req in self.live:
            self.kv.free(req)
        self.kv.free_all_kept()
        assert self.kv.pool.num_free == self.kv.pool.num_blocks, "a block leaked"


KVTrace.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_kv_manager_trace = KVTrace.TestCase


WINDOW = 6


class SlidingKVTrace(KVTrace):
    """The same trace for a model whose every layer slides over WINDOW keys: blocks behind the window go back to the
    pool, none that a future query reads ever does, and a prefix hit holds every block its window reads."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(BlockPool(12), PAGE, lambda src, dst, n: None, windows=(WINDOW,))

    @invariant()
    def window_kept_and_the_rest_given_back(self):
        for r in self.live:
            self.kv.reclaim(r)
            for g, window in enumerate(self.kv.windows):
                owned = self.kv.owned_in(r, g)
                if window is None:  # a full group holds every block
                    assert r.num_reclaimed[g] == 0 and len(owned) == len(r.block_tables[g])
                    continue
                first_read = max(0, r.num_computed - window + 1)  # the next query's first key
                assert r.num_reclaimed[g] == first_read // PAGE, "a block the window reads was given back, or one " \
                                                                 "behind it kept"
                assert len(owned) <= self.kv.blocks_for(r.num_computed - first_read + 1) + 1


SlidingKVTrace.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_sliding_kv_manager_trace = SlidingKVTrace.TestCase


class HybridKVTrace(SlidingKVTrace):
    """The same trace with three KV groups, as a hybrid model has them: one full, two sliding over different windows.
    All of a sequence's tables grow alike, the full one keeps every block, and prefix hits need every block of it."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(BlockPool(30), PAGE, lambda src, dst, n: None, windows=(None, WINDOW, 2 * WINDOW))


HybridKVTrace.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_hybrid_kv_manager_trace = HybridKVTrace.TestCase


def test_a_hybrid_prefix_hit_holds_the_full_groups_whole_and_the_sliding_ones_from_their_window():
    kv = KVManager(BlockPool(40), PAGE, lambda src, dst, n: None, windows=(None, WINDOW))
    first = request("a", range(30))
    kv.attach_prefix(first, 0)
    compute(kv, first)
    kv.free(first)
    again = request("b", [*range(30), 7, 7])
    kv.attach_prefix(again, 0)
    assert again.num_computed == 28 and again.num_reclaimed == [0, 5]  # token 28's window starts at 23: block 5
    assert [len(kv.owned_in(again, g)) for g in (0, 1)] == [7, 2]
    kv.free(again)
    # drop one full-group block from the cache: the longest hit then ends before it
    kv.pool.unregister([kv.pool.lookup(kv.group_key(hash_chain(list(range(30)), PAGE, 0)[3], 0))])
    kv.pool.release([b for b in range(40) if kv.pool.ref_counts[b]])
    third = request("c", [*range(30), 7, 7])
    kv.attach_prefix(third, 0)
    assert third.num_computed == 12 and third.num_reclaimed == [0, 1]
    kv.free(third)
    assert kv.pool.num_free == 40


def test_a_hybrid_fork_copies_each_groups_partial_block():
    copies = []
    kv = KVManager(BlockPool(12), PAGE, lambda src, dst, n: copies.append((src, dst, n)), windows=(None, WINDOW))
    leader = request("a", range(6))
    kv.attach_prefix(leader, 0)
    compute(kv, leader)
    follower = request("b", range(6))
    assert kv.fork(leader, follower)
    assert copies == [(leader.block_tables[g][1], follower.block_tables[g][1], 2) for g in (0, 1)]
    assert [t[0] for t in follower.block_tables] == [t[0] for t in leader.block_tables]
    for _ in range(kv.pool.num_free - 1):
        kv.pool.allocate(1)
    assert not kv.fork(leader, request("c", range(6)))  # one free block, two partial copies needed


def test_a_sliding_sequence_holds_its_window_however_long_it_grows():
    kv = KVManager(BlockPool(4, enable_prefix_cache=False), PAGE, lambda src, dst, n: None, windows=(WINDOW,))
    assert kv.fits_ever(1000) and not KVManager(BlockPool(4), PAGE).fits_ever(1000)
    req = request("a", range(7))
    for _ in range(200):
        compute(kv, req)
        req.tokens.append(1)
        assert len(kv.owned(req)) <= 3 and kv.pool.num_free + len(kv.owned(req)) == 4
    kv.reclaim(req)
    assert req.num_reclaimed[0] == (req.num_computed - WINDOW + 1) // PAGE == 50
    follower = request("b", req.tokens)
    assert kv.fork(req, follower)  # shares the full blocks the window reads, copies the partial one
    assert kv.owned(follower)[:-1] == kv.owned(req)[:-1] and kv.owned(follower)[-1] != kv.owned(req)[-1]
    kv.free(follower)
    kv.free(req)
    assert kv.pool.num_free == 4


def test_a_sliding_prefix_hit_needs_only_the_blocks_its_window_reads():
    kv = KVManager(BlockPool(16), PAGE, lambda src, dst, n: None, windows=(WINDOW,))
    first = request("a", range(30))
    kv.attach_prefix(first, 0)
    compute(kv, first)  # 7 full blocks published, 2 tokens in block 7
    kv.reclaim(first)  # token 30's window starts at 25: blocks 0-5 go back to the pool, still cached
    taken = kv.pool.allocate(8 + 3)  # the 8 free blocks, then the 3 oldest cached ones: blocks 0-2 are evicted
    kv.free(first)
    third = request("c", [*range(30), 7, 7])
    kv.attach_prefix(third, 0)
    # all 7 shared blocks hit: token 28's window starts at 23, so blocks 5 and 6 are held, 0-4 are placeholders
    assert third.num_computed == 28 and third.num_reclaimed[0] == 5
    assert [kv.pool.ref_counts[b] for b in kv.owned(third)] == [1, 1]
    kv.free(third)
    full = KVManager(kv.pool, PAGE)  # without a window the prefix needs block 0, which is gone
    again = request("d", [*range(30), 7, 7])
    full.attach_prefix(again, 0)
    assert again.num_computed == 0
    kv.pool.release(taken)
    assert kv.pool.num_free == 16
