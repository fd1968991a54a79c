"""What this CPU and this torch build can run fast, decided once per process and logged once as one line.

Why: the engine's CPU fast paths depend on the instruction set. oneDNN packs bf16 linear weights only with AVX-512
(BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (many AMD EPYC/Ryzen, older Intel) `_reorder_linear_weight`
raises for bf16 while fp32 packs fine. So each dtype is probed by actually packing a small weight and comparing the
packed matmul with `F.linear`: the probe, not the CPU flags, decides, and a dtype that fails keeps `F.linear` (same
tokens, just unpacked). torch's own bf16 device check (`torch.ops.mkldnn._is_mkldnn_bf16_supported`) is recorded as
an extra signal only. MKL's packed sgemm (mkl_packed.py) is probed the same way: a packed weight's products compared
with `F.linear`. Which of the fp32 backends that pass serves which steps is then timed (linear_timing.py).

ISA flags come from torch's CPUID reader (`torch.cpu.get_capabilities`), which sees the CPU the code actually runs on,
also under an emulator (qemu-user shows the host's /proc/cpuinfo); /proc/cpuinfo is only the fallback for torch
builds without it. The C attention kernel's build (its -march, the vector ISA compiled in, OpenMP) is described by
`rollout.engine.cpu.kernel.kernel_build`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rollout.engine.cpu import kernel as cpu_kernel
from rollout.engine.cpu import mkl_packed
from rollout.engine.cpu.isa import ISA_FLAGS, KernelBuild, isa_flags
from rollout.engine.cpu.kernel import kernel_build
from rollout.engine.cpu.linear_timing import Bf16Timings, LinearTimings, small_kernel_rows, time_bf16, time_linears
from rollout.engine.cpu.matmuls import small_matmul
from rollout.engine.cpu.panel_packed import PanelWeight

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)  # the weight dtypes probed, whose linears may run on packed copies
# oneDNN picks its blocked layout for this many rows; measured as good for 1..1024 rows (packed_linear packs with it)
PACK_BATCH_HINT = 256
# The fused SiLU gate (packed_linear.run_silu_gate) is fp32 only: in bf16 eager rounds the gate to bf16 before the
# SiLU and the fused post-op would not, so a bf16 model would sample from slightly different logits than eager.
SILU_GATE_DTYPES = (torch.float32,)
# Which fp32 backend serves which steps (MKL's or oneDNN's packed copies; F.linear on the weights as stored for steps
# of a few rows) is timed on this CPU (linear_timing.py), not read off its vendor name. ROLLOUT_UNPACKED_MAX_ROWS
# overrides the small-step rule (0: the packed copies at every row count).
ENV_UNPACKED_MAX_ROWS = "ROLLOUT_UNPACKED_MAX_ROWS"
# fp32 linears of steps of a few rows run the C kernel csrc/small_matmul.c on the weights as stored, where it is built
# (PackedLinears.unpacked_linear): at a few rows a step's linears are bound by streaming the weights from memory, which
# the kernel does faster than oneDNN or MKL. Built for AVX-512 it serves SMALL_MATMUL_ROWS by rule, and 1-2 rows where
# it is timed faster there (linear_timing.py: on an AMD EPYC it was, on an Intel Ice Lake MKL's sgemv was as fast).
# Built for another ISA (AVX2) it serves only the rows where it is timed faster: an AVX2 build lost to the packed copies
# at 8 rows on an AVX-512 EPYC, and won at 1-8 rows on an AVX2 one. Where MKL's packed sgemm serves (faster still at
# 2-8 rows), the kernel is not used. The figures: benchmarks/RESULTS.md, "Small steps".
SMALL_MATMUL_ROWS = (3, 8)
SMALL_MATMUL_ISAS = ("avx512f",)
# bf16 linears compute on fp32 copies of the bf16 weights (the input widened, each output rounded back to bf16) where
# those are timed faster than bf16 arithmetic: on CPUs without bf16 dot products (no AVX512_BF16, no AMX) oneDNN
# emulates bf16 (linear_timing.py). The copies cost twice the bf16 weights' RAM instead of once. 0: never, 1: wherever
# fp32 weights can be packed.
ENV_BF16_VIA_FP32 = "ROLLOUT_BF16_VIA_FP32"
# Where the C library is built, bf16 linears may instead run on panels of their bf16 weights (panel_packed.py), where
# those are timed faster than every other path at batch rows and not much slower at a prefill chunk's
# (linear_timing.PREFILL_SLACK): no second copy of the weights in fp32. 0: never, 1: wherever the library is built
# (before ROLLOUT_BF16_VIA_FP32); unset: timed with the other paths, where ROLLOUT_BF16_VIA_FP32 is unset too and fp32
# packs (the probe's copies are oneDNN's).
ENV_BF16_PANELS = "ROLLOUT_BF16_PANELS"


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU facts and probe results that decide which fast paths the engine uses on this machine."""

    machine: str  # platform.machine(), e.g. x86_64
    cpu_name: str
    isa: frozenset[str]  # the ISA_FLAGS this CPU has
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): the vector ISA of torch's own CPU kernels
    onednn: bool  # torch.backends.mkldnn.is_available()
    onednn_bf16_device: bool | None  # torch's bf16 device check; None where this torch has none
    packed_dtypes: frozenset[torch.dtype]  # dtypes whose packed-linear probe passed
    packing_errors: tuple[tuple[str, str], ...] = ()  # (dtype name, why its probe failed)
    silu_gate_dtypes: frozenset[torch.dtype] = frozenset()  # dtypes whose oneDNN fused SiLU-gate probe passed
    unpacked_max_rows: int = 0  # fp32 linears of steps with at most this many rows use F.linear (MKL)
    linear_timings: LinearTimings | None = None  # what decided the fp32 choices (None: fp32 is not packed)
    # the rows (low, high) whose fp32 linears the small-rows kernel runs where it is built (None: none)
    small_matmul_rows: tuple[int, int] | None = None
    kernel: KernelBuild = field(default_factory=lambda: KernelBuild(False, reason="not probed"))
    # fp32 packed copies are MKL's (mkl_packed.py) rather than oneDNN's; else why not
    mkl_packed: bool = False
    mkl_packed_reason: str = "not probed"

    @property
    def small_matmul_kernel(self) -> bool:
        """Whether the small-rows C kernel is built here and serves some row counts (`small_matmul_rows`)."""
        return self.kernel.available and self.small_matmul_rows is not None

    @property
    def small_matmul(self) -> bool:
        """Whether fp32 linears of `small_matmul_rows` rows run the small-rows C kernel here (not where MKL packs)."""
        return self.small_matmul_kernel and not self.mkl_packed

    @property
    def gate_dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes whose SiLU-gated MLPs run gate and up as one op here (see gate_dtypes_for)."""
        return self.gate_dtypes_for(self.mkl_packed)

    def gate_dtypes_for(self, mkl: bool) -> frozenset[torch.dtype]:
        """The dtypes whose SiLU-gated MLPs run gate and up as one op: oneDNN's fused pair, or with MKL's copies
        (`mkl`: fp32) one matmul over the two weights stacked (packed_linear.run_silu_gate)."""
        return self.silu_gate_dtypes | (frozenset({torch.float32}) if mkl else frozenset())

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether linear weights of `dtype` can be oneDNN-packed here."""
        return dtype in self.packed_dtypes

    @property
    def bf16_route(self) -> Bf16Route:
        """How bf16 linears run here: timed on first use (only a bf16 model pays for it), then cached."""
        return bf16_route(self.packed_dtypes)

    @property
    def bf16_via_fp32(self) -> bool:
        """Whether bf16 linears run on fp32 copies of their weights (see ENV_BF16_VIA_FP32)."""
        return self.bf16_route.via_fp32

    @property
    def served_dtypes(self) -> frozenset[torch.dtype]:
        """The weight dtypes whose linears run on packed copies here: oneDNN's own, or bf16 weights on fp32 copies or
        panels."""
        route = self.bf16_route
        return self.packed_dtypes | (frozenset({torch.bfloat16}) if route.via_fp32 or route.panels else frozenset())

    def packing_error(self, dtype: torch.dtype) -> str:
        """Why `dtype` cannot be packed here ("" when it can)."""
        return dict(self.packing_errors).get(_name(dtype), "")

    def describe(self) -> str:
        """One line: the CPU, torch's ISA level, packed linears per dtype (with why not), the attention kernel."""
        flags = " ".join(f for f in ISA_FLAGS if f in self.isa) or "none of interest"
        packing = ", ".join(_packing_word(self, dtype) for dtype in PACKED_DTYPES)
        if not self.onednn:
            packing = "unavailable (torch built without oneDNN)"
        fused = ", ".join(_name(d) for d in SILU_GATE_DTYPES if d in self.gate_dtypes) or "no"
        f_linear_rows = self.unpacked_max_rows
        if self.small_matmul:
            low, high = self.small_matmul_rows
            f_linear_rows = min(f_linear_rows, low - 1)
        parts = [f"F.linear (MKL) up to {f_linear_rows} rows"] if f_linear_rows else []
        if self.small_matmul:
            parts.append(f"the small-rows kernel at {low}-{high} rows")
        small = ", ".join([*parts, "packed otherwise"]) if parts else "packed"
        by_mkl = "yes" if self.mkl_packed else f"no ({self.mkl_packed_reason})"
        return (f"{self.machine} {self.cpu_name or 'CPU'} [{flags}]; torch CPU capability {self.torch_capability}; "
                f"oneDNN packed linear: {packing}; fp32 packed copies by MKL: {by_mkl}; fused SiLU gate: {fused}; "
                f"fp32 linears of small steps: {small}; attention kernel: {self.kernel.describe()}"
                + (f"; {self.linear_timings.describe()}" if self.linear_timings is not None else ""))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _packing_word(features: CpuFeatures, dtype: torch.dtype) -> str:
    if features.packs(dtype):
        return f"{_name(dtype)} yes"
    word = f"{_name(dtype)} no ({features.packing_error(dtype)})"
    if dtype == torch.bfloat16 and features.onednn_bf16_device is False:
        word += " [torch's bf16 device check agrees]"
    return word


