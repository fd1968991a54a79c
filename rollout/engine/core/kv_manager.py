"""KVManager: where each sequence's KV lives. The scheduler decides who runs; this decides which blocks hold them.

A sequence's KV is one block table per KV group (kv_groups.py; most models have one) over the BlockPool: prefix-cache
hits attached at admission (keyed by the weight version, so no request reuses KV computed under older weights), new
blocks allocated as it grows, full blocks published to the prefix cache once the step that fills them is planned, the
partial block copied and the full ones shared when an n-sample group forks off its prefill, and everything freed tail
first (cached heads outlive tails). All of a sequence's tables have one length: block `b` of each holds the same
tokens, for that group's layers.
Finished sequences asked to keep their KV park here (`kept_kv`) until a continuation adopts it or room is needed.
In a group whose layers attend over a sliding window, the leading blocks no future query can reach go back to the pool
as the sequence grows (`reclaim`), so the group holds about a window of KV however long the sequence gets; a prefix
hit there needs only the cached blocks its window reads, while a full-attention group needs every block from the first.
With a swap space, a preempted sequence's blocks can be copied to CPU memory and back (`swap_out`, and `allocate`
brings them back) instead of being recomputed.
Every piece of block arithmetic is written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.engine.core.block_pool import BlockPool, hash_chain
from rollout.engine.core.kept_kv import KeptSequences
from rollout.engine.core.request import Request
from rollout.engine.core.swap_space import SwapSpace

CopyBlock = Callable[[int, int, int], None]  # (source block, target block, tokens): copies KV for a fork


class KVManager:
    """Block tables of live and kept sequences over one BlockPool, one table per KV group."""

    def __init__(self, pool: BlockPool, page_size: int, copy_block: CopyBlock | None = None,
                 windows: Sequence[int | None] = (None,), swap: SwapSpace | None = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.copy_block = copy_block
        self.windows = tuple(windows)  # per KV group: the sliding window of its layers (None: they read every key)
        self.sliding = [g for g, window in enumerate(self.windows) if window is not None]
        self.kept = KeptSequences()  # finished sequences holding their KV for a continuation
        self.swap = swap  # None: a preempted sequence recomputes its KV

    # ------------------------------------------------------------- arithmetic
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """The blocks a sequence of this many tokens must hold at once to make progress: in each group all of them,
        or under a sliding window the window's and one for the token it computes."""
        blocks = self.blocks_for(num_tokens)
        return sum(blocks if window is None else min(blocks, self.blocks_for(window) + 1) for window in self.windows)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits in the whole cache."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def group_key(self, block_hash: int, group: int) -> int:
        """The prefix-cache key of a block of `group`: each group's KV of the same tokens is a different block."""
        return block_hash if group == 0 else hash((block_hash, group))

    @staticmethod
    def owned_in(request: Request, group: int) -> list[int]:
        """The blocks a request holds references to in one group (its table without the reclaimed placeholders)."""
        return request.block_tables[group][request.num_reclaimed[group]:]

    def owned(self, request: Request) -> list[int]:
        """Every block a request holds references to, group by group."""
        return [block for g in range(len(request.block_tables)) for block in self.owned_in(request, g)]

    def reclaim(self, request: Request) -> None:
        """In each sliding group, give back the leading blocks that lie wholly before the window of the next token to
        compute: its query at position `num_computed` reads keys from `num_computed - window + 1` on, and later ones
        read later."""
        if not self.sliding or request.host_blocks or not request.block_tables:
            return
        for g in self.sliding:
            dead = self.first_read_block(request.num_computed, self.windows[g])
            if dead > request.num_reclaimed[g]:
                self.pool.release(request.block_tables[g][request.num_reclaimed[g]:dead])
                request.num_reclaimed[g] = dead

    def fit(self, request: Request, num: int) -> int:
        """The most of `num` more tokens of `request` that fit now (0: not one), after reclaiming its blocks behind
        the windows and freeing kept KV for them. Allocates nothing."""
        self.reclaim(request)
        groups = self.num_groups
        held = sum(map(len, request.block_tables)) + self._resident_head(request)
        needed = groups * self.blocks_for(request.num_computed + num) - held  # every group grows alike
        self.free_kept_for(needed)
        if needed <= self.pool.num_free:
            return num
        room = (held + self.pool.num_free) // groups * self.page_size - request.num_computed
        return max(0, min(num, room))

    def allocate(self, request: Request, num: int) -> None:
        """Extend the block tables for `num` more tokens (they must `fit`), after bringing a swapped-out request's
        blocks back."""
        if request.host_blocks:
            self._swap_in(request)
        elif not request.block_tables:  # no prefix was attached
            request.block_tables = [[] for _ in self.windows]
            request.num_reclaimed = [0] * self.num_groups
        target = self.blocks_for(request.num_computed + num)
        for table in request.block_tables:
            if target > len(table):
                table.extend(self.pool.allocate(target - len(table)))

    # ------------------------------------------------------------ the prefix
    def attach_prefix(self, request: Request, weight_version: int) -> None:
        """Reuse cached blocks of the request's full-block prefix computed under `weight_version`."""
        if request.block_tables or request.host_blocks:
            return  # it continues a kept sequence whose KV it holds already, or its KV waits in the swap space
        request.kv_version = weight_version
        request.block_hashes = hash_chain(request.tokens, self.page_size, weight_version)
        # Blocks whose logits a prompt logprob still needs are recomputed, not reused (see prompt_logprobs.py), and
        # at least one token is left to compute: it yields the logits for the next sample.
        usable = min(request.max_cached_tokens, len(request.tokens) - 1) // self.page_size
        hits, firsts = self._prefix_hit(request.block_hashes[:usable])
        # placeholders for blocks behind a window: no kernel reads them
        request.block_tables = [[0] * first + [self.pool.lookup(self.group_key(key, g))
                                               for key in request.block_hashes[first:hits]]
                                for g, first in enumerate(firsts)]
        request.num_reclaimed = list(firsts)
        request.num_computed = hits * self.page_size
        request.num_hashed_blocks = hits
        request.num_prefix_hit_tokens = request.num_computed

    def _prefix_hit(self, keys: list[int]) -> tuple[int, list[int]]:
        """(blocks of the longest reusable prefix, per group how many leading ones of them need no KV). A full group
        needs the prefix cached from its first block on; a sliding group only the blocks the next token's window
        reads: the sequence then starts as if it had reclaimed the ones before."""
        none = [0] * self.num_groups
        cached = [[self.pool.is_cached(self.group_key(key, g)) for key in keys] for g in range(self.num_groups)]
        limit = len(keys)
        for g, window in enumerate(self.windows):
            if window is None and False in cached[g]:
                limit = min(limit, cached[g].index(False))
        for hits in range(limit, 0, -1):
            firsts = [0 if window is None else self.first_read_block(hits * self.page_size, window)
                      for window in self.windows]
            if all(all(cached[g][firsts[g]:hits]) for g in self.sliding):
                return hits, firsts
        return 0, none

    def first_read_block(self, num_computed: int, window: int) -> int:
        """The first block the sliding window of the token at position `num_computed` reads."""
        return max(0, num_computed - window + 1) // self.page_size

    def publish_full_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Publish the blocks that are full once `num_tokens` are computed; returns those newly published.

        Done at schedule time: every layer writes the whole step's K/V before attending, so a request admitted later
        in the same step can already share blocks this step computes. If the forward fails, `unpublish` them.
        """
        full = num_tokens // self.page_size
        if full <= request.num_hashed_blocks:
            return []
        if len(request.block_hashes) < full:
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.extend(hash_chain(request.tokens[:full * self.page_size], self.page_size,
                                                   request.kv_version, start=len(request.block_hashes),
                                                   parent=parent))
        published = []
        for g, table in enumerate(request.block_tables):
            for b in range(max(request.num_hashed_blocks, request.num_reclaimed[g]), full):
                if self.pool.register(table[b], self.group_key(request.block_hashes[b], g)):
                    published.append(table[b])
        request.num_hashed_blocks = full
        return published

    def unpublish(self, blocks: list[int]) -> None:
        self.pool.unregister(blocks)

    # ------------------------------------------------------------------ forks
    def fork(self, leader: Request, follower: Request) -> bool:
        """Give `follower` the leader's computed prompt: shared full blocks, a private copy of each group's partial
        block; False (nothing changed) if there are no free blocks for those copies."""
        full, partial = divmod(leader.num_computed, self.page_size)
        if partial and self.pool.num_free < self.num_groups:
            return False
        follower.block_tables = [table[:full] for table in leader.block_tables]
        follower.num_reclaimed = [min(reclaimed, full) for reclaimed in leader.num_reclaimed]
        for block in self.owned(follower):
            self.pool.share(block)
        if partial:
            for table, source, block in zip(follower.block_tables, leader.block_tables,
                                            self.pool.allocate(self.num_groups)):
                self.copy_block(source[full], block, partial)
                table.append(block)
        follower.num_computed = leader.num_computed
        follower.kv_version = leader.kv_version
        follower.block_hashes = list(leader.block_hashes[:full])
        follower.num_hashed_blocks = min(leader.num_hashed_blocks, full)
        return True

    def detach(self, request: Request) -> None:
        """A request admission looked at must wait after all: give back what `attach_prefix` took (a swapped-out
        request took nothing and keeps its swapped KV)."""
        if not request.host_blocks:
            self.free(request)

    def free(self, request: Request) -> None:
        """Return a request's blocks to the pool (tail first, so cached heads outlive tails), and its host blocks to
        the swap space, and reset its KV state."""
        for g in range(len(request.block_tables)):
            self.pool.release(reversed(self.owned_in(request, g)))
        if request.host_blocks:
            self.swap.release(block for blocks in request.host_blocks for block in blocks)
            request.host_blocks = []
        request.block_tables = []
        request.num_reclaimed = []
        request.num_computed = 0
        request.num_hashed_blocks = 0

    # ------------------------------------------------------------------ swap
    def swap_out(self, request: Request) -> bool:
        """A preempted request: copy its blocks to the swap space and give them back to the pool, keeping its
        computed tokens, if there is room and that is cheaper than recomputing them; False (nothing changed) if not."""
        owned = [self.owned_in(request, g) for g in range(self.num_groups)]
        count = sum(map(len, owned))
        if self.swap is None or not count or count > self.swap.num_free:
            return False
        shared = [self._shared_head(request, g) for g in range(self.num_groups)]
        if not self.swap.costs.swap_is_cheaper(request.num_computed - min(shared) * self.page_size,
                                               2 * count - sum(shared)):
            return False
        host = self.swap.copy_out([block for blocks in owned for block in blocks])
        request.host_blocks = []
        for g, blocks in enumerate(owned):
            request.host_blocks.append(host[:len(blocks)])
            host = host[len(blocks):]
            self.pool.release(reversed(blocks))
            del request.block_tables[g][request.num_reclaimed[g]:]
        return True

    def _shared_head(self, request: Request, group: int) -> int:
        """How many of a group's leading held blocks another sequence also holds: they stay in the cache (a recompute
        would hit them in the prefix cache, and `_swap_in` finds them there)."""
        count = 0
        table = request.block_tables[group]
        for b in range(request.num_reclaimed[group], request.num_hashed_blocks):
            if self.pool.ref_counts[table[b]] < 2:
                break
            count += 1
        return count

    def _resident_head(self, request: Request) -> int:
        """How many leading blocks of a swapped-out request's groups another sequence holds in the prefix cache (a
        group's shared prompt): `_swap_in` takes them from there, so they need no free block."""
        count = 0
        for g, host in enumerate(request.host_blocks):
            start = len(request.block_tables[g])
            for i in range(len(host)):
                if (start + i >= request.num_hashed_blocks
                        or not self.pool.is_referenced(self.group_key(request.block_hashes[start + i], g))):
                    break
                count += 1
        return count

    def _swap_in(self, request: Request) -> None:
        """Bring a swapped-out request's blocks back: its hashed blocks still in the prefix cache are reused, the
        others are allocated and copied from the swap space (`fit` counted them) and the hashed ones among those
        published again (their contents are what was published before)."""
        host_blocks, request.host_blocks = request.host_blocks, []
        tables: list[list[int | None]] = []
        for g, host in enumerate(host_blocks):
            start = len(request.block_tables[g])
            tables.append([self.pool.lookup(self.group_key(request.block_hashes[start + i], g))
                           if start + i < request.num_hashed_blocks else None for i in range(len(host))])
        copies = [(g, i) for g, table in enumerate(tables) for i, block in enumerate(table) if block is None]
        fresh = self.pool.allocate(len(copies))
        self.swap.copy_in([host_blocks[g][i] for g, i in copies], fresh)
        for (g, i), block in zip(copies, fresh):
            tables[g][i] = block
            b = len(request.block_tables[g]) + i
            if b < request.num_hashed_blocks:  # published again, so the sequence's siblings swap in onto them
                self.pool.register(block, self.group_key(request.block_hashes[b], g))
        self.swap.release(block for host in host_blocks for block in host)
        for table, blocks in zip(request.block_tables, tables):
            table.extend(blocks)

    def drop_swapped(self, request: Request) -> None:
        """Forget a waiting request's swapped KV (computed under weights that changed): it recomputes."""
        if request.host_blocks:
            self.free(request)

    # --------------------------------------------------------------- kept KV
    def park(self, request: Request) -> None:
        """A finished sequence asked to keep its KV: hold its blocks (a previous holder of its id is freed)."""
        previous = self.kept.park(request)
        if previous is not None:
            self.free(previous)

    def free_kept(self, sequence_id: str) -> bool:
        """Drop a kept sequence's blocks (its full blocks stay in the prefix cache); False if it is not kept."""
        request = self.kept.take(sequence_id)
        if request is not None:
            self.free(request)
        return request is not None

    def free_all_kept(self) -> int:
        kept = self.kept.take_all()
        for request in kept:
            self.free(request)
        return len(kept)

    def free_kept_for(self, blocks: float) -> None:
        """Free kept sequences, oldest first, until `blocks` blocks are free or none is kept."""
        while self.pool.num_free < blocks and len(self.kept):
            self.free(self.kept.oldest())

    def adopt_kept(self, request: Request, sequence_id: str) -> bool:
        """Give a queued request the KV of the kept sequence its tokens extend; False (nothing adopted, the kept
        sequence freed) if that sequence is gone or the request's tokens do not start with all of its tokens."""
        kept = self.kept.take(sequence_id)
        if kept is None:
            return False
        if (request.tokens[:len(kept.tokens)] != kept.tokens or len(request.tokens) <= kept.num_computed
                or kept.num_computed > request.max_cached_tokens):  # its KV would skip logits prompt logprobs need
            self.free(kept)
            return False
        request.block_tables, kept.block_tables = kept.block_tables, []
        request.num_reclaimed, kept.num_reclaimed = kept.num_reclaimed, []
        request.num_computed = kept.num_computed
        request.kv_version = kept.kv_version
        request.block_hashes = kept.block_hashes
        request.num_hashed_blocks = kept.num_hashed_blocks
        request.num_prefix_hit_tokens = kept.num_computed
        return True

    def check_invariants(self, live: list[Request]) -> None:
        """The pool's ref counts match the blocks live and kept sequences hold, every sequence holding KV has one table
        per group, all of one length, and every host block is free or held by one swapped-out sequence (used by
        tests)."""
        holders = [*live, *self.kept.requests()]
        self.pool.check_invariants([self.owned_in(r, g) for r in holders for g in range(len(r.block_tables))])
        for request in holders:
            tables = request.block_tables
            assert not tables or len(tables) == len(request.num_reclaimed) == self.num_groups, f"{request}: groups"
            if not request.host_blocks:
                assert len({len(table) for table in tables}) <= 1, f"{request}: tables of different lengths"
            for g in self.sliding if tables else ():
                assert request.num_reclaimed[g] * self.page_size <= max(
                    0, request.num_computed - self.windows[g] + 1), f"{request}: a block its window reads was freed"
        for request in live:
            assert not request.host_blocks or not self.owned(request), f"{request} is swapped out and in at once"
        if self.swap is not None:
            self.swap.check_invariants([blocks for r in live for blocks in r.host_blocks])
        else:
            assert not any(r.host_blocks for r in live), "a sequence holds host blocks without a swap space"
