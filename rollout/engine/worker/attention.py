"""Paged attention for the engine's forward, registered with transformers' attention interface.

The function is selected for the engine's forward only (see `engine_attention`), never left switched on the module:
the same module may be trained between generation calls.

CPU: by default one call of the C kernel in cpu/kernel.py per layer attends every token of the step straight from
the pages (no gather). PyTorch path (no compiler, fp16, or `ROLLOUT_CPU_KERNEL=0`): decode rows (one query token
each) are sorted by context length and attended in a few buckets, each against a gather of its rows' own KV blocks
(whole pages are gathered with one `index_select`, far cheaper than a per-token gather); each prefill chunk is
attended alone with a causal offset mask, or, off the CPU, with chunks of similar size in one padded call (fewer
kernel launches per layer). The cost grows with each request's own context, never with a dense block-diagonal mask
over the whole batch. A kv head's query heads are folded into its query rows (`_fold_heads`) rather than passed with
`enable_gqa`, which CUDA serves with a fused kernel only when there is no mask. The runner builds every size a layer
needs on the host, so the forward never reads a value back from the device. On CUDA with flash-attn installed,
`flash_backend.py` provides the varlen and kv-cache kernels behind the same seam.

Compiled forward (compiled_forward.py): the step's metadata arrives as tensors (`rollout_step`, a StepTensors) and
each layer makes one call of the opaque custom op `rollout::paged_attention`, so dynamo traces the whole decoder into
one graph with no break per layer and no guard on per-step Python objects. The op writes the K/V and attends with
the C kernel, or with a per-row gather + SDPA when the kernel cannot serve the cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from rollout.engine.cpu.kernel import KernelBatch, paged_attention
from rollout.engine.worker.flash_backend import FlashBatch, flash_paged_attention
from rollout.engine.worker.kv_cache import PagedKVCache, write_slots

ATTENTION_NAME = "rollout_paged"
_switch_lock = threading.Lock()


def _positions_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility of keys at `k_pos` from queries at `q_pos` (broadcasting)."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


@dataclass
class DecodeBucket:
    """One-token rows of similar context length, attended together: rows `tokens` of the packed batch read the
    blocks `blocks` (`[rows * blocks_per_row]`, row-major) and `lens` keys each. `width`, the longest, is known
    when the runner builds the step on the host, so no layer reads it back from the device."""

    tokens: torch.Tensor
    blocks: torch.Tensor
    lens: torch.Tensor
    width: int
    _masks: dict = field(default_factory=dict)
    TENSORS: ClassVar[tuple[str, ...]] = ("tokens", "blocks", "lens")  # what the runner sends to the device

    def mask(self, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, width]: which gathered keys each row attends to (broadcast over its query heads)."""
        if window not in self._masks:
            pos = torch.arange(self.width, device=self.lens.device)[None, :]
            self._masks[window] = _positions_mask(self.lens[:, None] - 1, pos, window)[:, None, None, :]
        return self._masks[window]


@dataclass
class PrefillSegment:
    """One request's chunk of query tokens `[start, end)` in the packed batch, attending to the first `ctx_len`
    keys held in `blocks`."""

    start: int
    end: int
    blocks: torch.Tensor
    ctx_len: int
    _masks: dict = field(default_factory=dict)
    TENSORS: ClassVar[tuple[str, ...]] = ("blocks",)

    @property
    def query_len(self) -> int:
        return self.end - self.start

    def mask(self, window: int | None, groups: int = 1) -> torch.Tensor | None:
        """[groups * q, ctx] causal mask offset to the chunk's place in its context, repeated for the query heads
        folded in by `_fold_heads`; None when plain causal works."""
        if self.ctx_len == self.query_len and window is None:
            return None
        if (window, groups) not in self._masks:
            q_pos = torch.arange(self.ctx_len - self.query_len, self.ctx_len, device=self.blocks.device)
            k_pos = torch.arange(self.ctx_len, device=self.blocks.device)[None, :]
            self._masks[window, groups] = _positions_mask(q_pos.repeat(groups)[:, None], k_pos, window)
        return self._masks[window, groups]