def _cpu_name() -> str:
    try:
        return str(torch.cpu.get_capabilities().get("cpu_name", ""))
    except (AttributeError, RuntimeError):
        return platform.processor()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


def probe_packed_linear(dtype: torch.dtype) -> str:
    """Pack a small weight of `dtype` with oneDNN and run it; returns "" when the result equals F.linear exactly,
    else why not. Small integer values keep every product and sum exact, so any difference is a real fault."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-2, 3, (8, 16), generator=g).to(dtype)
    x = torch.randint(-2, 3, (3, 16), generator=g).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError) as err:
        return _first_line(err)
    if out.dtype != dtype or not torch.equal(out, F.linear(x, w)):
        return "the packed result differs from F.linear"
    return ""


def probe_silu_gate(dtype: torch.dtype) -> str:
    """Run the fused SiLU gate (the gate's matmul with a SiLU post-op, the up projection's with a `mul` post-op) on
    small packed weights; returns "" when it matches silu(F.linear) * F.linear to fp32 rounding, else why not."""
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(24, 16, generator=g).to(dtype) for _ in range(2))
    x = torch.randn(5, 16, generator=g).to(dtype)
    try:
        gated = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(gate, PACK_BATCH_HINT), None, "swish", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(
            x, gated, torch.ops.mkldnn._reorder_linear_weight(up, PACK_BATCH_HINT), None, "mul")
    except (RuntimeError, AttributeError, NotImplementedError) as err:
        return _first_line(err)
    if out.dtype != dtype or not torch.allclose(out, F.silu(F.linear(x, gate)) * F.linear(x, up), rtol=1e-5,
                                                atol=1e-6):
        return "the fused result differs from silu(F.linear) * F.linear"
    return ""


def unpacked_max_rows(timings: LinearTimings | None, mkl_packed: bool = False) -> int:
    """How many rows a step may have for its fp32 linears to skip the packed copies: $ROLLOUT_UNPACKED_MAX_ROWS when
    set, else as far as F.linear measured faster than the copies chosen (`mkl_packed`: MKL's), else 0."""
    value = os.environ.get(ENV_UNPACKED_MAX_ROWS, "").strip()
    if value:
        try:
            rows = int(value)
        except ValueError:
            rows = -1
        if rows < 0:
            raise ValueError(f"{ENV_UNPACKED_MAX_ROWS}={value!r}: expected a row count >= 0 (0 keeps the packed "
                             "copies for every step)")
        return rows
    return timings.unpacked_max_rows(mkl_packed) if timings is not None else 0


def mkl_packed_reason(packed_dtypes: frozenset[torch.dtype], timings: LinearTimings | None) -> str:
    """Why MKL's packed sgemm does not pack the fp32 linears here ("" where it does): it packs them where fp32 weights
    are packed at all, it works, and it measured faster than oneDNN's copies (linear_timing.py), or where
    ROLLOUT_MKL_PACKED=1 asks for it (0: never)."""
    if torch.float32 not in packed_dtypes:
        return "fp32 linears are not packed here"
    unavailable = mkl_packed.unavailable_reason()
    if unavailable or mkl_packed.forced():
        return unavailable
    if timings is None or not timings.mkl_wins():
        return f"measured no faster than oneDNN's copies here ({mkl_packed.ENV_SWITCH}=1 uses it anyway)"
    return ""


def measure_linears(packed_dtypes: frozenset[torch.dtype], build: KernelBuild) -> LinearTimings | None:
    """The fp32 backends timed on this CPU (None where fp32 weights are not packed: F.linear serves every step),
    the small-rows kernel among them where it is built."""
    if torch.float32 not in packed_dtypes:
        return None
    return time_linears(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                        mkl_packed.MklPackedWeight if mkl_packed.available() else None,
                        small_matmul if build.available else None, small_kernel_rows(_rule_rows(build)))


@dataclass(frozen=True)
class Bf16Route:
    """How bf16 linears run: on panels of their bf16 weights (`panels`), on fp32 copies of them (`via_fp32`), or in
    bf16 (oneDNN's bf16 copies, or F.linear); with copies, steps of at most `unpacked_max_rows` rows on F.linear;
    steps of at most `kernel_max_rows` rows on the small-rows kernel over the bf16 weights as stored (widened in
    registers); and the timings that decided (None: not timed)."""

    via_fp32: bool
    unpacked_max_rows: int = 0
    timings: Bf16Timings | None = None
    kernel_max_rows: int = 0
    panels: bool = False

    def describe(self) -> str:
        route = "on bf16 panels" if self.panels else "on fp32 copies" if self.via_fp32 else "in bf16"
        small = [f"the small-rows kernel up to {self.kernel_max_rows} rows"] if self.kernel_max_rows else []
        if self.unpacked_max_rows > self.kernel_max_rows:
            small.append(f"F.linear up to {self.unpacked_max_rows} rows")
        route += f" ({', '.join(small)})" if small else ""
        return route + (f"; {self.timings.describe()}" if self.timings is not None else "")


def _setting(name: str, zero: str, one: str, unset: str) -> str:
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 ({zero}), 1 ({one}) or unset ({unset})")
    return value


def bf16_route(packed_dtypes: frozenset[torch.dtype]) -> Bf16Route:
    """The bf16 route for this CPU, whose oneDNN packs `packed_dtypes`: $ROLLOUT_BF16_PANELS or
    $ROLLOUT_BF16_VIA_FP32 when set, else timed (`time_bf16`) once per process and setting, and logged; never the
    fp32 copies where fp32 cannot be packed, nor panels where the C library is not built."""
    panels = _setting(ENV_BF16_PANELS, "never run bf16 linears on panels", "on panels wherever the C library is "
                      "built", "where those measure fastest")
    via_fp32 = _setting(ENV_BF16_VIA_FP32, "bf16 linears compute in bf16", "on fp32 copies of the weights wherever "
                        "fp32 is packed", "where those measure faster")
    return _bf16_route(packed_dtypes, via_fp32, panels if cpu_kernel.load_kernel() is not None else "0")


@functools.lru_cache(maxsize=8)
def _bf16_route(packed_dtypes: frozenset[torch.dtype], setting: str, panels: str) -> Bf16Route:
    if panels == "1":
        route = Bf16Route(False, panels=True)
    elif torch.float32 not in packed_dtypes or setting == "0":
        route = Bf16Route(False)
    elif setting == "1":
        route = Bf16Route(True)
    else:
        timings = time_bf16(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
                            torch.bfloat16 in packed_dtypes,
                            small_matmul if cpu_kernel.load_kernel() is not None else None,
                            PanelWeight if panels == "" else None)
        copies = timings.copies()
        route = Bf16Route(copies == "via_fp32", timings.unpacked_max_rows(copies), timings,
                          timings.kernel_max_rows(copies), panels=copies == "panels")
    logger.info("bf16 linears: %s", route.describe())
    return route


def _rule_rows(build: KernelBuild) -> tuple[int, int] | None:
    """SMALL_MATMUL_ROWS on builds for the ISAs the kernel serves by rule (SMALL_MATMUL_ISAS), else None."""
    return SMALL_MATMUL_ROWS if build.isa in SMALL_MATMUL_ISAS else None


def small_matmul_rows(timings: LinearTimings | None, build: KernelBuild, mkl: bool) -> tuple[int, int] | None:
    """The rows the small-rows kernel runs here (None: none): SMALL_MATMUL_ROWS by rule on the ISAs it serves
    (SMALL_MATMUL_ISAS), widened or, on other builds, chosen by its timings (linear_timing.py)."""
    if not build.available:
        return None
    by_rule = _rule_rows(build)
    return timings.small_matmul_rows(mkl, by_rule) if timings is not None else by_rule


def _onednn_bf16_device() -> bool | None:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def detect() -> CpuFeatures:
    """Probe everything now (uncached): the packed linears per dtype and the attention kernel build."""

    onednn = torch.backends.mkldnn.is_available()
    errors = {_name(d): probe_packed_linear(d) if onednn else "torch built without oneDNN" for d in PACKED_DTYPES}
    packed = frozenset(d for d in PACKED_DTYPES if not errors[_name(d)])
    build = kernel_build()
    timings = measure_linears(packed, build)
    mkl_reason = mkl_packed_reason(packed, timings)
    silu_gate = frozenset(d for d in SILU_GATE_DTYPES if d in packed and not probe_silu_gate(d))
    return CpuFeatures(
        machine=platform.machine(), cpu_name=_cpu_name(), isa=isa_flags(),
        torch_capability=torch.backends.cpu.get_cpu_capability(), onednn=onednn,
        onednn_bf16_device=_onednn_bf16_device(),
        packed_dtypes=packed, packing_errors=tuple((name, why) for name, why in errors.items() if why),
        silu_gate_dtypes=silu_gate, unpacked_max_rows=unpacked_max_rows(timings, not mkl_reason),
        linear_timings=timings, kernel=build, mkl_packed=not mkl_reason, mkl_packed_reason=mkl_reason,
        small_matmul_rows=small_matmul_rows(timings, build, not mkl_reason))


def clear_detection() -> None:
    """Forget what was detected and timed (the next use detects again): for tests that change what the CPU reports."""
    cpu_features.cache_clear()
    _bf16_route.cache_clear()


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """This process's CpuFeatures, detected on first use (which logs the one-line summary at INFO)."""
    features = detect()
    logger.info("CPU fast paths: %s", features.describe())
    return features


def linear_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The PACKED_DTYPES among the CPU weights of the plain nn.Linears that PackedLinears would serve."""
    return {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)
            and type(m).forward is torch.nn.Linear.forward and m.weight.device.type == "cpu"
            and m.weight.dtype in PACKED_DTYPES}


def require_packing(model: torch.nn.Module) -> None:
    """For an explicit prepack_weights=True: a ValueError saying what is missing when this torch build or CPU cannot
    pack the model's linear weights (None packs what it can and leaves the rest on F.linear)."""
    features = cpu_features()
    if not features.onednn:
        raise ValueError("prepack_weights=True needs a torch build with oneDNN (torch.backends.mkldnn); "
                         "leave it None to use packing only where it is available")
    missing = sorted((d for d in linear_dtypes(model)  # served_dtypes times the bf16 route: only when needed
                      if d not in features.packed_dtypes and d not in features.served_dtypes), key=str)
    if missing:
        dtype = missing[0]
        need = " (oneDNN packs bf16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT; ROLLOUT_BF16_PANELS=1 " \
            "runs bf16 linears on panels of their weights instead where the C library builds, " \
            "ROLLOUT_BF16_VIA_FP32=1 on fp32 copies)" if dtype == torch.bfloat16 else ""
        raise ValueError(f"prepack_weights=True, but oneDNN cannot pack {dtype} linear weights on this CPU{need}: "
                         f"{features.packing_error(dtype)}. Leave prepack_weights None to pack only the dtypes this "
                         f"CPU supports ({dtype} linears then run on F.linear), or set it to False")
