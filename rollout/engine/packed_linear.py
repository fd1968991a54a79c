"""oneDNN-prepacked copies of the model's fp32 linear weights, used for the engine's forward on CPU.

Why: for fp32 on CPU, `F.linear` runs MKL sgemm on the weight as stored. oneDNN's matmul on a weight reordered once
into its blocked layout is faster at every batch size the engine sees (about 1.3x at 256 rows and 2x at 16 rows on
a 2-core AVX-512 machine, see benchmarks/RESULTS.md), and it is plain fp32 arithmetic (no TF32/bf16 shortcuts).

How, without touching the model: a TorchFunctionMode active only around the engine's forward (and only on the thread
running it) sends every `F.linear` whose weight is a CPU fp32 matrix to `torch.ops.mkldnn._linear_pointwise` with
that weight's packed copy. Copies are keyed by the weight tensor and its version counter, so an optimizer step on a
shared module (in-place writes bump the counter) repacks it on the next forward; writes through `.data` do not bump
it, so every weight update through the engine (`set_weight_version`, which `update_weights` calls) drops all copies.
The cost is one extra copy of the linear weights in RAM.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 256  # oneDNN picks its blocked layout for this many rows; measured as good for 1..1024 rows


@functools.lru_cache(maxsize=1)
def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (and it agrees with F.linear on a small case)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w), atol=1e-5))
    except (RuntimeError, AttributeError) as err:
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", err)
        return False


class PackedLinears(TorchFunctionMode):
    """Routes `F.linear` on CPU fp32 weights to oneDNN with cached packed weights while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        # id(weight) -> (weakref to the weight, data_ptr, version, packed copy)
        self._packs: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packs.get(id(weight))
        if entry is not None and entry[0]() is weight and entry[1] == weight.data_ptr() \
                and entry[2] == weight._version:
            return entry[3]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        key, packs = id(weight), self._packs
        ref = weakref.ref(weight, lambda _: packs.pop(key, None))  # a freed weight frees its packed copy
        packs[key] = (ref, weight.data_ptr(), weight._version, packed)
        return packed

    def clear(self) -> None:
        """Drop every packed copy (the memory returns; the next forward repacks what it uses)."""
        self._packs.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.dtype == torch.float32 and x.dtype == torch.float32 and weight.device.type == "cpu" \
                    and weight.dim() == 2 and weight.layout == torch.strided:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed(weight), bias, "none", [], "")
        return func(*args, **kwargs)
