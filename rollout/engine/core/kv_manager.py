"""KVManager: where each sequence's KV lives. The scheduler decides who runs; this decides which blocks hold them.

A sequence's KV is its block table over the BlockPool: prefix-cache hits attached at admission (keyed by the weight
version, so no request reuses KV computed under older weights), new blocks allocated as it grows, full blocks
published to the prefix cache once the step that fills them is planned, the partial block copied and the full ones
shared when an n-sample group forks off its prefill, and everything freed tail first (cached heads outlive tails).
Finished sequences asked to keep their KV park here (`kept_kv`) until a continuation adopts it or room is needed.
In a model whose every layer attends over a sliding window, the leading blocks no future query can reach go back to
the pool as the sequence grows (`reclaim`), so a sequence holds about a window of KV however long it gets; a prefix
hit there needs only the cached blocks its window reads.
With a swap space, a preempted sequence's blocks can be copied to CPU memory and back (`swap_out`, and `allocate`
brings them back) instead of being recomputed.
Every piece of block arithmetic is written once, here.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.engine.core.block_pool import BlockPool, hash_chain
from rollout.engine.core.kept_kv import KeptSequences
from rollout.engine.core.request import Request
from rollout.engine.core.swap_space import SwapSpace

CopyBlock = Callable[[int, int, int], None]  # (source block, target block, tokens): copies KV for a fork


class KVManager:
    """Block tables of live and kept sequences over one BlockPool."""

    def __init__(self, pool: BlockPool, page_size: int, copy_block: CopyBlock | None = None,
                 window: int | None = None, swap: SwapSpace | None = None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.copy_block = copy_block
        self.window = window  # every layer's sliding window (None: some layer attends to all keys)
        self.kept = KeptSequences()  # finished sequences holding their KV for a continuation
        self.swap = swap  # None: a preempted sequence recomputes its KV

    # ------------------------------------------------------------- arithmetic
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """The blocks a sequence of this many tokens must hold at once to make progress: all of them, or
        under a sliding window the window's and one for the token it computes."""
        blocks = self.blocks_for(num_tokens)
        return blocks if self.window is None else min(blocks, self.blocks_for(self.window) + 1)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits in the whole cache."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    @staticmethod
    def owned(request: Request) -> list[int]:
        """The blocks a request holds references to (its table without the reclaimed placeholders)."""
        return request.block_table[request.num_reclaimed_blocks:]

    def reclaim(self, request: Request) -> None:
        """Give back the leading blocks that lie wholly before the sliding window of the next token to compute: its
        query at position `num_computed` reads keys from `num_computed - window + 1` on, and later ones read later."""
        if self.window is None or request.host_blocks:
            return
        dead = self.first_read_block(request.num_computed)
        if dead > request.num_reclaimed_blocks:
            self.pool.release(request.block_table[request.num_reclaimed_blocks:dead])
            request.num_reclaimed_blocks = dead

    def fit(self, request: Request, num: int) -> int:
        """The most of `num` more tokens of `request` that fit now (0: not one), after reclaiming its blocks behind
        the window and freeing kept KV for them. Allocates nothing."""
        self.reclaim(request)
        held = len(request.block_table) + self._resident_head(request)
        needed = self.blocks_for(request.num_computed + num) - held
        self.free_kept_for(needed)
        if needed <= self.pool.num_free:
            return num
        room = (held + self.pool.num_free) * self.page_size - request.num_computed
        return max(0, min(num, room))

    def allocate(self, request: Request, num: int) -> None:
        """Extend the block table for `num` more tokens (they must `fit`), after bringing a swapped-out request's
        blocks back."""
        if request.host_blocks:
            self._swap_in(request)
        needed = self.blocks_for(request.num_computed + num) - len(request.block_table)
        if needed > 0:
            request.block_table.extend(self.pool.allocate(needed))

    # ------------------------------------------------------------ the prefix
    def attach_prefix(self, request: Request, weight_version: int) -> None:
        """Reuse cached blocks of the request's full-block prefix computed under `weight_version`."""
        if request.block_table or request.host_blocks:
            return  # it continues a kept sequence whose KV it holds already, or its KV waits in the swap space
        request.kv_version = weight_version
        request.block_hashes = hash_chain(request.tokens, self.page_size, weight_version)
        request.num_hashed_blocks = 0
        # Blocks whose logits a prompt logprob still needs are recomputed, not reused (see prompt_logprobs.py), and
        # at least one token is left to compute: it yields the logits for the next sample.
        usable = min(request.max_cached_tokens, len(request.tokens) - 1) // self.page_size
        hits, first = self._prefix_hit(request.block_hashes[:usable])
        request.block_table = [0] * first  # placeholders for blocks behind the window: no kernel reads them
        request.block_table += [self.pool.lookup(key) for key in request.block_hashes[first:hits]]
        request.num_reclaimed_blocks = first
        request.num_computed = len(request.block_table) * self.page_size
        request.num_hashed_blocks = len(request.block_table)
        request.num_prefix_hit_tokens = request.num_computed

    def _prefix_hit(self, keys: list[int]) -> tuple[int, int]:
        """(blocks of the longest reusable prefix, how many leading ones of them need no KV). Without a window the
        prefix must be cached from its first block on. Under a sliding window only the blocks the next token's
        window reads must be cached: the sequence then starts as if it had reclaimed the ones before."""
        cached = [self.pool.is_cached(key) for key in keys]
        if self.window is None:
            hits = cached.index(False) if False in cached else len(cached)
            return hits, 0
        for hits in range(len(keys), 0, -1):
            first = self.first_read_block(hits * self.page_size)
            if all(cached[first:hits]):
                return hits, first
        return 0, 0

    def first_read_block(self, num_computed: int) -> int:
        """The first block the sliding window of the token at position `num_computed` reads."""
        return max(0, num_computed - self.window + 1) // self.page_size

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
        published = [request.block_table[b] for b in range(request.num_hashed_blocks, full)
                     if self.pool.register(request.block_table[b], request.block_hashes[b])]
        request.num_hashed_blocks = full
        return published

    def unpublish(self, blocks: list[int]) -> None:
        self.pool.unregister(blocks)

    # ------------------------------------------------------------------ forks
    def fork(self, leader: Request, follower: Request) -> bool:
        """Give `follower` the leader's computed prompt: shared full blocks, a private copy of the partial block;
        False (nothing changed) if there is no free block for that copy."""
        full, partial = divmod(leader.num_computed, self.page_size)
        if partial and self.pool.num_free < 1:
            return False
        follower.block_table = leader.block_table[:full]
        follower.num_reclaimed_blocks = min(leader.num_reclaimed_blocks, full)
        for block in self.owned(follower):
            self.pool.share(block)
        if partial:
            (new_block,) = self.pool.allocate(1)
            self.copy_block(leader.block_table[full], new_block, partial)
            follower.block_table.append(new_block)
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
        self.pool.release(reversed(self.owned(request)))
        if request.host_blocks:
            self.swap.release(request.host_blocks)
            request.host_blocks = []
        request.block_table = []
        request.num_reclaimed_blocks = 0
        request.num_computed = 0
        request.num_hashed_blocks = 0

    # ------------------------------------------------------------------ swap
    def swap_out(self, request: Request) -> bool:
        """A preempted request: copy its blocks to the swap space and give them back to the pool, keeping its
        computed tokens, if there is room and that is cheaper than recomputing them; False (nothing changed) if not."""
        owned = self.owned(request)
        if self.swap is None or not owned or len(owned) > self.swap.num_free:
            return False
        shared = self._shared_head(request)
        if not self.swap.costs.swap_is_cheaper(request.num_computed - shared * self.page_size,
                                               2 * len(owned) - shared):
            return False
        request.host_blocks = self.swap.copy_out(owned)
        self.pool.release(reversed(owned))
        del request.block_table[request.num_reclaimed_blocks:]
        return True

    def _shared_head(self, request: Request) -> int:
        """How many of the leading blocks another sequence also holds: they stay in the cache (a recompute would hit
        them in the prefix cache, and `_swap_in` finds them there)."""
        count = 0
        for b in range(request.num_reclaimed_blocks, request.num_hashed_blocks):
            if self.pool.ref_counts[request.block_table[b]] < 2:
                break
            count += 1
        return count

    def _resident_head(self, request: Request) -> int:
        """How many leading blocks of a swapped-out request another sequence holds in the prefix cache (a group's
        shared prompt): `_swap_in` takes them from there, so they need no free block."""
        count, start = 0, len(request.block_table)
        while (count < len(request.host_blocks) and start + count < request.num_hashed_blocks
               and self.pool.is_referenced(request.block_hashes[start + count])):
            count += 1
        return count

    def _swap_in(self, request: Request) -> None:
        """Bring a swapped-out request's blocks back: its hashed blocks still in the prefix cache are reused, the
        others are allocated and copied from the swap space (`fit` counted them) and the hashed ones among those
        published again (their contents are what was published before)."""
        host, request.host_blocks = request.host_blocks, []
        start = len(request.block_table)
        table: list[int | None] = []
        for i in range(len(host)):
            b = start + i
            table.append(self.pool.lookup(request.block_hashes[b]) if b < request.num_hashed_blocks else None)
        copies = [i for i, block in enumerate(table) if block is None]
        fresh = self.pool.allocate(len(copies))
        for i, block in zip(copies, fresh):
            table[i] = block
        self.swap.copy_in([host[i] for i in copies], fresh)
        for i, block in zip(copies, fresh):  # published again, so the sequence's siblings swap in onto them
            if start + i < request.num_hashed_blocks:
                self.pool.register(block, request.block_hashes[start + i])
        self.swap.release(host)
        request.block_table.extend(table)

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
        request.block_table, kept.block_table = kept.block_table, []
        request.num_reclaimed_blocks, kept.num_reclaimed_blocks = kept.num_reclaimed_blocks, 0
        request.num_computed = kept.num_computed
        request.kv_version = kept.kv_version
        request.block_hashes = kept.block_hashes
        request.num_hashed_blocks = kept.num_hashed_blocks
        request.num_prefix_hit_tokens = kept.num_computed
        return True

    def check_invariants(self, live: list[Request]) -> None:
        """The pool's ref counts match the blocks live and kept sequences hold, and every host block is free or held
        by one swapped-out sequence (used by tests)."""
        self.pool.check_invariants([self.owned(r) for r in [*live, *self.kept.requests()]])
        for request in live:
            assert not request.host_blocks or not self.owned(request), f"{request} is swapped out and in at once"
        if self.swap is not None:
            self.swap.check_invariants([r.host_blocks for r in live])
        else:
            assert not any(r.host_blocks for r in live), "a sequence holds host blocks without a swap space"
