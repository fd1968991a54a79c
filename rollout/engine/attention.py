"""Paged attention for the engine's forward, registered with transformers' attention interface.

The function is selected for the engine's forward only (see `engine_attention`), never left switched on the module:
the same module may be trained between generation calls.

CPU/SDPA path: decode rows (one query token each) are attended together against a gather of their own contexts,
padded to the longest one in the step; each prefill chunk is attended alone with a causal offset mask. The cost grows
with each request's own context, never with a dense block-diagonal mask over the whole batch. On CUDA with flash-attn
installed, `flash_backend.py` provides the varlen and kv-cache kernels behind the same seam.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from rollout.engine.flash_backend import FlashBatch, flash_paged_attention
from rollout.engine.kv_cache import PagedKVCache

ATTENTION_NAME = "rollout_paged"
_switch_lock = threading.Lock()


@dataclass
class PrefillSegment:
    """One request's chunk of query tokens `[start, end)` in the packed batch, attending to `ctx_slots`."""

    start: int
    end: int
    ctx_slots: torch.Tensor

    @property
    def query_len(self) -> int:
        return self.end - self.start


@dataclass
class AttentionBatch:
    """Per-step attention metadata built once by the model runner and read by every layer."""

    cache: PagedKVCache
    slots: torch.Tensor  # [T] where each token's K/V is written
    decode_tokens: torch.Tensor | None = None  # [Bd] packed indices of the one-token rows
    decode_slots: torch.Tensor | None = None  # [Bd, L] context slots per row (padded)
    decode_lens: torch.Tensor | None = None  # [Bd] context length per row
    prefills: list[PrefillSegment] = field(default_factory=list)
    flash: FlashBatch | None = None  # set when the flash-attn kernels serve this step (CUDA only)
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, L] boolean: which padded context slots each decode row attends to."""
        key = ("decode", window)
        if key not in self._masks:
            pos = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)
            lens = self.decode_lens[:, None]
            mask = pos[None, :] < lens
            if window is not None:
                mask &= pos[None, :] > (lens - 1 - window)
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """[q, L] boolean causal mask with the chunk's offset into its context; None when plain causal works."""
        seg = self.prefills[index]
        ctx_len = seg.ctx_slots.shape[0]
        if ctx_len == seg.query_len and window is None:
            return None
        key = ("prefill", index, window)
        if key not in self._masks:
            q_pos = torch.arange(ctx_len - seg.query_len, ctx_len, device=seg.ctx_slots.device)[:, None]
            k_pos = torch.arange(ctx_len, device=seg.ctx_slots.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask
        return self._masks[key]


def _attend(q, k, v, mask, scaling, softcap, is_causal=False):
    """Grouped-query attention of q `[B, H, q, D]` over k, v `[B, KVH, L, D]`."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                              scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: writes this step's K/V into the paged cache, then attends per request.

    query `[1, H, T, D]`, key/value `[1, KVH, T, D]` for the packed batch; returns `[1, T, H, D]`.
    """
    batch: AttentionBatch | None = kwargs.get("rollout_batch")
    if batch is None:
        raise RuntimeError("rollout's paged attention was called outside an engine forward (no `rollout_batch`).")
    layer = module.layer_idx
    cache = batch.cache
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache.write(layer, batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = cache.keys[layer], cache.values[layer]
    if batch.flash is not None:
        out = flash_paged_attention(query[0].transpose(0, 1), k_cache, v_cache, batch.flash, cache.page_size,
                                    scaling, window, softcap)
        return out.unsqueeze(0), None

    q_all = query[0]  # [H, T, D]
    out = torch.empty(q_all.shape[1], q_all.shape[0], q_all.shape[2], dtype=query.dtype, device=query.device)
    if batch.decode_tokens is not None:
        q = q_all.index_select(1, batch.decode_tokens).transpose(0, 1).unsqueeze(2)  # [Bd, H, 1, D]
        k = k_cache[batch.decode_slots].transpose(1, 2).to(q.dtype)  # [Bd, KVH, L, D]
        v = v_cache[batch.decode_slots].transpose(1, 2).to(q.dtype)
        o = _attend(q, k, v, batch.decode_mask(window), scaling, softcap)
        out.index_copy_(0, batch.decode_tokens, o.squeeze(2))
    for i, seg in enumerate(batch.prefills):
        q = q_all[:, seg.start:seg.end].unsqueeze(0)  # [1, H, q, D]
        k = k_cache[seg.ctx_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KVH, L, D]
        v = v_cache[seg.ctx_slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = _attend(q, k, v, batch.prefill_mask(i, window), scaling, softcap, is_causal=True)
        out[seg.start:seg.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def engine_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through the paged function for one forward, then restore it exactly."""
    config = model.config
    with _switch_lock:
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            config._attn_implementation = previous
