"""The C side of a weight sync (csrc/weight_sync.c): the finiteness scan behind an update's check, and the transposed
copy behind the in-place refresh of packed weights. Both must say and write exactly what the PyTorch ops would."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.cpu.kernel import all_finite, load_kernel, transpose_blocks
from rollout.rl import weights

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="no C kernel library on this machine")

# bit patterns: every NaN and infinity of the dtype has all exponent bits set; the largest finite value does not
NON_FINITE = {torch.float32: [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],
              torch.bfloat16: [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF]}
FINITE_EDGES = {torch.float32: [0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000],
                torch.bfloat16: [0x7F7F, 0xFF7F, 0x0001, 0x8000]}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _with_bits(values: torch.Tensor, index: int, pattern: int) -> torch.Tensor:
    out = values.clone()
    bits = BITS[values.dtype]
    signed = pattern - (1 << (8 * out.element_size())) if pattern >= 1 << (8 * out.element_size() - 1) else pattern
    out.view(bits)[index] = signed
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 70_001])  # one value, a vector tail, a parallel scan
def test_the_finiteness_scan_finds_every_nan_and_infinity_anywhere(dtype, n):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert all_finite(values) is True
    for index in {0, n // 2, n - 1}:
        for pattern in NON_FINITE[dtype]:
            bad = _with_bits(values, index, pattern)
            assert not torch.isfinite(bad).all()
            assert all_finite(bad) is False, f"bits {pattern:#x} at {index} of {n}"
        for pattern in FINITE_EDGES[dtype]:
            edge = _with_bits(values, index, pattern)
            assert torch.isfinite(edge).all() and all_finite(edge) is True


def test_the_finiteness_scan_declines_what_it_cannot_read():
    assert all_finite(torch.randn(8).half()) is None
    assert all_finite(torch.randn(8, 8).t()) is None  # not contiguous


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "aminmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_an_update_checks_finiteness_the_same_with_or_without_the_kernel(monkeypatch, dtype, kernel):
    if not kernel:
        monkeypatch.setattr(weights, "all_finite", lambda values: None)
    bound = torch.finfo(torch.float32).max
    values = torch.randn(1000).to(dtype)
    assert weights._finite_within(values, bound)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = values.clone()
        broken[999] = bad
        assert not weights._finite_within(broken, bound)
    if dtype == torch.float64:  # finite, but beyond a float32 weight's range
        big = values.clone()
        big[3] = 1e300
        assert not weights._finite_within(big, bound)


def _reference(src: torch.Tensor, size: int, offset: int, blocks: int, group: int, block_stride: int,
               column_stride: int, fill: int) -> torch.Tensor:
    dst = torch.full((size,), fill, dtype=src.dtype)
    cols = src.shape[1]
    view = dst.as_strided((blocks, cols, group), (block_stride, column_stride, 1), offset)
    view.copy_(src[:blocks * group].reshape(blocks, group, cols).transpose(1, 2))
    return dst


@needs_kernel
@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("blocks,group,cols,pad", [(1, 1, 1, 0), (3, 64, 40, 16), (2, 32, 17, 3), (5, 16, 100, 0),
                                                   (1, 64, 1024, 64), (1, 197, 45, 0), (2, 8, 33, 1)])
def test_the_transposed_copy_writes_each_group_column_by_column_and_nothing_else(bits, blocks, group, cols, pad):
    """Against the strided PyTorch copy of the same views, with padding between columns and blocks left as it was
    and NaN payloads moved bit for bit; with `plain`, the rows also copied as they are, and no others."""
    gen = torch.Generator().manual_seed(blocks * 1000 + cols)
    words, values = {32: (torch.int32, torch.float32), 16: (torch.int16, torch.bfloat16)}[bits]
    src = torch.randint(-2**(bits - 1), 2**(bits - 1) - 1, (blocks * group + 3, cols), dtype=words, generator=gen)
    column_stride = group + pad
    block_stride = cols * column_stride + pad
    offset = 5
    size = offset + blocks * block_stride + 7
    expected = _reference(src, size, offset, blocks, group, block_stride, column_stride, fill=-7)
    for view in (src, src.view(values)):  # fp32 weights or bf16 pairs as int32; bf16 values as int16
        dst = torch.full((size,), -7, dtype=words).view(view.dtype)
        transpose_blocks(view, dst, offset, blocks, group, block_stride, column_stride)
        assert torch.equal(dst.view(words), expected)
        plain = torch.full_like(src, -3).view(view.dtype)
        dst.view(words).fill_(-7)
        transpose_blocks(view, dst, offset, blocks, group, block_stride, column_stride, plain=plain)
        assert torch.equal(dst.view(words), expected)
        assert torch.equal(plain[:blocks * group].view(words), src[:blocks * group])
        assert (plain[blocks * group:].view(words) == -3).all()


@needs_kernel
@pytest.mark.parametrize("blocks,group,cols,pad", [(1, 1, 1, 0), (3, 64, 40, 16), (2, 32, 17, 3), (1, 64, 1024, 64),
                                                   (1, 197, 45, 0), (2, 8, 33, 1)])
def test_the_widening_transposed_copy_writes_the_fp32_of_each_bf16_value(blocks, group, cols, pad):
    """bf16 into an fp32 buffer (the fp32 copy of a bf16 weight): each element the bits torch's widening gives (NaN
    payloads, infinities, subnormals and -0 included), padding left as it was; `plain` gets the bf16 rows as they
    are."""
    gen = torch.Generator().manual_seed(blocks * 1000 + cols)
    src = torch.randint(-2**15, 2**15 - 1, (blocks * group + 3, cols), dtype=torch.int16, generator=gen)
    column_stride, offset = group + pad, 5
    block_stride = cols * column_stride + pad
    size = offset + blocks * block_stride + 7
    widened = src.view(torch.bfloat16).float().view(torch.int32)  # torch's widening: the bits in the high half
    expected = _reference(widened, size, offset, blocks, group, block_stride, column_stride, fill=-7)
    for plain in (None, torch.full_like(src, -3).view(torch.bfloat16)):
        dst = torch.full((size,), -7, dtype=torch.int32).view(torch.float32)
        transpose_blocks(src.view(torch.bfloat16), dst, offset, blocks, group, block_stride, column_stride,
                         plain=plain)
        assert torch.equal(dst.view(torch.int32), expected)
        if plain is not None:
            assert torch.equal(plain[:blocks * group].view(torch.int16), src[:blocks * group])
            assert (plain[blocks * group:].view(torch.int16) == -3).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 64, 65, 197, 256])
def test_one_transposed_group_of_many_rows_moves_as_groups_of_64_and_the_rest(rows):
    """A whole weight stored transposed (bf16 where the CPU has no bf16 dot products) is cut into parts the kernel
    moves from L2; together they write exactly the one transpose."""
    from rollout.engine.cpu.packed_layout import KERNEL_GROUP, Transpose, _kernel_parts

    cols, offset = 23, 3
    src = torch.randint(-2**15, 2**15 - 1, (rows, cols), dtype=torch.int16)
    whole = Transpose(1, rows, 0, rows)
    expected = _reference(src, offset + rows * cols + 2, offset, 1, rows, 0, rows, fill=-7)
    dst = torch.full_like(expected, -7)
    parts = _kernel_parts(whole)
    for row, part in parts:
        transpose_blocks(src[row:row + part.blocks * part.group], dst, offset + row, part.blocks, part.group,
                         part.block_stride, part.column_stride)
    assert torch.equal(dst, expected)
    assert sum(part.blocks * part.group for _, part in parts) == rows
    assert all(part.group <= KERNEL_GROUP for _, part in parts)


@needs_kernel
def test_the_transposed_copy_refuses_what_would_write_out_of_bounds_or_misread():
    src = torch.zeros(64, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="would write element"):
        transpose_blocks(src, torch.zeros(64 * 16 - 1), 0, 1, 64, 64 * 16, 64)
    with pytest.raises(ValueError, match="32- or 16-bit elements"):
        transpose_blocks(src, torch.zeros(4096).bfloat16(), 0, 1, 64, 64 * 16, 64)  # widths differ: fp32 to bf16
    with pytest.raises(ValueError, match="32- or 16-bit elements"):
        transpose_blocks(src.half(), torch.zeros(4096), 0, 1, 64, 64 * 16, 64)  # only bf16 is widened
    with pytest.raises(ValueError, match="32- or 16-bit elements"):
        transpose_blocks(src.double(), torch.zeros(4096).double(), 0, 1, 64, 64 * 16, 64)
    with pytest.raises(ValueError, match="32- or 16-bit elements"):
        transpose_blocks(src, torch.zeros(4096), 0, 2, 64, 64 * 16, 64)  # two groups of a 64-row source
    with pytest.raises(ValueError, match="plain tensor of 16-bit elements"):
        transpose_blocks(src.bfloat16(), torch.zeros(4096).bfloat16(), 0, 1, 64, 64 * 16, 64,
                         plain=torch.zeros(64, 16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "channel_shuffle"])
def test_a_packed_weight_is_refreshed_as_onednn_packs_it_with_or_without_the_kernel(monkeypatch, dtype, kernel):
    from rollout.engine.cpu import packed_layout
    from rollout.engine.cpu.features import PACK_BATCH_HINT, cpu_features

    if dtype not in cpu_features().packed_dtypes:
        pytest.skip(f"{dtype} is not packed on this CPU")
    if not kernel:
        monkeypatch.setattr(packed_layout, "load_kernel", lambda: None)
    monkeypatch.setattr(packed_layout, "transpose_blocks", _counted(packed_layout.transpose_blocks))
    shape = (3 * 64 + 5, 40)
    layout = packed_layout.layout_for.__wrapped__(shape, dtype, PACK_BATCH_HINT)  # derived under this monkeypatch
    assert layout is not None and layout.shuffle
    packed_layout.transpose_blocks.calls = 0
    weight = torch.randn(shape).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(shape, dtype=dtype), PACK_BATCH_HINT)
    assert layout.write(packed, weight)
    expected = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    assert torch.equal(packed_layout.buffer_of(packed).view(torch.uint8),
                       packed_layout.buffer_of(expected).view(torch.uint8))
    # groups of 64 rows interleaved (bf16 as pairs where the CPU has bf16 dot products), or, without those, bf16 as
    # one transpose of the whole weight: the kernel moves either
    assert any(box.transpose for box in layout.boxes)
    assert (packed_layout.transpose_blocks.calls > 0) == kernel


def _counted(fn):
    def counted(*args, **kwargs):
        counted.calls += 1
        return fn(*args, **kwargs)
    counted.calls = 0
    return counted
