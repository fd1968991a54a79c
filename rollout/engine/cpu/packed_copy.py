"""PackedCopy: one packed copy of a weight (or of weights stacked along their output rows) and what it was packed
from, so PackedLinears can tell when it went stale and refresh it in its own buffer."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from rollout.engine.cpu import packed_layout
from rollout.engine.cpu.features import PACK_BATCH_HINT
from rollout.engine.cpu.mkl_packed import MklPackedWeight
from rollout.engine.cpu.panel_packed import PanelWeight

# Copies in a layout of our own choosing (MKL's, or panels): each holds its buffer, computes with `linear`, and is
# rewritten with `repack`; oneDNN's copies are plain tensors, written along a layout derived by probing.
OWN_LAYOUTS = (MklPackedWeight, PanelWeight)
Packed = torch.Tensor | MklPackedWeight | PanelWeight  # a packed copy; `.dtype` is the dtype it computes in


def stacked_values(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The values a packed copy holds: one weight, or several stacked along their output rows."""
    return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])


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
    packed: Packed  # oneDNN's blocked copy, MKL's (fp32 where cpu_features says so) or bf16 panels
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
        them out (MKL's copies and panels: repacked into their own buffer; fp32 copies of bf16 weights: widened as
        they are written); False, with nothing written, where no verified layout fits (the caller then repacks in
        full)."""
        if isinstance(self.packed, OWN_LAYOUTS):
            with torch.no_grad():
                self.packed.repack(stacked_values(weights).to(self.packed.dtype))  # MKL's fp32 copy of bf16: widened
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
        weight is widened in that pass); False, with nothing written, where it cannot: `weight` is not one of those
        packed, MKL's copy, oneDNN's copy of a stack or with no verified layout, or a `value` or weight that is not
        contiguous of the weight's shape and dtype (the caller then copies, and the next forward refreshes). Panels:
        the weight and its rows of the panels written in one pass (a stack's other members untouched). Written through
        `.data`: the weight's version counter stays where it was."""
        member = self._member(weight)
        if member is None or isinstance(self.packed, MklPackedWeight) or value.dtype != self.dtype \
                or tuple(value.shape) != self.shapes[member] or not value.is_contiguous() or not weight.is_contiguous():
            return False
        if isinstance(self.packed, PanelWeight):
            with torch.no_grad():
                self.packed.repack(value.detach(), sum(shape[0] for shape in self.shapes[:member]), plain=weight.data)
        elif len(self.refs) > 1 or not self._has_layout():
            return False
        else:
            with torch.no_grad():
                self.layout.write_both(self.buffer, weight.data, value.detach())
        self.versions = (*self.versions[:member], weight._version, *self.versions[member + 1:])
        return True

    def _member(self, weight: torch.Tensor) -> int | None:
        """Where `weight` is among the weights packed (the same tensor, storage, shape and dtype), else None."""
        for i, (ref, ptr, shape) in enumerate(zip(self.refs, self.data_ptrs, self.shapes)):
            if ref() is weight:
                same = ptr == weight.data_ptr() and shape == tuple(weight.shape) and weight.dtype == self.dtype
                return i if same else None
        return None

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
