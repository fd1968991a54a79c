"""Where oneDNN's packed copy of a linear weight keeps each element, so that a weight update can refresh the copy in
place (a few strided copies into its existing buffer) instead of repacking it.

Why: `torch.ops.mkldnn._reorder_linear_weight` returns an opaque mkldnn tensor in a fresh buffer. Repacking the linear
weights after a weight update costs many times a plain copy of the same tensors: page faults of the fresh buffers, then
oneDNN's reorder, its primitive set up again on every call. Yet the buffer holds a fixed blocked layout, zero-padded to
whole blocks: with AVX-512 (and AVX2) fp32 is [ceil(O/64)][I padded to 16][64], 64 output rows interleaved, and bf16
[ceil(O/64)][I/2][64][2] on CPUs with bf16 dot products (without them, as on an Ice Lake Xeon: the whole weight
transposed, [I][O]). Writing the new values through views of the existing buffer allocates nothing and calls no
oneDNN: each group of 64 rows is a transpose (bf16 pairs move as 32-bit words; a whole-weight bf16 transpose is cut
into groups of 64 rows of 16-bit values), done in one pass through L1-sized tiles by the C kernel library
(csrc/weight_sync.c), or, where there is none, by torch's channels-last channel_shuffle kernel (a SIMD transpose into
a temporary; 32-bit words only) plus a copy into the buffer; either is faster than an element-by-element strided
`copy_` (benchmarks/RESULTS.md, "RL layer").

How, trusting none of that, once per (shape, dtype) and process: sparse probe weights whose first column (first row)
spells each row (column) index in exact digits (24 bits in fp32, 8 in bf16; 0 marks padding) give the buffer offsets
f(o) of column 0 and g(i) of row 0. Each is factored into nested blocks (radix, stride), which splits the weight into a
few boxes, each one strided view of the buffer, assuming offset(o, i) = f(o) + g(i) - f(0). Then full probes (every
element spelling its row index, then its column index) and random bits are written along the boxes and must equal
oneDNN's reorder of them byte for byte, padding included, for every variant of the copy a weight may select at run time
(with or without the wide words and channel_shuffle): equal row and column digits at every position means the same
permutation. Anything else (another torch or oneDNN without the buffer accessors, a layout not blocked per dimension,
a copy that does not match) gives no layout, and the caller repacks in full as before. A packed copy's oneDNN memory
descriptor must equal the probes' before it is first written in place. The derivation is a one-off cost per shape
(benchmarks/RESULTS.md, "RL layer"); an emulated AVX2-only EPYC derives the same fp32 layout (bf16 is not packed there).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.engine.cpu.kernel import load_kernel, transpose_blocks

logger = logging.getLogger(__name__)

_WIDE = {4: torch.int32, 8: torch.int64}  # bf16 pairs adjacent in both weight and buffer are copied as one int32
KERNEL_GROUP = 64  # rows of a transposed group the C kernel moves at a time (a group of a few thousand columns: L2)

Dim = tuple[int, int, int, int]  # (size, step in o, step in i, buffer stride)


@dataclass(frozen=True)
class Transpose:
    """A box that is `blocks` consecutive groups of `group` whole rows, each stored transposed (column by column,
    `column_stride` apart, the groups `block_stride` apart): one channel_shuffle moves it (a SIMD transpose in
    torch's channels-last kernel, faster than the element-by-element strided copy)."""

    blocks: int
    group: int
    block_stride: int
    column_stride: int


@dataclass(frozen=True)
class Box:
    """A block of the weight that is one strided view of the buffer: the elements (o0 + sum d*o_step, i0 + sum d*i_step)
    over the dims, at buffer offset `offset` + sum d*stride (in elements of `factor` weight elements each)."""

    o0: int
    i0: int
    offset: int
    dims: tuple[Dim, ...]
    factor: int = 1  # > 1: the innermost run of `factor` elements is contiguous in both and moved as one wider word
    transpose: Transpose | None = None

    def widened(self, itemsize: int) -> Box | None:
        """This box with its run of contiguous pairs/quads moved as single words, or None where it has none."""
        for k, (size, o_step, i_step, stride) in enumerate(self.dims):
            if (o_step, i_step, stride) != (0, 1, 1) or size * itemsize not in _WIDE:
                continue
            rest = self.dims[:k] + self.dims[k + 1:]
            if self.i0 % size or self.offset % size or any(i % size or s % size for _, _, i, s in rest):
                return None
            return Box(self.o0, self.i0 // size, self.offset // size,
                       tuple((n, o, i // size, s // size) for n, o, i, s in rest), size)
        return None

    def with_transpose(self, width: int) -> Box:
        """This box, with its Transpose where it covers whole rows (`width` words) stored column by column."""
        if self.i0 != 0 or len(self.dims) not in (2, 3):
            return self
        *outer, (group, o1, i1, s1), (cols, o2, i2, s2) = self.dims
        if (o1, i1, s1) != (1, 0, 1) or (o2, i2) != (0, 1) or cols != width or s2 < group:
            return self
        blocks, block_stride = 1, 0
        if outer:
            blocks, o0, i0, block_stride = outer[0]
            if (o0, i0) != (group, 0):
                return self
        return dataclasses.replace(self, transpose=Transpose(blocks, group, block_stride, s2))


def _copy(boxes: tuple[Box, ...], dst: torch.Tensor, weight: torch.Tensor, shuffle: bool,
          plain: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """Write `weight` into the flat buffer `dst` (its own dtype) along `boxes` (in words of `factor` elements, the
    box's i0 included); `shuffle`: move the boxes that have a Transpose with channel_shuffle where the rows allow.
    `plain` (a tensor of weight's shape and strides): the C transposes also copy their rows of `weight` there in the
    same pass; returns the row ranges [start, stop) they copied."""
    copied = []
    for box in boxes:
        src, d, live = weight, dst, plain
        if box.factor > 1:
            wide = _WIDE[box.factor * weight.element_size()]
            src, d = weight.view(wide), dst.view(wide)  # needs s1 == 1, s0 and the offset divisible: else raises
            live = None if plain is None else plain.view(wide)
        s0, s1 = src.stride()
        start = src.storage_offset() + box.o0 * s0 + box.i0 * s1
        t = box.transpose
        whole_rows = shuffle and t is not None and s1 == 1 and s0 == src.shape[1]
        if whole_rows and load_kernel() is not None and src.element_size() in (2, 4):  # one pass, no temporary
            for row, part in _kernel_parts(t):
                _transpose_part(src, d, start + row * s0, box.offset + row, part, live)
            if live is not None:
                copied.append((box.o0, box.o0 + t.blocks * t.group))
            continue
        if whole_rows and src.element_size() == 4:
            words = t.group * s0  # one group of whole rows, contiguous
            rows = src.as_strided((t.blocks, words, 1, 1), (words, 1, words, words), start)  # channels-last
            moved = F.channel_shuffle(rows.view(torch.float32), t.group)  # per block: (group, cols) -> (cols, group)
            moved = moved.permute(0, 2, 3, 1).reshape(t.blocks, s0, t.group).view(d.dtype)
            d.as_strided((t.blocks, s0, t.group), (t.block_stride, t.column_stride, 1), box.offset).copy_(moved)
            continue
        sizes = [n for n, _, _, _ in box.dims]
        src_view = src.as_strided(sizes, [o * s0 + i * s1 for _, o, i, _ in box.dims], start)
        d.as_strided(sizes, [s for _, _, _, s in box.dims], box.offset).copy_(src_view)
    return copied


def _transpose_part(src: torch.Tensor, dst: torch.Tensor, at: int, offset: int, part: Transpose,
                    live: torch.Tensor | None) -> None:
    """The C transpose of `part`'s rows of `src` (its whole rows from element `at` on) into `dst` from `offset`,
    copying them to the same rows of `live` (a tensor of src's shape and strides) in the same pass where given."""
    rows = (part.blocks * part.group, src.stride(0))
    live_rows = None if live is None else live.as_strided(rows, (rows[1], 1),
                                                          live.storage_offset() + at - src.storage_offset())
    transpose_blocks(src.as_strided(rows, (rows[1], 1), at), dst, offset, part.blocks, part.group, part.block_stride,
                     part.column_stride, plain=live_rows)


def _kernel_parts(t: Transpose) -> list[tuple[int, Transpose]]:
    """`t` as the C transpose runs it best, with the first row of each part: one group of many rows (a whole weight
    stored transposed, as oneDNN packs bf16 where the CPU has no bf16 dot products) cut into groups of KERNEL_GROUP
    rows, each of which the kernel copies and transposes from L2, and what is left."""
    if t.blocks != 1 or t.group <= KERNEL_GROUP:
        return [(0, t)]
    full = t.group // KERNEL_GROUP * KERNEL_GROUP
    parts = [(0, Transpose(full // KERNEL_GROUP, KERNEL_GROUP, KERNEL_GROUP, t.column_stride))]
    return parts + ([(full, Transpose(1, t.group - full, 0, t.column_stride))] if full < t.group else [])


def _gaps(covered: list[tuple[int, int]], rows: int) -> list[tuple[int, int]]:
    """The row ranges of [0, rows) outside the `covered` ones."""
    gaps, at = [], 0
    for start, stop in sorted(covered):
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    return gaps + ([(at, rows)] if at < rows else [])


@dataclass(frozen=True)
class BlockedLayout:
    """The verified layout of oneDNN's packed copy of a weight of one shape and dtype."""

    shape: tuple[int, int]
    dtype: torch.dtype
    nbytes: int
    descriptor: bytes  # oneDNN's serialized memory descriptor of the probe packs
    boxes: tuple[Box, ...]  # element by element
    wide: tuple[Box, ...] | None = None  # the same with contiguous bf16 pairs as int32 (None: no such runs)
    shuffle: bool = False  # whether the Transpose boxes may go through channel_shuffle (verified)

    def matches(self, packed: torch.Tensor) -> bool:
        """Whether `packed` (an mkldnn tensor) has exactly this layout."""
        return (packed.is_mkldnn and packed.dtype == self.dtype and tuple(packed.shape) == self.shape
                and torch.ops.mkldnn._nbytes(packed) == self.nbytes and _descriptor(packed) == self.descriptor)

    def buffer(self, packed: torch.Tensor) -> torch.Tensor | None:
        """The memory of `packed` as a flat tensor to `write_flat` into (an alias, valid while `packed` lives), or None
        unless `packed` has exactly this layout."""
        return buffer_of(packed) if self.matches(packed) else None

    def write_flat(self, dst: torch.Tensor, weight: torch.Tensor, wide: bool = True, shuffle: bool = True) -> None:
        """Write `weight` into `dst`, a flat buffer of this layout (never touching its padding); a bf16 `weight` into
        an fp32 layout is widened on the way (the fp32 copy of a bf16 weight: no widened temporary). `wide`/`shuffle`
        False: without the faster copies (for the checks)."""
        _copy(self._boxes_for(weight, wide), dst, weight, shuffle and self.shuffle)

    def write_both(self, dst: torch.Tensor, live: torch.Tensor, weight: torch.Tensor) -> None:
        """Write `weight` into the live weight `live` (a contiguous tensor of its shape and dtype) and into `dst`, a
        flat buffer of this layout (widened, as in `write_flat`), reading `weight` once where the C transposes move
        it: each tile goes to both from L1. The rows no transpose covers are copied to `live` after."""
        both = _can_widen(live, self.wide) if self.wide is not None else True
        copied = _copy(self._boxes_for(weight, both), dst, weight, self.shuffle, plain=live)
        for start, stop in _gaps(copied, weight.shape[0]):
            live[start:stop].copy_(weight[start:stop])

    def _boxes_for(self, weight: torch.Tensor, wide: bool) -> tuple[Box, ...]:
        """The boxes to write `weight` along: its wide words where allowed and aligned (words of this layout's dtype:
        never for a widened weight)."""
        if weight.dtype != self.dtype and (weight.dtype, self.dtype) != (torch.bfloat16, torch.float32):
            raise ValueError(f"a {self.dtype} packed layout takes {self.dtype} weights (or bf16 ones widened into "
                             f"fp32), not {weight.dtype}")
        if wide and self.wide is not None and weight.dtype == self.dtype and _can_widen(weight, self.wide):
            return self.wide
        return self.boxes

    def write(self, packed: torch.Tensor, weight: torch.Tensor) -> bool:
        """Write `weight` into the existing packed copy `packed` in place; False (nothing written) unless `packed` has
        exactly this layout. Equal, byte for byte, to `_reorder_linear_weight(weight)`."""
        buffer = self.buffer(packed)
        if buffer is None or tuple(weight.shape) != self.shape or weight.dtype != self.dtype:
            return False
        with torch.no_grad():
            self.write_flat(buffer, weight.detach())
        return True


def _can_widen(weight: torch.Tensor, boxes: tuple[Box, ...]) -> bool:
    """Whether `weight` can be viewed as the wider words of `boxes` (which all share one factor)."""
    factor = boxes[0].factor if boxes else 1
    s0, s1 = weight.stride()
    return s1 == 1 and s0 % factor == 0 and weight.storage_offset() % factor == 0 \
        and weight.data_ptr() % (factor * weight.element_size()) == 0


def _descriptor(packed: torch.Tensor) -> bytes:
    return torch.ops.mkldnn._get_mkldnn_serialized_md(packed).numpy().tobytes()


def buffer_of(packed: torch.Tensor) -> torch.Tensor:
    """The memory of an mkldnn tensor as a flat strided tensor of its dtype (an alias: valid while `packed` lives)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(raw, dtype=torch.uint8).view(packed.dtype)


def _levels(offsets: torch.Tensor) -> list[tuple[int, int]] | None:
    """`offsets[x]` (offsets[0] == 0) as nested blocks [(radix, stride), ...] outer to inner:
    offsets[x] = sum over levels of digit * stride, the digits being x in the mixed radix; None if it is not one."""
    n = offsets.numel()
    if n == 1:
        return []
    step = int(offsets[1])
    x = torch.arange(n)
    bad = (offsets != x * step).nonzero()
    if bad.numel() == 0:
        return [(n, step)]
    block = int(bad[0])  # >= 2
    outer = offsets[::block]
    if not torch.equal(offsets, outer.repeat_interleave(block)[:n] + (x % block) * step):
        return None
    rest = _levels(outer)
    return None if rest is None else [*rest, (block, step)]


def _ranges(n: int, levels: list[tuple[int, int]]) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Indices 0..n-1 of a blocked dimension as boxes (first index, its offset, [(size, index step, stride)])."""
    if not levels:
        return [(0, 0, [])]  # n == 1
    (_, stride), inner = levels[0], levels[1:]
    block = 1
    for radix, _ in inner:
        block *= radix
    full, rest = divmod(n, block)
    out = []
    if full:
        steps, dims = block, [(full, block, stride)]
        for radix, s in inner:
            steps //= radix
            dims.append((radix, steps, s))
        out.append((0, 0, dims))
    for start, offset, dims in _ranges(rest, inner) if rest else []:
        out.append((full * block + start, full * stride + offset, dims))
    return out


def _boxes(f: torch.Tensor, g: torch.Tensor) -> tuple[Box, ...] | None:
    """The boxes of a layout whose offset of (o, i) is f[o] + g[i] - f[0]."""
    base = int(f[0])
    f_levels, g_levels = _levels(f - base), _levels(g - int(g[0]))
    if f_levels is None or g_levels is None:
        return None
    boxes = []
    for o0, o_off, o_dims in _ranges(f.numel(), f_levels):
        for i0, i_off, i_dims in _ranges(g.numel(), g_levels):
            dims = [(n, step, 0, s) for n, step, s in o_dims] + [(n, 0, step, s) for n, step, s in i_dims]
            boxes.append(Box(o0, i0, base + o_off + i_off, tuple(d for d in dims if d[0] > 1)))
    return tuple(boxes)


class _ProbeError(Exception):
    """Why probing oneDNN's layout failed."""


def _digit_bits(dtype: torch.dtype) -> int:
    """Bits per probe digit: 1 + a digit must be an exact integer in `dtype` (up to 2^24 in fp32, 2^8 in bf16)."""
    return 24 if dtype == torch.float32 else 8


def _digits(n: int, dtype: torch.dtype) -> int:
    """How many probe digits the indices 0..n-1 have."""
    bits = _digit_bits(dtype)
    return max(1, -(-(n - 1).bit_length() // bits))


def _probe(shape: tuple[int, int], dtype: torch.dtype, axis: int, digit: int, sparse: bool) -> torch.Tensor:
    """A weight whose element (o, i) is 1 + the `digit`-th probe digit of its index along `axis` (o for 0, i for 1):
    exact, and never 0, which marks padding. `sparse`: only the first column (axis 0) or row (axis 1) is set, the rest
    is 0."""
    n, bits = shape[axis], _digit_bits(dtype)
    values = (((torch.arange(n) >> (bits * digit)) & ((1 << bits) - 1)) + 1).to(dtype)
    if sparse:
        weight = torch.zeros(shape, dtype=dtype)
        (weight[:, 0] if axis == 0 else weight[0, :]).copy_(values)
        return weight
    return (values[:, None] if axis == 0 else values[None, :]).expand(shape).contiguous()


def _pack(weight: torch.Tensor, batch_hint: int, seen: set[tuple[bytes, int]]) -> torch.Tensor:
    """oneDNN's packed copy of `weight`; _ProbeError if packing fails or if its layout differs from earlier probes."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        seen.add((_descriptor(packed), torch.ops.mkldnn._nbytes(packed)))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        text = str(err).strip()
        raise _ProbeError(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}") from err
    if not packed.is_mkldnn or len(seen) != 1:
        raise _ProbeError("the probe packs differ in layout")
    return packed


def _offsets(shape: tuple[int, int], dtype: torch.dtype, axis: int, batch_hint: int,
             seen: set[tuple[bytes, int]]) -> torch.Tensor:
    """The buffer offset of each element of the first column (axis 0) or row (axis 1), from sparse probes."""
    n = shape[axis]
    index, positions = None, None
    for digit in range(_digits(n, dtype)):
        packed = _pack(_probe(shape, dtype, axis, digit, sparse=True), batch_hint, seen)
        buffer = buffer_of(packed)
        found = buffer.nonzero().squeeze(1)
        if positions is None:
            positions, index = found, torch.zeros(found.numel(), dtype=torch.int64)
        if not torch.equal(found, positions):
            raise _ProbeError("the packed buffer is not a permutation of the weight")
        index += (buffer[found].to(torch.int64) - 1) << (_digit_bits(dtype) * digit)
    if index.numel() != n or not torch.equal(index.sort().values, torch.arange(n)):
        raise _ProbeError("the packed buffer is not a permutation of the weight")
    offsets = torch.empty(n, dtype=torch.int64)
    offsets[index] = positions
    return offsets


def _derive(shape: tuple[int, int], dtype: torch.dtype, batch_hint: int) -> BlockedLayout | str:
    """The layout of `_reorder_linear_weight(weight of shape/dtype, batch_hint)`, or why there is none."""
    seen: set[tuple[bytes, int]] = set()
    try:
        f, g = (_offsets(shape, dtype, axis, batch_hint, seen) for axis in (0, 1))
    except _ProbeError as err:
        return str(err)
    if int(f[0]) != int(g[0]):
        return "the packed buffer is not a permutation of the weight"
    boxes = _boxes(f, g)
    if boxes is None:
        return "the layout is not blocked per dimension"
    itemsize = torch.empty(0, dtype=dtype).element_size()
    boxes = tuple(box.with_transpose(shape[1]) for box in boxes)
    wide = [box.widened(itemsize) for box in boxes]
    wide = tuple(box.with_transpose(shape[1] // box.factor) for box in wide) \
        if all(wide) and len({box.factor for box in wide}) == 1 else None
    (descriptor, nbytes), = seen
    try:
        return _verify(BlockedLayout(shape, dtype, nbytes, descriptor, boxes, wide, shuffle=True), batch_hint, seen)
    except _ProbeError as err:
        return str(err)


def _random_bits(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A weight of random bit patterns (NaNs, infinities, subnormals, -0 included): the copies must move bits."""
    bits = {2: torch.int16, 4: torch.int32}[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(0)
    return torch.randint(info.min, info.max, shape, dtype=bits, generator=g).view(dtype)


def _verify(layout: BlockedLayout, batch_hint: int, seen: set[tuple[bytes, int]]) -> BlockedLayout | str:
    """`layout` if its copy of every full probe, along o and along i, and of random bits reproduces oneDNN's packed
    probe byte for byte, padding included, else what differs; the faster copies (wide words, channel_shuffle) stay
    enabled only where they match too, in every combination the weights may select at run time. Both maps agree on
    which element sits at each position when they agree on its o digits and on its i digits, so this checks the whole
    permutation."""
    shape, dtype = layout.shape, layout.dtype
    modes = [(False, False), (False, True)] + ([(True, False), (True, True)] if layout.wide is not None else [])
    failed: dict[tuple[bool, bool], str] = {}
    probes = [(axis, digit) for axis in (0, 1) for digit in range(_digits(shape[axis], dtype))] + [None]
    for probe in probes:  # one full-size probe at a time
        weight = _random_bits(shape, dtype) if probe is None else _probe(shape, dtype, *probe, sparse=False)
        packed = _pack(weight, batch_hint, seen)
        expected = buffer_of(packed).view(torch.uint8)  # an alias: read only while `packed` lives
        for wide, shuffle in modes:
            out = torch.zeros(layout.nbytes, dtype=torch.uint8)
            try:
                layout.write_flat(out.view(dtype), weight, wide=wide, shuffle=shuffle)
            except RuntimeError as err:
                failed.setdefault((wide, shuffle), f"the strided copy failed: {err}")
                continue
            if not torch.equal(out, expected):
                failed.setdefault((wide, shuffle), "the strided copy differs from oneDNN's reorder")
    if (False, False) in failed:
        return failed[False, False]
    shuffle = (False, True) not in failed
    wide = layout.wide is not None and (True, False) not in failed and not (shuffle and (True, True) in failed)
    return dataclasses.replace(layout, shuffle=shuffle, wide=layout.wide if wide else None)


@functools.cache
def layout_for(shape: tuple[int, int], dtype: torch.dtype, batch_hint: int) -> BlockedLayout | None:
    """The verified layout of oneDNN's packed copy of a (shape, dtype) weight, derived once per process; None where
    the in-place refresh cannot be trusted here (the reason is logged once)."""
    with torch.no_grad():
        found = _derive(shape, dtype, batch_hint)
    if isinstance(found, str):
        logger.info("packed linear %s %s: no in-place refresh (%s); weight updates repack it in full", shape,
                    str(dtype).removeprefix("torch."), found)
        return None
    logger.debug("packed linear %s %s: in-place refresh in %d strided copies", shape, dtype, len(found.boxes))
    return found
