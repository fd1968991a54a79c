"""The row counts oneDNN's packed matmuls see: every input is padded up to one of a bounded set of buckets."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.cpu.features import PACK_BATCH_HINT

# oneDNN keeps a few MiB per distinct row count it has seen (its JIT kernels): rows are padded up to a bucket (powers of
# two up to ROW_BUCKET, then multiples of ROW_BUCKET up to PACK_BATCH_HINT, then of WIDE_ROW_BUCKET: 63 up to 2,048
# rows) and inputs over PACKED_MAX_ROWS run as chunks, so a long run sees a bounded set of shapes. Multiples of 8
# rather than 16 below 256 rows: a short prefill is padded by about half as many rows, which made 17-128-token
# prefills faster for a little more oneDNN state (benchmarks/results-history.md, "Serving": row buckets of 8). A
# prefill runs as one matmul rather than 256-row chunks joined by `cat`, which is a copy of the whole output
# (benchmarks/RESULTS.md, "Prefill").
PACKED_MAX_ROWS = 2048
ROW_BUCKET = 8
WIDE_ROW_BUCKET = 64  # the compiled forward's default query padding: its steps are already buckets, never copied


def padded_rows(rows: int) -> int:
    """The bucket a row count is padded to: a power of two up to ROW_BUCKET, then a multiple of ROW_BUCKET up to
    PACK_BATCH_HINT, then a multiple of WIDE_ROW_BUCKET (a wide step wastes at most 63 rows, under 1/4 of its work)."""
    if rows <= ROW_BUCKET:
        return 1 << (rows - 1).bit_length()
    step = ROW_BUCKET if rows <= PACK_BATCH_HINT else WIDE_ROW_BUCKET
    return -(-rows // step) * step


class PaddedRows:
    """Runs a rows-in, rows-out computation (a packed matmul) on inputs padded up to their bucket, in chunks of at
    most PACKED_MAX_ROWS rows, with one reusable input buffer per bucket. A buffer's tail rows hold whatever earlier
    calls left: matmul rows are independent, and the outputs of padding rows are cut off."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def clear(self) -> None:
        self.buffers.clear()

    def _padded(self, flat: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        rows, padded = flat.shape[0], padded_rows(flat.shape[0])
        if padded == rows:
            return compute(flat.contiguous())
        key = (padded, flat.shape[1], flat.dtype)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.zeros(padded, flat.shape[1], dtype=flat.dtype)
        buf[:rows].copy_(flat)
        return compute(buf)[:rows]

    def run(self, x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`compute` over the rows of `x` (any leading dims), padded and chunked as above."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= PACKED_MAX_ROWS:
            out = self._padded(flat, compute)
        else:
            out = torch.cat([self._padded(chunk, compute) for chunk in flat.split(PACKED_MAX_ROWS)])
        return out.view(*x.shape[:-1], out.shape[-1])