@dataclass
class PrefillGroup:
    """Prefill chunks of several requests attended in one call, each padded to `q_len` queries and `width` keys:
    padded query row `i` of chunk `s` is packed token `queries[s * q_len + i]` at position `positions[s, i]` of
    its context (padding rows repeat a real token at position 0), and the chunk reads the blocks
    `blocks[s * n:(s + 1) * n]`. Rows `rows` of the `[S * q_len]` padded rows are real; they fill packed tokens
    `tokens`."""

    queries: torch.Tensor
    positions: torch.Tensor
    blocks: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    q_len: int
    width: int
    _masks: dict = field(default_factory=dict)
    TENSORS: ClassVar[tuple[str, ...]] = ("queries", "positions", "blocks", "rows", "tokens")

    def mask(self, window: int | None, groups: int) -> torch.Tensor:
        """[S, 1, groups * q_len, width]: which keys each padded query row sees (folded heads as in
        PrefillSegment.mask); keys past a chunk's own context lie after all of its positions."""
        if (window, groups) not in self._masks:
            k_pos = torch.arange(self.width, device=self.positions.device)[None, None, :]
            q_pos = self.positions.repeat(1, groups)[:, :, None]
            self._masks[window, groups] = _positions_mask(q_pos, k_pos, window)[:, None]
        return self._masks[window, groups]


@dataclass
class AttentionBatch:
    """Per-step attention metadata built once by the model runner and read by every layer."""

    cache: PagedKVCache
    slots: torch.Tensor  # [T] where each token's K/V is written
    decode: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    flash: FlashBatch | None = None  # set when the flash-attn kernels serve this step (CUDA only)
    kernel: KernelBatch | None = None  # set when the CPU kernel serves this step
    scratch: GatherScratch | None = None
    calls: list[tuple[int, int | None]] | None = None  # when set, each layer appends (index, sliding window)
    by_layer: list[AttentionBatch] | None = None  # several KV groups: the batch of each layer's group


class GatherScratch:
    """Two reusable buffers for gathered K and V pages. Allocating tens of MiB per layer per step is expensive
    (fresh pages fault in on every call), so gathers write into buffers that only ever grow."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def view(self, which: int, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A `[num_blocks, *like.shape[1:]]` slice of buffer `which` (0: keys, 1: values)."""
        shape = (num_blocks, *like.shape[1:])
        buf = self._buffers[which]
        if buf is None or buf.numel() < like[0].numel() * num_blocks or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = torch.empty(max(num_blocks, 1) * like[0].numel(), dtype=like.dtype, device=like.device)
            self._buffers[which] = buf
        return buf[:like[0].numel() * num_blocks].view(shape)


def _gather(pages: torch.Tensor, blocks: torch.Tensor, rows: int, width: int, scratch: GatherScratch | None,
            which: int) -> torch.Tensor:
    """Keys or values of `blocks` as `[rows, KVH, width, D]` (one index_select of whole pages)."""
    if scratch is None:
        out = pages.index_select(0, blocks)
    else:
        out = torch.index_select(pages, 0, blocks, out=scratch.view(which, pages, len(blocks)))
    return out.view(rows, -1, pages.shape[2], pages.shape[3])[:, :width].transpose(1, 2)


