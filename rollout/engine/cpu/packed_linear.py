"""Prepacked copies of the model's fp32/bf16 linear weights (oneDNN's, or for fp32 MKL's where those measure faster),
used for the engine's forward on CPU.

Why: for fp32 on CPU, `F.linear` runs MKL sgemm on the weight as stored; oneDNN's matmul on a weight reordered once
into its blocked layout is faster at the batch sizes that carry the work (benchmarks/RESULTS.md, "Linears"), in plain
fp32 arithmetic, and MKL's own packed sgemm (mkl_packed.py) faster still where timed so. At a few rows the weights'
streaming from memory decides: F.linear (MKL's sgemv) or the C kernel csrc/small_matmul.c serve them where timed
faster (features.py, SMALL_MATMUL_ROWS). Stacked copies (`stacked_for`) serve the compiled forward's linears of one
input as one matmul, and with MKL's copies a gated MLP's gate and up projections. bf16 packed and bucketed
(row_buckets.py) is a little faster than unpacked. Where the CPU has no bf16 dot products oneDNN emulates bf16, and
bf16 weights get, where timed faster, fp32 copies (ENV_BF16_VIA_FP32: `run` widens the input and rounds each output
back to bf16) or panels of their bf16 values for csrc/panel_matmul.c (panel_packed.py: no fp32 copy in RAM, stacked
like MKL's); steps of a few rows run small_matmul.c on the bf16 weights, where timed faster.

How, without changing the model: around the engine's forward only, each plain `nn.Linear` gets an instance-level
`forward` that uses the packed copy, removed again right after; the override also checks that it runs on the thread
of the engine's forward, so a trainer running the same module concurrently keeps `F.linear` (and its autograd). A
recognized SiLU-gated MLP (silu_gate.py) gets one too, running its gate and up projections as one fused pair of
packed matmuls. (A TorchFunctionMode would do the same without touching instances, but taxes every op.) Copies are
keyed by the weight tensor and its version counter, so an optimizer step on a shared module (in-place writes bump the
counter) refreshes it on the next forward; writes through `.data` do not, so every weight update through the engine
(`set_weight_version`, which `update_weights` calls) marks all copies stale. A stale copy is rewritten in its own
buffer (oneDNN's along the layout packed_layout.py derived and verified for its shape and dtype: a fraction of a full
repack, benchmarks/RESULTS.md, "RL layer"), else repacked in full. A freed weight frees its copy, and a weight update
drops the copies of weights no longer in the model. The cost is one extra copy of the linear weights in RAM.

Which dtypes: decided once per process by cpu/features.py, which packs a small weight of each dtype and checks the
result. oneDNN packs bf16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT. An explicit `prepack_weights=True`
for a model whose dtype cannot be served here is a ValueError (features.require_packing), not a silent no-op.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Collection, Iterator

import torch
import torch.nn.functional as F

from rollout.engine.cpu import kernel as cpu_kernel
from rollout.engine.cpu import mkl_packed
from rollout.engine.cpu.features import PACK_BATCH_HINT, PACKED_DTYPES, cpu_features, linear_dtypes, unpacked_max_rows
from rollout.engine.cpu.heap import release_free_memory
from rollout.engine.cpu.matmuls import small_matmul
from rollout.engine.cpu.mkl_packed import MklPackedWeight
from rollout.engine.cpu.packed_copy import OWN_LAYOUTS, Packed, PackedCopy, stacked_values
from rollout.engine.cpu.panel_packed import PanelWeight
from rollout.engine.cpu.row_buckets import PaddedRows
from rollout.engine.cpu.silu_gate import is_silu_gated_mlp

# A widened temporary above this many bytes comes from its own mmap (glibc's largest mmap threshold), not the heap
LARGE_TEMPORARY = 32 << 20


def _linear_pointwise(*args):
    """oneDNN's packed matmul; looked up on first use (a torch build without oneDNN never calls it)."""
    global _LINEAR_POINTWISE
    _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
    return _LINEAR_POINTWISE(*args)


