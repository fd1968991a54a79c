"""The KV block allocator under randomized traces.

Three layers of specification:
- `BlockPool` against a small reference model (rule-based state machine): reference counts, the free list, the
  hash-addressed prefix cache (register / lookup / unregister / reset), LRU eviction of cached unreferenced blocks,
  and `check_invariants` with the live tables after every step; at teardown everything released, nothing leaked.
- Direct properties: LRU order (tails released first are evicted first), hash chains salted by the weight version,
  misuse raises.
(The engine's block accounting under random traces is in test_engine.py.)
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from rollout.engine.core.block_pool import BlockPool, NoFreeBlocksError, block_hash, hash_chain

# --------------------------------------------------------------------------------------------------------------------
# BlockPool as a state machine
# --------------------------------------------------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool with the operations the scheduler uses and checks it against a plain reference model.

    Model state: the live block tables (each one owner), and for the prefix cache `hashes` (key -> block for every
    registered block) plus `lru` (cached blocks nobody references, least recently released first).
    """

    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.live: dict[int, list[int]] = {}  # table id -> blocks (the "owners")
        self.next_table = 0
        self.hashes: dict[int, int] = {}  # key -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, oldest first
        self.next_key = 0
        self.dead_keys: list[int] = []  # keys that were registered once and must no longer hit

    # ------------------------------------------------------------------ helpers
    def _refs(self) -> Counter:
        return Counter(b for table in self.live.values() for b in table)

    def _new_table(self, blocks: list[int]) -> int:
        tid = self.next_table
        self.next_table += 1
        self.live[tid] = blocks
        return tid

    def _hashed_blocks(self) -> set[int]:
        return set(self.hashes.values())

    # -------------------------------------------------------------------- rules
    @rule(num_blocks=st.integers(1, 16), prefix_cache=st.sampled_from([True, True, True, False]))
    @precondition(lambda self: self.pool is None)
    def init_pool(self, num_blocks, prefix_cache):
        self.pool = BlockPool(num_blocks, enable_prefix_cache=prefix_cache)
        assert self.pool.num_free == num_blocks

    @rule(target=tables, n=st.integers(0, 6), publish=st.booleans())
    @precondition(lambda self: self.pool is not None)
    def allocate(self, n, publish):
        """Take n blocks; with `publish`, register each under a fresh key (a computed, full prompt block)."""
        tid = self._allocate(n)
        for block in self.live[tid] if publish else []:
            self._register(block, self._fresh_key())
        return tid

    def _allocate(self, n):
        pool = self.pool
        refs = self._refs()
        expected_free = pool.num_blocks - len(refs)
        assert pool.num_free == expected_free
        if n > expected_free:
            with pytest.raises(NoFreeBlocksError):
                pool.allocate(n)
            return self._new_table([])  # nothing was taken
        plain_free = expected_free - len(self.lru)
        blocks = pool.allocate(n)
        assert len(blocks) == n and len(set(blocks)) == n
        for b in blocks:
            assert refs[b] == 0, f"allocate handed out block {b}, which is still referenced"
        # The free list is used first; cached blocks are evicted only when it runs dry, least recently used first.
        from_free, from_cache = blocks[:min(n, plain_free)], blocks[min(n, plain_free):]
        assert not set(from_free) & set(self.lru), "a cached block was evicted while plain free blocks remained"
        oldest = list(self.lru)[:len(from_cache)]
        assert from_cache == oldest, f"evicted {from_cache}, expected the least recently used {oldest}"
        for b in from_cache:
            del self.lru[b]
            key = next(k for k, v in self.hashes.items() if v == b)
            del self.hashes[key]
            self.dead_keys.append(key)
        for b in blocks:
            assert pool.ref_counts[b] == 1
        return self._new_table(blocks)

    @rule(target=tables, source=tables)
    def fork(self, source):
        """A new owner shares every block of an existing table (an n-sample group forking its prompt)."""
        if source not in self.live:
            return self._new_table([])
        blocks = list(self.live[source])
        for b in blocks:
            self.pool.share(b)
        return self._new_table(blocks)

    @rule(table=consumes(tables))
    def release(self, table):
        blocks = self.live.pop(table, None)
        if blocks is None:
            return
        refs_after = self._refs()
        hashed = self._hashed_blocks()
        self.pool.release(reversed(blocks))  # tail first, as the scheduler does
        for b in reversed(blocks):
            if refs_after[b] == 0 and b in hashed and b not in self.lru:
                self.lru[b] = None

    @rule(table=tables, data=st.data())
    def register(self, table, data):
        blocks = self.live.get(table)
        if not blocks:
            return
        block = data.draw(st.sampled_from(blocks))
        reuse = data.draw(st.booleans()) and bool(self.hashes)
        key = data.draw(st.sampled_from(sorted(self.hashes))) if reuse else self._fresh_key()
        self._register(block, key)

    def _register(self, block, key):
        """Registering succeeds only for an unhashed block under an unused key, and only with the cache on."""
        expected = self.pool.enable_prefix_cache and key not in self.hashes and block not in self._hashed_blocks()
        assert self.pool.register(block, key) is expected
        if expected:
            self.hashes[key] = block

    def _fresh_key(self) -> int:
        self.next_key += 1
        return hash(("key", self.next_key))

    @rule(target=tables, data=st.data())
    @precondition(lambda self: self.pool is not None)
    def lookup(self, data):
        """Look up a live key, a dead (evicted/reset) key or a never-seen key."""
        choices = ["miss"] + (["live"] * 4 if self.hashes else []) + (["dead"] if self.dead_keys else [])
        kind = data.draw(st.sampled_from(choices))
        if kind == "live":
            key = data.draw(st.sampled_from(sorted(self.hashes)))
        elif kind == "dead":
            key = data.draw(st.sampled_from(self.dead_keys))
            if key in self.hashes:  # registered again since
                kind = "live"
        else:
            key = self._fresh_key()
        block = self.pool.lookup(key)
        if kind != "live" or not self.pool.enable_prefix_cache:
            assert block is None, f"lookup of a {kind} key returned block {block}"
            return self._new_table([])
        assert block == self.hashes[key]
        self.lru.pop(block, None)  # revived: no longer evictable
        return self._new_table([block])

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and bool(self.hashes))
    def unregister(self, data):
        """Withdraw some published blocks (a failed forward): their keys stop hitting, idle ones become plain free."""
        hashed = sorted(self._hashed_blocks())
        blocks = data.draw(st.lists(st.sampled_from(hashed + [b for b in range(self.pool.num_blocks)
                                                             if b not in hashed]), max_size=4))
        self.pool.unregister(blocks)
        for key, block in list(self.hashes.items()):
            if block in blocks:
                del self.hashes[key]
                self.dead_keys.append(key)
                self.lru.pop(block, None)

    @rule()
    @precondition(lambda self: self.pool is not None)
    def reset_prefix_cache(self):
        dropped = self.pool.reset_prefix_cache()
        assert dropped == len(self.hashes)
        self.dead_keys.extend(self.hashes)
        self.hashes.clear()
        self.lru.clear()

    # --------------------------------------------------------------- invariants
    @invariant()
    def pool_matches_model(self):
        if self.pool is None:
            return
        pool = self.pool
        pool.check_invariants(list(self.live.values()))
        refs = self._refs()
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == refs[b]
        assert pool.num_free == pool.num_blocks - len(refs)
        assert pool.num_used == len(refs)
        assert pool.num_cached == len(self.hashes)
        assert set(self.lru) == {b for b in self._hashed_blocks() if refs[b] == 0}

    def teardown(self):
        if self.pool is None:
            return
        for blocks in list(self.live.values()):
            self.pool.release(reversed(blocks))
        self.live.clear()
        self.pool.check_invariants([])
        assert self.pool.num_free == self.pool.num_blocks, "blocks leaked after every owner released"
        assert all(r == 0 for r in self.pool.ref_counts)
        # With everything released, the whole pool can be allocated again (evicting cached blocks as needed).
        every = self.pool.allocate(self.pool.num_blocks)
        assert sorted(every) == list(range(self.pool.num_blocks))
        self.pool.release(every)
        self.pool.reset_prefix_cache()
        self.pool.check_invariants([])
        assert self.pool.num_free == self.pool.num_blocks


BlockPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolStateMachine = BlockPoolMachine.TestCase


# --------------------------------------------------------------------------------------------------------------------
# Direct properties
# --------------------------------------------------------------------------------------------------------------------


def test_lru_evicts_tails_released_first_and_revived_blocks_last():
    pool = BlockPool(6)
    seq = pool.allocate(3)  # a request's block table, head to tail
    keys = hash_chain(list(range(12)), 4, weight_version=0)
    for block, key in zip(seq, keys):
        assert pool.register(block, key)
    pool.release(reversed(seq))  # tail first, as the scheduler releases a finished request
    assert pool.num_free == 6 and pool.num_cached == 3

    others = pool.allocate(3)  # the plain free blocks go first: nothing cached is evicted
    assert not set(others) & set(seq)
    assert all(pool.lookup(k) is not None for k in keys)  # all three still cached (and now referenced again)
    pool.release(reversed(seq))

    (evicted,) = pool.allocate(1)
    assert evicted == seq[2], "the tail (released first) must be evicted first"
    assert pool.lookup(keys[2]) is None
    head = pool.lookup(keys[0])  # revive the head: it becomes most recently used
    assert head == seq[0]
    pool.release([head])
    (evicted,) = pool.allocate(1)
    assert evicted == seq[1], "the middle block is now the least recently used"
    (evicted,) = pool.allocate(1)
    assert evicted == seq[0]
    assert pool.num_free == 0 and pool.num_cached == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_referenced_cached_blocks_are_never_evicted():
    pool = BlockPool(3)
    a = pool.allocate(2)
    assert pool.register(a[0], 11) and pool.register(a[1], 12)
    pool.release([a[1]])  # a[1] cached and unreferenced; a[0] still referenced
    got = pool.allocate(2)
    assert a[0] not in got and a[1] in got
    assert pool.lookup(11) == a[0]
    assert pool.lookup(12) is None


