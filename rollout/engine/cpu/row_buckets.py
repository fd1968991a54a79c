"""The row counts oneDNN's packed matmuls see: every input is padded up to one of a bounded set of buckets."""

from __future__ import annotations

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