_LINEAR_POINTWISE = _linear_pointwise  # the op itself after the first call: one attribute lookup less per matmul


def _linear_binary(*args):
    """oneDNN's packed matmul with a binary post-op (`mul`: the result times `other`), looked up on first use."""
    global _LINEAR_BINARY
    _LINEAR_BINARY = torch.ops.mkldnn._linear_pointwise.binary
    return _LINEAR_BINARY(*args)


_LINEAR_BINARY = _linear_binary


def packing_available(dtype: torch.dtype | None = None) -> bool:
    """Whether oneDNN's packed linear works here for `dtype` (None: for any of PACKED_DTYPES), as probed once per
    process by cpu_features()."""
    packed = cpu_features().packed_dtypes
    return bool(packed) if dtype is None else dtype in packed


class PackedLinears:
    """Context manager around the engine's forward: plain fp32/bf16 CPU `nn.Linear`s of `model` run on packed
    weights."""

    def __init__(self, model: torch.nn.Module, dtypes: frozenset[torch.dtype] | None = None,
                 mkl: bool | None = None, bf16_via_fp32: bool | None = None) -> None:
        self.model = model
        features = cpu_features()
        # bf16 on fp32 copies (None: as the route says for a model with bf16 linears) or panels, and the small steps
        self.bf16_unpacked_max_rows, self.bf16_kernel_max_rows, panels = 0, 0, False
        if bf16_via_fp32 is None and torch.bfloat16 in linear_dtypes(model) & (dtypes or {torch.bfloat16}):
            route, built = features.bf16_route, cpu_kernel.load_kernel() is not None
            bf16_via_fp32, self.bf16_unpacked_max_rows = route.via_fp32, route.unpacked_max_rows
            self.bf16_kernel_max_rows, panels = (route.kernel_max_rows, route.panels) if built else (0, False)
        self.via_fp32 = frozenset({torch.bfloat16}) if bf16_via_fp32 and features.packs(torch.float32) else frozenset()
        self.panels = frozenset({torch.bfloat16}) if panels else frozenset()
        # the weight dtypes packed; the others keep F.linear (default: those this CPU can pack, see cpu/features.py)
        self.dtypes = frozenset(PACKED_DTYPES) & (features.packed_dtypes | self.via_fp32 | self.panels) & (
            frozenset(PACKED_DTYPES) if dtypes is None else dtypes)
        self._packs: dict[int, PackedCopy] = {}  # by id(weight)
        # stacked copies (`stacked_for`) by the ids of their weights; a weight in one is not packed on its own
        self._stacks: dict[tuple[int, ...], PackedCopy] = {}
        self._epoch = 0
        self._overrides: list[tuple[torch.nn.Linear, object]] | None = None
        self._active = threading.local()
        self._pads = PaddedRows()  # oneDNN's inputs padded to their row bucket
        self._widened = False  # fp32 copies were packed from widened temporaries since the last release
        self._table: dict[int, Packed] = {}  # per forward: id(weight) -> packed copy
        self._checked: tuple[int, list] | None = None  # what the table was built from: epoch, (module, weight, version)
        # Set by use_mkl: `mkl` (fp32 packed by MKL: mkl_packed.py), `gate_dtypes` (gated MLPs whose gate and up run as
        # one op), `unpacked_max_rows` (fp32 inputs of at most this many rows on F.linear), `small_matmul` and
        # `small_rows` (fp32 inputs of those rows on the small-rows kernel; not with MKL's copies, faster there).
        self.use_mkl(cpu_features().mkl_packed if mkl is None else mkl)

    def _packed(self, weight: torch.Tensor) -> Packed:
        return self._pack_of((weight,), self._packs, id(weight))

    def _pack_of(self, weights: tuple[torch.Tensor, ...], store: dict, key) -> Packed:
        """The current packed copy of `weights` (stacked when several) kept in `store[key]`: reused, refreshed in
        place, or packed anew."""
        entry = store.get(key)
        if entry is not None and entry.current(weights, self._epoch) and entry.same_tensors(weights):
            return entry.packed
        if entry is not None and entry.same_tensors(weights) and entry.refresh_in_place(weights):
            entry.epoch = self._epoch
            return entry.packed
        if weights[0].dtype in self.via_fp32:  # packed from a widened temporary
            if sum(w.numel() for w in weights) * 4 > LARGE_TEMPORARY:
                self._release_widened()  # the smaller ones' memory out before this one (a lower peak)
            self._widened = True
        packed = self._new_pack(stacked_values(weights))
        refs = tuple(weakref.ref(w, lambda _: store.pop(key, None)) for w in weights)  # a freed weight frees it
        store[key] = PackedCopy(refs, tuple(w.data_ptr() for w in weights), tuple(tuple(w.shape) for w in weights),
                           weights[0].dtype, tuple(w._version for w in weights), self._epoch, packed)
        return packed

    def use_mkl(self, enabled: bool) -> None:
        """Pack fp32 weights with MKL (where it works) or oneDNN from the next forward on, with the small-step rules
        of that choice; the current copies are dropped (benchmarks compare the two on one engine)."""
        if enabled and not mkl_packed.available():
            raise ValueError(f"MKL's packed sgemm is unavailable here: {mkl_packed.unavailable_reason()}")
        features = cpu_features()
        self.mkl = enabled and torch.float32 in self.dtypes
        self.gate_dtypes = features.gate_dtypes_for(self.mkl) | self.panels
        self.small_matmul = (features.small_matmul_kernel and torch.float32 in self.dtypes and not self.mkl
                             and cpu_kernel.load_kernel() is not None)  # the library may have gone since detection
        self.small_rows = features.small_matmul_rows
        self.unpacked_max_rows = unpacked_max_rows(features.linear_timings, self.mkl)
        if self.small_matmul:  # F.linear's window ends where the small-rows kernel's begins
            self.unpacked_max_rows = min(self.unpacked_max_rows, self.small_rows[0] - 1)
        self._packs.clear()
        self._stacks.clear()
        self._overrides = self._checked = None

    def _new_pack(self, values: torch.Tensor) -> Packed:
        return self._pack_values(values.float() if values.dtype in self.via_fp32 else values)

    def _release_widened(self) -> None:
        """After a pass that packed fp32 copies from widened temporaries, and before a large one: their
        memory back to the OS (heap.py); not after each (every temporary would then fault its pages in anew)."""
        if self._widened:
            self._widened = False
            release_free_memory()

    def _pack_values(self, values: torch.Tensor) -> Packed:
        if values.dtype in self.panels:
            return PanelWeight(values)
        if self.mkl and values.dtype == torch.float32:
            return MklPackedWeight(values)
        return torch.ops.mkldnn._reorder_linear_weight(values, PACK_BATCH_HINT)

    def load(self, weight: torch.Tensor, value: torch.Tensor) -> bool:
        """A weight update's copy of `value` into `weight`, writing every packed copy that holds the weight (its own,
        and each stack with it) from `value` in the same pass where it can (PackedCopy.load_in_place); False where it
        has none or one of them declined (the caller then copies; the next forward refreshes the copies it did not
        write). Pass the ids of the weights it loaded to the `clear` that follows, which keeps their copies (a
        stack's once all its members are among them)."""
        entries = [entry for key, entry in self._stacks.items() if id(weight) in key]
        entries += [self._packs[id(weight)]] if id(weight) in self._packs else []
        return bool(entries) and all([entry.load_in_place(weight, value) for entry in entries])

    def clear(self, fresh: Collection[int] = ()) -> None:
        """New weights are in place (writes through `.data` bump no version counter): mark every packed copy stale
        (the next forward refreshes those it uses, in place) but those of the weights in `fresh` (ids of weights
        `load` wrote, with their copies), drop the copies of weights no longer in the model, and forget the module
        list."""
        self._epoch += 1
        fresh = set(fresh)
        stacks = [entry for key, entry in self._stacks.items() if fresh >= set(key)]
        for entry in [self._packs.get(key) for key in fresh] + stacks:
            if entry is not None:
                entry.epoch = self._epoch
        self._pads.clear()
        self._overrides = None
        self._checked = None
        live = {id(module.weight) for module, _ in self._linear_targets()}
        for key in [key for key in self._packs if key not in live]:
            del self._packs[key]
        for key in [key for key in self._stacks if not live.issuperset(key)]:
            del self._stacks[key]

    def prepare(self) -> None:
        """Pack (or refresh) now every weight the next forward would pack, so that forward pays nothing for it."""
        with torch.no_grad():
            stacked = self._stacked_ids()
            for module, _ in self._linear_targets():
                weight = module.weight
                if self._packable(weight) and id(weight) not in stacked:
                    self._packed(weight)
            for key, entry in list(self._stacks.items()):
                weights = tuple(ref() for ref in entry.refs)
                if all(w is not None for w in weights):
                    self._pack_of(weights, self._stacks, key)
        self._release_widened()

    def _stacked_ids(self) -> set[int]:
        return {i for key in self._stacks for i in key}

    def _packable(self, weight: torch.Tensor) -> bool:
        return weight.dtype in self.dtypes and weight.device.type == "cpu" and weight.layout == torch.strided

    def run(self, x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T + bias` on the packed copy of W (from `packed_for`); a bf16 `x` on an fp32 copy is widened, and
        the result rounded back to bf16 (as a bf16 matmul rounds its fp32 sums)."""
        if self.via_fp32 and x.dtype != packed.dtype:  # (an fp32-only engine skips the check)
            wide = self.run(x.float(), packed, None if bias is None else bias.float())
            return wide.to(x.dtype)
        if isinstance(packed, OWN_LAYOUTS):
            return packed.linear(x, bias)  # any row count: no padding, no chunks
        return self._pads.run(x, lambda rows: _LINEAR_POINTWISE(rows, packed, bias, "none", [], ""))

    def run_silu_gate(self, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor] | Packed,
                      gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None) -> torch.Tensor:
        """`silu(x @ Wg.T + bg) * (x @ Wu.T + bu)` on the packed copies from `silu_gate_for`. oneDNN's pair: the SiLU
        is a post-op of the gate's matmul and the product a post-op of the up projection's, so the gated MLP's two
        `[rows, intermediate]` activations are never read back by separate passes (benchmarks/RESULTS.md,
        "Prefill"). MKL's copy or panels of the two weights stacked: one matmul, then the SiLU and product (for bf16
        rounded where eager rounds them)."""
        if isinstance(packed, OWN_LAYOUTS):
            bias = None if gate_bias is None and up_bias is None else torch.cat(
                [b if b is not None else x.new_zeros(packed.out_features // 2) for b in (gate_bias, up_bias)])
            gate, up = packed.linear(x, bias).chunk(2, dim=-1)
            return F.silu(gate).mul_(up)
        gate_packed, up_packed = packed

        def compute(rows: torch.Tensor) -> torch.Tensor:
            gated = _LINEAR_POINTWISE(rows, gate_packed, gate_bias, "swish", [], "")
            return _LINEAR_BINARY(rows, gated, up_packed, up_bias, "mul")
        return self._pads.run(x, compute)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` through the packed copy of `weight` (packed or refreshed now if needed)."""
        return self.run(x, self._packed(weight), bias)

    def unpacked_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` where no packed copy serves it (`packed_for` gave None); inside a forward on
        this thread, inputs of the rows the small-rows kernel serves in their dtype run it on the weight as stored."""
        if self._small_matmul_serves(x, weight, bias):
            return small_matmul(x, weight, bias)
        return F.linear(x, weight, bias)

    def _kernel_rows(self, dtype: torch.dtype) -> tuple[int, int] | None:
        """The rows (low, high) of inputs of `dtype` the small-rows kernel serves, None for none."""
        if dtype == torch.float32:
            return self.small_rows if self.small_matmul else None
        return (1, self.bf16_kernel_max_rows) if dtype == torch.bfloat16 and self.bf16_kernel_max_rows else None

    def _small_matmul_serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        rows = self._kernel_rows(x.dtype)
        if rows is None or weight.dtype != x.dtype or not x.numel():
            return False
        if getattr(self._active, "table", None) is None or weight.device.type != "cpu" or not weight.is_contiguous():
            return False  # not this thread's forward (a trainer's keeps F.linear and its autograd), or a view
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return False
        return rows[0] <= x.numel() // x.shape[-1] <= rows[1]

    def packed_for(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Inside a forward on this thread (`with linears:` or `serving()`): the packed copy that serves
        `linear(x, weight)`, or None where F.linear must (another thread, an input not of the weight's dtype, an
        empty input, a weight not packed: not a strided CPU weight of a packed dtype) or is faster (an fp32 input of
        at most `unpacked_max_rows` rows). The weights are checked once per forward rather than per call, in
        `_begin`."""
        table = getattr(self._active, "table", None)
        if table is None:
            return None
        packed = table.get(id(weight))
        return packed if packed is not None and self._packed_input(x, weight.dtype) else None

    def _packed_input(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether packed copies of weights of `dtype` serve input `x`: not for another dtype or an empty input, nor
        for inputs of the rows the small-rows kernel serves in their dtype, nor for fp32 inputs of at most
        `unpacked_max_rows` rows, nor for bf16 inputs on fp32 copies of at most `bf16_unpacked_max_rows` rows
        (`unpacked_linear` is faster there)."""
        if x.dtype != dtype or not x.numel():
            return False
        rows = x.numel() // x.shape[-1]
        kernel = self._kernel_rows(x.dtype)
        if kernel is not None and kernel[0] <= rows <= kernel[1]:
            return False
        if x.dtype in self.via_fp32 | self.panels:
            return rows > self.bf16_unpacked_max_rows
        return x.dtype != torch.float32 or rows > self.unpacked_max_rows

    def stacked_for(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> Packed | None:
        """Inside a forward on this thread: one packed copy of `weights` stacked along their output rows, so that
        their linears of the one input `x` run as one matmul (`run`, then split the columns); None where they must
        run apart (the conditions of `packed_for`, and bf16 on fp32 copies: oneDNN blocks a wider fp32 matmul's sums
        in another order, and compiled steps would then round to other bf16 values than eager ones). The first call
        packs the stack and drops the members' own packed copies: a member called alone later runs unpacked
        (`unpacked_linear`)."""
        stacked = getattr(self._active, "stacked", None)
        if stacked is None or x.dtype in self.via_fp32 or not self._packed_input(x, weights[0].dtype):
            return None
        key = tuple(map(id, weights))
        packed = stacked.get(key)
        if packed is None:
            if not all(self._packable(w) and w.dtype == x.dtype for w in weights):
                return None
            fresh = key not in self._stacks
            with torch.no_grad():
                packed = stacked[key] = self._pack_of(weights, self._stacks, key)
            if fresh:
                for w in weights:
                    self._packs.pop(id(w), None)
                self._checked = None  # the next forward's table leaves the members out
        return packed

    def silu_gate_for(self, x: torch.Tensor, gate_weight: torch.Tensor,
                      up_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | Packed | None:
        """The packed copies that serve `run_silu_gate(x, ...)`: MKL's copy or panels of both weights stacked
        (`stacked_for`), or oneDNN's two; None where the two linears must run apart: either is not packed here (see
        `packed_for`), or this CPU's oneDNN failed the fused probe for the dtype (cpu_features; fp32 only: bf16 keeps
        eager's rounding of the gate before the SiLU)."""
        if x.dtype not in self.gate_dtypes:
            return None
        if (self.mkl and x.dtype == torch.float32) or x.dtype in self.panels:
            if gate_weight.shape != up_weight.shape:
                return None
            return self.stacked_for(x, (gate_weight, up_weight))
        gate, up = self.packed_for(x, gate_weight), self.packed_for(x, up_weight)
        return None if gate is None or up is None else (gate, up)

    def _begin(self) -> None:
        """Make this thread's forward use the packed copies: every target weight checked (same tensor, current
        version and epoch; a stale copy refreshed) once here, so that each call is one dict lookup."""
        if self._checked is None or self._checked[0] != self._epoch or any(
                module._parameters.get("weight") is not weight or weight._version != version
                for module, weight, version in self._checked[1]):
            self._build_table()
        self._active.table = self._table
        self._active.stacked = {}  # stacks checked in this forward

    def _build_table(self) -> None:
        with torch.no_grad():
            checked, table, stacked = [], {}, self._stacked_ids()
            for module, _ in self._linear_targets():
                weight = module._parameters.get("weight")
                if weight is not None and self._packable(weight):
                    if id(weight) not in stacked:
                        table[id(weight)] = self._packed(weight)
                    checked.append((module, weight, weight._version))
        self._table, self._checked = table, (self._epoch, checked)
        self._release_widened()

    def _end(self) -> None:
        self._active.table = self._active.stacked = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[PackedLinears]:
        """Serve `packed_for` on this thread (the compiled forward's op) without the modules' forward overrides."""
        self._begin()
        try:
            yield self
        finally:
            self._end()

    def _override(self, module: torch.nn.Linear):
        this = weakref.proxy(self)  # no reference cycle: a dropped engine frees its packed copies at once

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            packed = this.packed_for(x, weight)
            if packed is None:
                return this.unpacked_linear(x, weight, module.bias)
            return this.run(x, packed, module.bias)
        return forward

    def _silu_gate_override(self, module: torch.nn.Module):
        """The forward of a recognized SiLU-gated MLP (silu_gate.py): its gate and up projections as one fused
        `run_silu_gate`, then its down projection (packed through its own override); its own forward otherwise."""
        this = weakref.proxy(self)
        own = type(module).forward

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            gate, up = module.gate_proj, module.up_proj
            packed = None if args or kwargs else this.silu_gate_for(x, gate.weight, up.weight)
            if packed is None:
                return own(module, x, *args, **kwargs)
            return module.down_proj(this.run_silu_gate(x, packed, gate.bias, up.bias))
        return forward

    def _targets(self) -> list[tuple[torch.nn.Module, object]]:
        """(module, the forward it gets inside the engine's forward): every plain nn.Linear (a subclass with its own
        forward is left alone), then every recognized SiLU-gated MLP where this CPU fuses the gate."""
        if self._overrides is None:
            modules = list(self.model.modules())
            self._overrides = [(m, self._override(m)) for m in modules
                               if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward]
            if self.gate_dtypes & self.dtypes:
                self._overrides += [(m, self._silu_gate_override(m)) for m in modules if is_silu_gated_mlp(m)]
        return self._overrides

    def _linear_targets(self) -> list[tuple[torch.nn.Linear, object]]:
        return [(module, forward) for module, forward in self._targets() if isinstance(module, torch.nn.Linear)]

    def __enter__(self) -> PackedLinears:
        self._begin()
        for module, forward in self._targets():
            module.__dict__["forward"] = forward  # instance attribute: nn.Module.__call__ picks it up
        return self

    def __exit__(self, *exc) -> None:
        for module, _ in self._targets():
            module.__dict__.pop("forward", None)
        self._end()