def _fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, H, q, D]` as `[B, KVH, groups * q, D]`: each kv head's query heads (transformers' GQA maps head h to kv
    head h // groups) become query rows of that head, so SDPA needs no `enable_gqa`; a `[B, 1, 1, L]` mask
    broadcasts over them, a chunk's mask is repeated per head (PrefillSegment.mask)."""
    return q.reshape(q.shape[0], kv_heads, -1, q.shape[-1])


def _attend(q, k, v, mask, scaling, softcap, is_causal=False):
    """Grouped-query attention of q `[B, H, q, D]` over k, v `[B, KVH, L, D]`.

    Off the CPU, SDPA serves `enable_gqa` only with its flash kernel (no mask, half precision) and otherwise falls
    back to the math kernel, so the eager path folds the heads of masked calls (`_fold_heads`) and K/V are
    expanded here for what still arrives grouped. The CPU's flash kernel takes GQA with or without a mask."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        if groups > 1 and q.device.type != "cpu" and (mask is not None or q.dtype == torch.float32):
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            groups = 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                              scale=scaling, enable_gqa=groups > 1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v)


class StepTensors(NamedTuple):
    """The compiled forward's per-step attention metadata: tensors, plus constants of the engine, so dynamo guards
    on shapes alone. `keys`/`values` are the cache's per-layer lists (the same tensors every step); slots and tables
    come one per KV group, and `layer_group` says which a layer uses."""

    slots: tuple[torch.Tensor, ...]  # per group: [T] where each token's K/V is written
    positions: torch.Tensor  # [T] each token's position in its row
    token_rows: torch.Tensor  # [T] each token's row of `tables`
    tables: tuple[torch.Tensor, ...]  # per group: [R, max_blocks] block ids per row
    layer_group: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    page_size: int
    use_kernel: bool  # the C kernel attends; False: per-row gathers + SDPA


def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, token_rows: torch.Tensor,
                       tables: torch.Tensor, page_size: int, scale: float, window: int, softcap: float,
                       use_kernel: bool) -> torch.Tensor:
    """`rollout::paged_attention`: write the step's K/V at `slots`, then attend every token over its row's pages:
    query `[1, H, T, D]`, key/value `[1, KVH, T, D]`, caches `[slots, KVH, D]`; returns `[T, H, D]`. `window` 0:
    none; `softcap` 0: none."""
    write_slots(k_cache, v_cache, slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)
    if use_kernel:
        out = paged_attention(q, k_cache, v_cache, KernelBatch(positions, token_rows, tables), page_size, scale,
                              window or None, softcap or None)
    else:
        out = _rows_attention(q, k_cache, v_cache, positions, token_rows, tables, page_size, scale, window or None,
                              softcap or None)
    return out.to(query.dtype)


def _paged_attention_fake(query, key, value, k_cache, v_cache, slots, positions, token_rows, tables, page_size, scale,
                          window, softcap, use_kernel):
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


# Defined with torch.library.Library rather than @custom_op, whose per-call argument handling cost more than the
# kernel itself for a one-token step; the schema marks the two caches as written in place.
_LIBRARY = torch.library.Library("rollout", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                "Tensor slots, Tensor positions, Tensor token_rows, Tensor tables, int page_size, float scale, "
                "int window, float softcap, bool use_kernel) -> Tensor")
_LIBRARY.impl("paged_attention", paged_attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("rollout::paged_attention", _paged_attention_fake, lib=_LIBRARY)


def _rows_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    token_rows: torch.Tensor, tables: torch.Tensor, page_size: int, scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """The op without the C kernel: each row's tokens (contiguous in the packed batch) attend over a gather of the
    row's pages, masked by position. q `[T, H, D]`; returns `[T, H, D]`."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_pages = k_cache.view(-1, page_size, *k_cache.shape[1:])
    v_pages = v_cache.view(-1, page_size, *v_cache.shape[1:])
    counts = torch.bincount(token_rows, minlength=tables.shape[0]).tolist()
    start = 0
    for row, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        pos = positions[start:end]
        ctx = int(pos.max()) + 1
        blocks = tables[row, :-(-ctx // page_size)]
        k = _gather(k_pages, blocks, 1, ctx, None, 0).to(q.dtype)
        v = _gather(v_pages, blocks, 1, ctx, None, 1).to(q.dtype)
        mask = _positions_mask(pos[:, None], torch.arange(ctx, device=q.device)[None, :], window)
        o = _attend(q[start:end].transpose(0, 1).unsqueeze(0), k, v, mask, scale, softcap)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def _compiled_step_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float | None, step: StepTensors, kwargs: dict) -> torch.Tensor:
    """The layer's attention on the compiled path: one opaque op call, `[1, T, H, D]`."""
    layer = module.layer_idx
    group = step.layer_group[layer]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.rollout.paged_attention(query, key, value, step.keys[layer], step.values[layer],
                                            step.slots[group], step.positions, step.token_rows, step.tables[group],
                                            step.page_size,
                                            float(scale), int(kwargs.get("sliding_window") or 0),
                                            float(kwargs.get("softcap") or 0.0), step.use_kernel)
    return out.unsqueeze(0)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: writes this step's K/V into the paged cache, then attends per request.

    query `[1, H, T, D]`, key/value `[1, KVH, T, D]` for the packed batch; returns `[1, T, H, D]`.
    """
    step: StepTensors | None = kwargs.get("rollout_step")
    if step is not None:
        return _compiled_step_attention(module, query, key, value, scaling, step, kwargs), None
    batch: AttentionBatch | None = kwargs.get("rollout_batch")
    if batch is None:
        raise RuntimeError("rollout's paged attention was called outside an engine forward (no `rollout_batch`).")
    layer = module.layer_idx
    window = kwargs.get("sliding_window")
    if batch.calls is not None:
        batch.calls.append((layer, window))
    if batch.by_layer is not None:
        batch = batch.by_layer[layer]
    cache = batch.cache
    softcap = kwargs.get("softcap")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache.write(layer, batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = cache.keys[layer], cache.values[layer]
    if batch.flash is not None:
        out = flash_paged_attention(query[0].transpose(0, 1), k_cache, v_cache, batch.flash, cache.page_size,
                                    scaling, window, softcap)
        return out.unsqueeze(0), None
    if batch.kernel is not None:
        out = paged_attention(query[0].transpose(0, 1), k_cache, v_cache, batch.kernel, cache.page_size, scaling,
                              window, softcap)
        return out.to(query.dtype).unsqueeze(0), None

    k_pages = k_cache.view(-1, cache.page_size, *k_cache.shape[1:])
    v_pages = v_cache.view(-1, cache.page_size, *v_cache.shape[1:])
    q_all = query[0]  # [H, T, D]
    heads, tokens, dim = q_all.shape
    kv_heads = k_cache.shape[1]
    groups = heads // kv_heads
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    out_kv = out.view(tokens, kv_heads, groups, dim)  # the layout of folded query heads
    for bucket in batch.decode:
        rows = len(bucket.tokens)
        q = q_all.index_select(1, bucket.tokens).transpose(0, 1).unsqueeze(2)  # [rows, H, 1, D]
        k = _gather(k_pages, bucket.blocks, rows, bucket.width, batch.scratch, 0).to(q.dtype)
        v = _gather(v_pages, bucket.blocks, rows, bucket.width, batch.scratch, 1).to(q.dtype)
        o = _attend(_fold_heads(q, kv_heads), k, v, bucket.mask(window), scaling, softcap)  # [rows, KVH, G, D]
        out_kv.index_copy_(0, bucket.tokens, o)
    for seg in batch.prefills:
        q = q_all[:, seg.start:seg.end].unsqueeze(0)  # [1, H, q, D]
        k = _gather(k_pages, seg.blocks, 1, seg.ctx_len, batch.scratch, 0).to(q.dtype)
        v = _gather(v_pages, seg.blocks, 1, seg.ctx_len, batch.scratch, 1).to(q.dtype)
        mask = seg.mask(window, groups)
        if mask is None:  # plain causal: SDPA's causal kernels
            o = _attend(q, k, v, None, scaling, softcap, is_causal=True)
        else:
            o = _attend(_fold_heads(q, kv_heads), k, v, mask, scaling, softcap)
        out[seg.start:seg.end] = o.reshape(heads, seg.query_len, dim).transpose(0, 1)
    for group in batch.prefill_groups:
        chunks, q_len = group.positions.shape
        q = q_all.index_select(1, group.queries).view(heads, chunks, q_len, dim).transpose(0, 1)  # [S, H, q, D]
        k = _gather(k_pages, group.blocks, chunks, group.width, batch.scratch, 0).to(q.dtype)
        v = _gather(v_pages, group.blocks, chunks, group.width, batch.scratch, 1).to(q.dtype)
        o = _attend(_fold_heads(q, kv_heads), k, v, group.mask(window, groups), scaling, softcap)
        o = o.view(chunks, kv_heads, groups, q_len, dim).permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, groups, dim)
        out_kv.index_copy_(0, group.tokens, o.index_select(0, group.rows))
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
