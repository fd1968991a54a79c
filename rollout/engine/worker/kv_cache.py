"""The preallocated paged K/V tensors and slot arithmetic. No policy lives here: the block pool decides ownership.

Each layer keeps K and V as `[num_blocks * page_size, num_kv_heads, head_dim]`, so a token's place in the cache is one
integer, its slot: `block * page_size + offset`. Writes are one `index_copy_` per layer and reads one gather, whatever
the batch looks like. In a model with several KV groups (core/kv_groups.py) layer `i` of every group shares one such
tensor pair (`layer_slots`): a block belongs to one group at a time, so their pages never collide.

The storage is allocated once but left untouched. The CPU kernel and flash-attn read only slots that hold a token's
K/V; the PyTorch path reads whole pages, so there a block is zeroed the first time a step uses it (masked-out slots
must hold finite values). Memory the OS has not mapped yet costs nothing, so the process only grows with the blocks
the workload really reaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVShape:
    """What one layer stores per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim)

    def bytes_per_token(self, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """K and V bytes of one token in `num_layers` layers (all of them by default)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * itemsize


def write_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> None:
    """Store `key`/`value` (`[tokens, kv_heads, head_dim]`) at `slots` of one layer's caches, in the caches' dtype
    (also called by the compiled forward's attention op, which gets the layer's tensors rather than the cache)."""
    k_cache.index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, value.to(v_cache.dtype))


class PagedKVCache:
    """K and V storage for every layer, allocated once and never reallocated (weight updates keep it in place)."""

    def __init__(self, shape: KVShape, num_blocks: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, scratch_page: bool = False, layer_slots: Sequence[int] | None = None) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        # scratch_page: one more page after the blocks, never handed out by the pool: the compiled forward's padding
        # tokens write their K/V there (compiled_forward.py)
        self.scratch_block = num_blocks if scratch_page else None
        slots = (num_blocks + scratch_page) * page_size
        layer_slots = list(range(shape.num_layers)) if layer_slots is None else list(layer_slots)
        num_tensors = max(layer_slots) + 1
        # the tensors themselves, once each (layers of different KV groups share them)
        self.tensors = [torch.empty(slots, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
                        for _ in range(2 * num_tensors)]
        self.keys = [self.tensors[slot] for slot in layer_slots]  # per layer
        self.values = [self.tensors[num_tensors + slot] for slot in layer_slots]
        self._ready = torch.zeros(num_blocks, dtype=torch.bool)  # blocks zeroed at least once

    def prepare(self, blocks: torch.Tensor) -> None:
        """Zero the blocks (CPU int tensor of ids) that have never been used, before a step reads them."""
        fresh = self.take_fresh(blocks)
        if fresh is not None:
            self.zero_blocks(fresh.to(self.device))

    def take_fresh(self, blocks: torch.Tensor) -> torch.Tensor | None:
        """The never-used blocks among `blocks` (CPU ids; None if none), counted as zeroed from now on: the caller
        zeroes them (`zero_blocks`) before the step reads them. Split from `prepare` so the model runner can send
        the ids to the device with the rest of the step's metadata."""
        fresh = blocks[~self._ready[blocks]]
        if not len(fresh):
            return None
        fresh = fresh.unique()
        self._ready[fresh] = True
        return fresh

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Zero whole blocks of every layer; `blocks` on the cache's device."""
        for cache in self.tensors:
            cache.view(-1, self.page_size, *cache.shape[1:]).index_fill_(0, blocks, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` (`[tokens, kv_heads, head_dim]`) at `slots`."""
        write_slots(self.keys[layer], self.values[layer], slots, key, value)

    def copy_block(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        """Copy a block's contents (all layers) into another block: the copy-on-fork of a partial last block."""
        n = self.page_size if num_tokens is None else num_tokens
        s, d = src * self.page_size, dst * self.page_size
        fresh = not self._ready[dst]  # zero it now, or the next step's prepare() would wipe the copy
        self._ready[dst] = True
        for cache in self.tensors:
            if fresh:
                cache[d + n:d + self.page_size].zero_()  # a slice, not an index tensor: nothing to send
            cache[d:d + n].copy_(cache[s:s + n])

    def mark_written(self, blocks: list[int]) -> None:
        """These blocks were filled whole from elsewhere (the swap space): `prepare` must not zero them."""
        self._ready[blocks] = True

    def data_ptrs(self) -> list[int]:
        """Storage addresses, so tests can prove a weight update left the cache where it was."""
        return [t.data_ptr() for t in self.tensors]


class HostKVStorage:
    """The swap space's K/V: host blocks shaped like the cache's pages, pinned when the cache is on an accelerator
    (so the copies are plain DMA), untouched until a block is first written, like the cache itself."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.device.type != "cpu"
        page = (num_blocks, cache.page_size, cache.shape.num_kv_heads, cache.shape.head_dim)
        self.pages = [torch.empty(page, dtype=cache.dtype, pin_memory=pin) for _ in cache.tensors]

    def _cache_pages(self) -> list[torch.Tensor]:
        return [t.view(-1, self.cache.page_size, *t.shape[1:]) for t in self.cache.tensors]

    def copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Cache blocks -> host blocks, every layer (whole pages: a partial last page's tail is copied as it is)."""
        source = torch.tensor(device_blocks, dtype=torch.long).to(self.cache.device, non_blocking=True)
        target = torch.tensor(host_blocks, dtype=torch.long)
        for cache_pages, host_pages in zip(self._cache_pages(), self.pages):
            host_pages.index_copy_(0, target, cache_pages.index_select(0, source).to("cpu"))

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Host blocks -> cache blocks, every layer; the cache blocks count as written."""
        source = torch.tensor(host_blocks, dtype=torch.long)
        target = torch.tensor(device_blocks, dtype=torch.long).to(self.cache.device, non_blocking=True)
        non_blocking = self.cache.device.type != "cpu"
        for cache_pages, host_pages in zip(self._cache_pages(), self.pages):
            cache_pages.index_copy_(0, target, host_pages.index_select(0, source).to(self.cache.device,
                                                                                     non_blocking=non_blocking))
        self.cache.mark_written(device_blocks)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pages)
