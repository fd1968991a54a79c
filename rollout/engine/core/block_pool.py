"""The KV block allocator: reference counts, a free list, and the prefix cache (hash chain + LRU eviction).

Blocks are plain integers; what they hold lives in `kv_cache.PagedKVCache`. A block is in exactly one of three
states: referenced (ref > 0), cached (ref == 0 but its hash is registered, so a later request can revive it), or free.
Cached blocks are evicted oldest-first when the free list runs dry.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hand out the blocks asked for; the scheduler preempts or waits."""


def block_hash(parent: int | None, tokens: Sequence[int], weight_version: int) -> int:
    """Hash of a full block given its parent's hash: equal prefixes under equal weights give equal chains.

    The weight version is part of every link, so KV computed under older weights never matches a new request.
    """
    return hash((parent, tuple(tokens), weight_version))


def hash_chain(tokens: Sequence[int], page_size: int, weight_version: int, start: int = 0,
               parent: int | None = None) -> list[int]:
    """Hashes of the full blocks of `tokens` from block index `start`, continuing from `parent`."""
    out = []
    for b in range(start, len(tokens) // page_size):
        parent = block_hash(parent, tokens[b * page_size:(b + 1) * page_size], weight_version)
        out.append(parent)
    return out


class BlockPool:
    """Fixed set of `num_blocks` blocks with reference counts and a hash-addressed prefix cache."""

    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (referenced or not)."""
        return len(self._block_to_hash)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (ref 1 each), evicting least recently used cached blocks if needed."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} available")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._hash_to_block[self._block_to_hash.pop(block)]
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def share(self, block: int) -> None:
        """One more owner for a block that is already referenced (forking a sequence)."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"cannot share block {block}: it is not referenced")
        self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; pass a table tail-first so tails are evicted before heads."""
        for block in blocks:
            ref = self.ref_counts[block] - 1
            if ref < 0:
                raise ValueError(f"block {block} released more times than it was referenced")
            self.ref_counts[block] = ref
            if ref == 0:
                if block in self._block_to_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ------------------------------------------------------------ prefix cache
    def lookup(self, key: int) -> int | None:
        """The cached block for `key`, now referenced by the caller, or None on a miss."""
        if not self.enable_prefix_cache:
            return None
        block = self._hash_to_block.get(key)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1
        return block

    def is_cached(self, key: int) -> bool:
        """Whether a block holds `key` (a lookup would hit); changes nothing."""
        return self.enable_prefix_cache and key in self._hash_to_block

    def is_referenced(self, key: int) -> bool:
        """Whether the block cached under `key` is held by some sequence now (a lookup would cost no free block)."""
        block = self._hash_to_block.get(key) if self.enable_prefix_cache else None
        return block is not None and self.ref_counts[block] > 0

    def register(self, block: int, key: int) -> bool:
        """Publish a full, computed block under `key`; False if caching is off or another block already holds it."""
        if not self.enable_prefix_cache or key in self._hash_to_block or block in self._block_to_hash:
            return False
        self._hash_to_block[key] = block
        self._block_to_hash[block] = key
        return True

    def unregister(self, blocks: Iterable[int]) -> None:
        """Withdraw blocks from the prefix cache (their contents turned out invalid, e.g. a failed forward)."""
        for block in blocks:
            key = self._block_to_hash.pop(block, None)
            if key is None:
                continue
            del self._hash_to_block[key]
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every registered prefix; referenced blocks stay with their owners. Returns how many were dropped."""
        dropped = len(self._block_to_hash)
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()
        return dropped

    # ---------------------------------------------------------------- checking
    def check_invariants(self, owners: Iterable[Sequence[int]] | None = None) -> None:
        """Assert internal consistency; with `owners` (every live block table), also that ref counts match them."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & evictable, "a block is both free and evictable"
        for b in range(self.num_blocks):
            ref = self.ref_counts[b]
            assert ref >= 0, f"block {b} has negative ref count"
            if ref == 0:
                assert (b in free) != (b in evictable), f"unreferenced block {b} is neither free nor cached"
                assert (b in evictable) == (b in self._block_to_hash), f"block {b} evictable state mismatches hash"
            else:
                assert b not in free and b not in evictable, f"referenced block {b} is on a free list"
        for key, b in self._hash_to_block.items():
            assert self._block_to_hash.get(b) == key, f"hash maps of block {b} disagree"
        if owners is not None:
            counts = [0] * self.num_blocks
            for table in owners:
                for b in table:
                    counts[b] += 1
            assert counts == self.ref_counts, "ref counts do not match the live block tables"
