"""PackedCopy: one packed copy of a weight (or of weights stacked along their output rows) and what it was packed
from, so PackedLinears can tell when it went stale and refresh it in its own buffer."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from rollout.engine.cpu import packed_layout
from rollout.engine.cpu.features import PACK_BATCH_HINT
from rollout.engine.cpu.mkl_packed import MklPackedWeight


def stacked_values(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The values a packed copy holds: one weight, or several stacked along their output rows."""
    return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])


def packed_dtype(packed: torch.Tensor | MklPackedWeight) -> torch.dtype:
    """The dtype a packed copy holds and computes in (fp32 copies of bf16 weights: fp32)."""
    return torch.float32 if isinstance(packed, MklPackedWeight) else packed.dtype


@dataclass
class PackedCopy:
    """The packed copy of one weight, or of several weights with one input stacked along their output rows (a
    layer's q, k and v projections: one matmul instead of three), and what it was packed from."""

    refs: tuple[weakref.ref, ...]  # the weights (the death of any drops this entry)
    data_ptrs: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    versions: tuple[int, ...]  # the weights' version counters when packed
    epoch: int  # PackedLinears._epoch when packed (clear() bumps it: writes through .data bump no version)
    packed: torch.Tensor | MklPackedWeight  # oneDNN's blocked copy, or MKL's (fp32 where cpu_features says so)
    # once refreshed in place: the verified layout of `packed` and its memory as a flat tensor (an alias of it)
    layout: packed_layout.BlockedLayout | None = None
    buffer: torch.Tensor | None = None

    def current(self, weights: tuple[torch.Tensor, ...], epoch: int) -> bool:
        return self.epoch == epoch and all(w._version == v for w, v in zip(weights, self.versions))

    def same_tensors(self, weights: tuple[torch.Tensor, ...]) -> bool:
        """Whether `weights` are the tensors packed, with the same storage, shapes and dtype (their values may
        differ)."""
        return len(weights) == len(self.refs) and all(
            ref() is w and ptr == w.data_ptr() and shape == tuple(w.shape) and w.dtype == self.dtype
            for ref, ptr, shape, w in zip(self.refs, self.data_ptrs, self.shapes, weights))

    def refresh_in_place(self, weights: tuple[torch.Tensor, ...]) -> bool:
        """Write the new values of `weights` into the packed copy's own buffer, as `_reorder_linear_weight` would lay
        them out (MKL's copies: repacked into their own buffer; fp32 copies of bf16 weights: widened as they are
        written); False, with nothing written, where no verified layout fits (the caller then repacks in full)."""
        if isinstance(self.packed, MklPackedWeight):
            with torch.no_grad():
                self.packed.repack(stacked_values(weights).float())
        elif self._has_layout():
            with torch.no_grad():
                self.layout.write_flat(self.buffer, stacked_values(weights))
        else:
            return False
        self.versions = tuple(w._version for w in weights)
        return True

    def load_in_place(self, weight: torch.Tensor, value: torch.Tensor) -> bool:
        """A weight update's copy of `value` into `weight`, with this packed copy rewritten from `value` in the same
        pass (the new values are read once, not once for the copy and again for the refresh; an fp32 copy of a bf16
        weight is widened in that pass); False, with nothing written, where it cannot: MKL's copy, a stack of several
        weights, no verified layout, or a `value` or weight that is not contiguous of the weight's shape and dtype (the
        caller then copies, and the next forward refreshes). Written through `.data`: the weight's version counter
        stays where it was."""
        if isinstance(self.packed, MklPackedWeight) or value.dtype != self.dtype \
                or not self.same_tensors((weight,)) \
                or tuple(value.shape) != self.shapes[0] or not value.is_contiguous() or not weight.is_contiguous():
            return False
        if not self._has_layout():
            return False
        with torch.no_grad():
            self.layout.write_both(self.buffer, weight.data, value.detach())
        self.versions = (weight._version,)
        return True

    def _has_layout(self) -> bool:
        """Whether the packed copy has a verified layout to write into in place (derived on first use)."""
        if self.buffer is None:
            shape = (sum(s[0] for s in self.shapes), *self.shapes[0][1:])
            layout = packed_layout.layout_for(shape, self.packed.dtype, PACK_BATCH_HINT) if len(shape) == 2 else None
            buffer = layout.buffer(self.packed) if layout is not None else None
            if buffer is None:
                return False
            self.layout, self.buffer = layout, buffer
        return True
