"""flash-attn kernels for the paged cache on CUDA: the varlen kernel with a block table for mixed steps and
`flash_attn_with_kvcache` for decode-only steps. Optional: used only when `flash_attn` imports, the cache is on CUDA
in fp16/bf16 and the page size suits the kernels; otherwise the SDPA path in attention.py runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

try:  # pragma: no cover - not installable on the CPU machines the tests run on
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    HAVE_FLASH = True
except ImportError:
    flash_attn_varlen_func = flash_attn_with_kvcache = None
    HAVE_FLASH = False

FLASH_PAGE_MULTIPLE = 256  # flash-attn 2's paged KV needs block sizes divisible by 256


def flash_usable(device: torch.device, dtype: torch.dtype, page_size: int) -> bool:
    """Whether the flash kernels can serve this cache; logs why not when they are installed but unusable."""
    if not HAVE_FLASH or device.type != "cuda":
        return False
    if dtype not in (torch.float16, torch.bfloat16) or page_size % FLASH_PAGE_MULTIPLE:
        logger.info("flash-attn installed but unused: needs fp16/bf16 and page_size divisible by %d (got %s, %d)",
                    FLASH_PAGE_MULTIPLE, dtype, page_size)
        return False
    return True


@dataclass
class FlashBatch:
    """Per-step metadata for the kernels (int32, on the cache's device)."""

    block_tables: torch.Tensor  # [B, max_blocks]
    context_lens: torch.Tensor  # [B] keys per sequence after this step
    cu_seqlens_q: torch.Tensor  # [B + 1]
    cu_seqlens_k: torch.Tensor  # [B + 1]
    max_query_len: int
    max_context_len: int
    kv_cache_kernel: bool = False  # a decode-only step `flash_attn_with_kvcache` serves (the decode fast path)


FLASH_HOST_TENSORS = 4  # what flash_host_tensors returns


def flash_host_tensors(tables: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor
                       ) -> list[torch.Tensor]:
    """The kernels' metadata built on the host, int64 like the rest of the step it travels to the device with:
    block tables, context lengths, and the query and key offsets."""
    cu_q = torch.zeros(len(query_lens) + 1, dtype=torch.long)
    cu_q[1:] = torch.cumsum(query_lens, 0)
    cu_k = torch.zeros(len(context_lens) + 1, dtype=torch.long)
    cu_k[1:] = torch.cumsum(context_lens, 0)
    return [tables, context_lens, cu_q, cu_k]


def build_flash_batch(moved: list[torch.Tensor], query_lens: torch.Tensor, context_lens: torch.Tensor,
                      fast_path_blocks: int | None = None) -> FlashBatch:
    """The FlashBatch of `flash_host_tensors` once on the device (cast there: no further copy from the host); the
    two maxima are read from the host tensors. `fast_path_blocks` (`max_blocks_per_request`): the widest block table
    the decode fast path takes (None: any; 0: the fast path is off, decode-only steps take the varlen kernel)."""
    tables, lens, cu_q, cu_k = (t.to(torch.int32) for t in moved)
    max_query = int(query_lens.max())
    fast = max_query == 1 and (fast_path_blocks is None or moved[0].shape[1] <= fast_path_blocks)
    return FlashBatch(tables, lens, cu_q, cu_k, max_query, int(context_lens.max()), fast)


def flash_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: FlashBatch,
                          page_size: int, scaling: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """query `[T, H, D]` (packed); caches `[slots, KVH, D]`; returns `[T, H, D]`."""
    k_pages = k_cache.view(-1, page_size, *k_cache.shape[1:])
    v_pages = v_cache.view(-1, page_size, *v_cache.shape[1:])
    window_size = (window - 1, 0) if window is not None else (-1, -1)
    if batch.kv_cache_kernel:
        out = flash_attn_with_kvcache(
            query.unsqueeze(1), k_pages, v_pages, cache_seqlens=batch.context_lens, block_table=batch.block_tables,
            softmax_scale=scaling, causal=True, window_size=window_size, softcap=softcap or 0.0)
        return out.squeeze(1)
    return flash_attn_varlen_func(
        query, k_pages, v_pages, batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_query_len,
        batch.max_context_len, softmax_scale=scaling, causal=True, window_size=window_size, softcap=softcap or 0.0,
        block_table=batch.block_tables)