def test_release_of_unreferenced_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.release([0])
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError):
        pool.release([b])
    with pytest.raises(ValueError):
        pool.share(b)  # sharing needs a live owner
    pool.check_invariants([])
    assert pool.num_free == 4


def test_disabled_prefix_cache_never_hits():
    pool = BlockPool(4, enable_prefix_cache=False)
    (b,) = pool.allocate(1)
    assert pool.register(b, 5) is False
    assert pool.lookup(5) is None
    pool.release([b])
    assert pool.num_cached == 0 and pool.num_free == 4


def test_reset_prefix_cache_keeps_referenced_blocks_with_their_owners():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], 1)
    pool.register(a[1], 2)
    pool.release([a[1]])
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(1) is None and pool.lookup(2) is None
    assert pool.ref_counts[a[0]] == 1
    pool.check_invariants([[a[0]]])
    pool.release([a[0]])
    assert pool.num_free == 4 and pool.num_cached == 0


token_lists = st.lists(st.integers(0, 50), min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, page=st.integers(1, 8), v1=st.integers(0, 10**6), v2=st.integers(0, 10**6))
def test_hash_chain_is_salted_by_weight_version(tokens, page, v1, v2):
    a = hash_chain(tokens, page, v1)
    assert a == hash_chain(list(tokens), page, v1), "equal prefixes under equal weights must give equal chains"
    assert len(a) == len(tokens) // page  # only full blocks are hashed
    if v1 != v2:
        b = hash_chain(tokens, page, v2)
        assert not set(a) & set(b), "a block computed under other weights must never match"
        if tokens[:page] and len(tokens) >= page:
            assert block_hash(None, tokens[:page], v1) != block_hash(None, tokens[:page], v2)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, page=st.integers(1, 8), version=st.integers(0, 5), cut=st.integers(0, 10))
def test_hash_chain_extends_and_depends_on_the_whole_prefix(tokens, page, version, cut):
    full = hash_chain(tokens, page, version)
    # A chain continued from a parent equals the chain computed in one go.
    start = min(cut, len(full))
    parent = full[start - 1] if start else None
    assert full[:start] + hash_chain(tokens, page, version, start=start, parent=parent) == full
    # The chain of a prefix is a prefix of the chain.
    assert hash_chain(tokens[:cut * page], page, version) == full[:min(cut, len(full))]
    # Changing one token changes that block's hash and every later one.
    if full:
        i = min(cut, len(full) - 1) * page
        changed = list(tokens)
        changed[i] = changed[i] + 1
        other = hash_chain(changed, page, version)
        b = i // page
        assert other[:b] == full[:b]
        assert all(x != y for x, y in zip(other[b:], full[b:]))


def test_hash_chain_blocks_with_equal_tokens_but_different_parents_differ():
    tokens = [1, 2, 3, 4, 9, 9, 9, 9]
    other = [5, 6, 7, 8, 9, 9, 9, 9]
    assert hash_chain(tokens, 4, 0)[1] != hash_chain(other, 4, 0)[1]
