"""Which fp32 linear backend is fastest on this CPU at each row count, measured once per process, not guessed.

Four ways run an fp32 linear here: `F.linear` on the weight as stored (MKL's sgemm/sgemv in torch's x86 wheels),
oneDNN's packed copy, MKL's packed copy (mkl_packed.py), and for steps of a few rows the small-rows C kernel
(csrc/small_matmul.c) where it is built. Which wins depends on the CPU generation, the torch build and the
row count: MKL's packed sgemm beat oneDNN at every row count on an Intel Ice Lake, while on an AMD EPYC MKL runs
generic code paths and `F.linear` was slower than oneDNN's copies at 1-2 rows (benchmarks/RESULTS.md, "Small
steps"). A vendor name says too little, so each backend is timed on a few weights the size of a small LM's layers,
more than the caches hold (each call streams its weights from memory, as a step does), at a decode step's rows and a
batch's, and the clocks choose:

- MKL's copies pack the fp32 weights where they beat oneDNN's at the batch rows;
- the small-rows kernel takes the rows it serves by rule (3-8 on AVX-512 builds) and, below them, the timed row
  counts where it beats both F.linear and the packed copies chosen; on other builds (AVX2) it takes rows from 1 up
  as far as its summed times beat the others' (on a 2-core AVX2 EPYC it won at 1-8 rows);
- below that, steps skip the packed copies for `F.linear` where it beats the chosen copies at every row count up to
  there (`unpacked_max_rows`).

bf16 weights are timed the same way (`time_bf16`): oneDNN's bf16 copies where it packs bf16, F.linear on the weights as
stored, fp32 copies of the bf16 weights (the input widened to fp32, the output rounded back to bf16) and, where the C
library is built, panels of the bf16 weights (panel_packed.py) and the small-rows kernel on the bf16 weights as stored
(widened in registers). On a CPU without bf16 dot products (AVX512_BF16, AMX) oneDNN emulates bf16 arithmetic; the
panels, timed also at a prefill chunk's rows, beat the fp32 copies at every row count on an Ice Lake Xeon
(benchmarks/RESULTS.md, "bf16 panels"). The small-rows kernel then takes the rows from 1 up where its summed times win
over what serves them otherwise, as an AVX2 build's fp32 kernel does.

ROLLOUT_LINEAR_PROBE_SHAPE=OUTxIN times smaller weights: for an emulated CPU (benchmarks/emulated_cpu_check.sh), where
the clocks mean nothing and the full-size probe took minutes, but the choices they feed must still run.

A margin keeps a near-tie on the incumbent (the packed copies; oneDNN's over MKL's), so noise does not flip a choice
between runs. Every backend gives F.linear's values to fp32 rounding (the correctness probes in features.py and
mkl_packed.py), so the choice moves speed, not results. ROLLOUT_MKL_PACKED and ROLLOUT_UNPACKED_MAX_ROWS override it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

# A small LM's layer: 4 weights of 8 MiB fp32 per backend, one call running through all of them, so the weights of
# the backends timed (over 96 MiB together) stream from memory rather than from a last-level cache.
PROBE_OUT, PROBE_IN, PROBE_WEIGHTS = 2048, 1024, 4
ENV_PROBE_SHAPE = "ROLLOUT_LINEAR_PROBE_SHAPE"
SMALL_ROWS = (1, 2, 4)  # candidates for the rows below the packed copies
BATCH_ROWS = (8, 32)  # where the packed copies are compared
SMALL_KERNEL_ROWS = (1, 2, 4, 8)  # where the small-rows kernel may be timed: those outside its rule's rows
# bf16: a prefill chunk's rows, where the panels (panel_packed.py) must keep up with the copies they would replace:
# within PREFILL_SLACK of the fastest (they may take up to 1 / 0.8 = 1.25x its time). Decode steps carry a rollout's
# time, where the panels win by far more, and they need no second copy of the weights; a 10% margin there flipped the
# choice between runs on a near-tie (benchmarks/RESULTS.md, "bf16 panels").
PREFILL_ROWS = 256
PREFILL_SLACK = 0.8
REPEATS = 5  # best of, per backend and row count (the backends alternate, so drift hits all alike)
MARGIN = 0.9  # a challenger must take at most this share of the incumbent's time
# bf16 timings: fewer rounds, as emulated bf16 (no bf16 dot products) is slow, and the gaps it decides on are wide
BF16_REPEATS = 3

Linear = Callable[[torch.Tensor, torch.Tensor, None], torch.Tensor]  # (x, weight as stored, no bias) -> x @ weight.T


@dataclass(frozen=True)
class _Timings:
    """Best seconds per call of the linears of one weight dtype (`DTYPE`): {backend: {rows: seconds}}."""

    seconds: dict[str, dict[int, float]]
    DTYPE: ClassVar[str] = ""

    def faster(self, challenger: str, incumbent: str, rows: tuple[int, ...]) -> bool:
        """Whether `challenger` wins by the margin at every one of `rows`."""
        return all(self.seconds[challenger][r] <= MARGIN * self.seconds[incumbent][r] for r in rows)

    def _wins_up_to(self, challenger: str, incumbent: str) -> int:
        """The most of SMALL_ROWS up to which `challenger` beats `incumbent` at every row count, 0 if it never does."""
        best = 0
        for rows in SMALL_ROWS:
            if not self.faster(challenger, incumbent, (rows,)):
                break
            best = rows
        return best

    def _summed_wins_up_to(self, others: tuple[str, ...]) -> int:
        """The most of the small-rows kernel's timed rows up to which its time, summed over the timed row counts so
        far, beats by the margin the summed best of `others` at each: 0 if it never does. One sum over several row
        counts is steadier than any one of them (a near-tie at one row count flipped between runs of the probe)."""
        kernel = best = 0.0
        high = 0
        for rows in sorted(self.seconds["small"]):
            kernel += self.seconds["small"][rows]
            best += min(self.seconds[name][rows] for name in others)
            if kernel <= MARGIN * best:
                high = rows
        return high

    def describe(self) -> str:
        cells = [f"{name} " + "/".join(f"{rows}:{s * 1e6:.0f}" for rows, s in sorted(by_rows.items()))
                 for name, by_rows in self.seconds.items()]
        out, width = probe_shape()
        return f"µs per {PROBE_WEIGHTS} {out}x{width} {self.DTYPE} linears by rows: " + ", ".join(cells)


@dataclass(frozen=True)
class LinearTimings(_Timings):
    """Best seconds per call of fp32 linears; backends "f_linear", "onednn" and, where they work, "mkl" (MKL's
    packed copies) and "small" (the small-rows kernel, at those of SMALL_KERNEL_ROWS its rule leaves open)."""

    DTYPE: ClassVar[str] = "fp32"

    def mkl_wins(self) -> bool:
        return "mkl" in self.seconds and self.faster("mkl", "onednn", BATCH_ROWS)

    def small_matmul_rows(self, mkl: bool, by_rule: tuple[int, int] | None) -> tuple[int, int] | None:
        """The rows (low, high) the small-rows kernel runs, None for none. With a rule for this build (`by_rule`),
        those rows, widened down through the timed row counts where it beats both F.linear and the packed copies
        chosen (`mkl`: MKL's). Without one, from 1 row up as far as its summed times beat the best of the others
        (`_summed_wins_up_to`)."""
        if "small" not in self.seconds:
            return by_rule
        packed = "mkl" if mkl else "onednn"
        if by_rule is None:
            high = self._summed_wins_up_to((packed, "f_linear"))
            return (1, high) if high else None
        low, high = by_rule
        for rows in reversed([r for r in sorted(self.seconds["small"]) if r < low]):
            if not (self.faster("small", packed, (rows,)) and self.faster("small", "f_linear", (rows,))):
                break
            low = rows
        return low, high

    def unpacked_max_rows(self, mkl: bool) -> int:
        """The most rows up to which F.linear beats the packed copies chosen (`mkl`: MKL's), 0 if it never does."""
        return self._wins_up_to("f_linear", "mkl" if mkl else "onednn")


@dataclass(frozen=True)
class Bf16Timings(_Timings):
    """Best seconds per call of bf16 linears; backends "f_linear" (the bf16 weights as stored), "via_fp32" (fp32
    copies of them) and, where oneDNN packs bf16, "onednn" (its bf16 copies); where built, "small" (the small-rows
    kernel on the bf16 weights, at SMALL_KERNEL_ROWS)."""

    DTYPE: ClassVar[str] = "bf16"

    def _native(self, rows: int) -> float:
        """The faster of the paths that compute in bf16 at `rows` (what serves bf16 without the fp32 copies)."""
        return min(self.seconds[name][rows] for name in ("f_linear", "onednn") if name in self.seconds)

    def via_fp32_wins(self) -> bool:
        """Whether the fp32 copies beat bf16 arithmetic by the margin at every one of BATCH_ROWS."""
        return all(self.seconds["via_fp32"][r] <= MARGIN * self._native(r) for r in BATCH_ROWS)

    def _best_but_panels(self, rows: int) -> float:
        return min(by_rows[rows] for name, by_rows in self.seconds.items()
                   if name not in ("panels", "small") and rows in by_rows)

    def panels_win(self) -> bool:
        """Whether the panels beat every other copy and F.linear by the margin at each of BATCH_ROWS, and keep within
        PREFILL_SLACK of the fastest at PREFILL_ROWS."""
        if "panels" not in self.seconds:
            return False
        panels = self.seconds["panels"]
        return all(panels[r] <= MARGIN * self._best_but_panels(r) for r in BATCH_ROWS) and (
            PREFILL_SLACK * panels[PREFILL_ROWS] <= self._best_but_panels(PREFILL_ROWS))

    def copies(self) -> str:
        """What serves bf16 steps above the small ones: "panels", "via_fp32" (fp32 copies) or "native" (oneDNN's
        bf16 copies where bf16 is packed, else F.linear)."""
        return "panels" if self.panels_win() else "via_fp32" if self.via_fp32_wins() else "native"

    def unpacked_max_rows(self, copies: str) -> int:
        """With `copies` (see `copies`): the most rows up to which F.linear on the bf16 weights beats them, 0 if it
        never does (or `copies` is "native")."""
        return 0 if copies == "native" else self._wins_up_to("f_linear", copies)

    def kernel_max_rows(self, copies: str) -> int:
        """The small-rows kernel's rows, from 1 up as far as its summed times beat what serves those rows without it
        (`_summed_wins_up_to`): `copies` or F.linear, whichever is faster, or for "native" oneDNN's bf16 copies
        (F.linear where bf16 is not packed); 0 for none. None beside the panels: streaming a real model's weights
        they were as fast or faster at every row count, where the probe's weights, cache-resident on a CPU with a
        large last-level cache, favoured the kernel at a few rows (benchmarks/RESULTS.md, "bf16 panels"); and on
        the panels alone a sequence's values do not depend on its step's size."""
        if "small" not in self.seconds or copies == "panels":
            return 0
        if copies != "native":
            return self._summed_wins_up_to((copies, "f_linear"))
        return self._summed_wins_up_to(("onednn" if "onednn" in self.seconds else "f_linear",))


def via_fp32(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """A bf16 linear on oneDNN's fp32 copy of the weight: the input widened, the output rounded back to its dtype."""
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "").to(x.dtype)


def probe_shape() -> tuple[int, int]:
    """(out, in) of the probe's weights: PROBE_OUT x PROBE_IN, or $ROLLOUT_LINEAR_PROBE_SHAPE."""
    value = os.environ.get(ENV_PROBE_SHAPE, "").strip()
    if not value:
        return PROBE_OUT, PROBE_IN
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{ENV_PROBE_SHAPE}={value!r}: expected OUTxIN, two positive sizes such as 256x128 (unset: "
                         f"{PROBE_OUT}x{PROBE_IN}, weights that stream from memory as a real layer's do)")
    return int(parts[0]), int(parts[1])


def _probe_weights(dtype: torch.dtype, rows: int = max(BATCH_ROWS)) -> tuple[list[torch.Tensor], torch.Tensor]:
    """PROBE_WEIGHTS random weights of the probe's shape and an input of `rows` rows, in `dtype`."""
    out, width = probe_shape()
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(out, width, generator=g) / width ** 0.5).to(dtype) for _ in range(PROBE_WEIGHTS)]
    return weights, torch.randn(rows, width, generator=g).to(dtype)


def _best_of(calls: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def small_kernel_rows(by_rule: tuple[int, int] | None) -> tuple[int, ...]:
    """The row counts to time the small-rows kernel at: SMALL_KERNEL_ROWS below its rule's rows (those it serves
    anyway; `small_matmul_rows` only widens them downwards), all of them without a rule."""
    return SMALL_KERNEL_ROWS if by_rule is None else tuple(r for r in SMALL_KERNEL_ROWS if r < by_rule[0])


def time_linears(onednn_pack: Callable[[torch.Tensor], torch.Tensor],
                 mkl_pack: Callable[[torch.Tensor], object] | None = None,
                 small_matmul: Linear | None = None,
                 small_rows: tuple[int, ...] = SMALL_KERNEL_ROWS) -> LinearTimings:
    """Time F.linear, oneDNN's packed copies (`onednn_pack` makes one), and where given MKL's packed copies
    (`mkl_pack`: mkl_packed.MklPackedWeight), at SMALL_ROWS and BATCH_ROWS rows; where given, the small-rows kernel
    at `small_rows` (see small_kernel_rows)."""
    weights, x = _probe_weights(torch.float32)
    backends: dict[str, Callable[[torch.Tensor], list]] = {
        "f_linear": lambda xs: [F.linear(xs, w) for w in weights],
        "onednn": _over([onednn_pack(w) for w in weights],
                        lambda xs, p: torch.ops.mkldnn._linear_pointwise(xs, p, None, "none", [], ""))}
    if mkl_pack is not None:
        backends["mkl"] = _over([mkl_pack(w) for w in weights], lambda xs, p: p.linear(xs))
    limited: dict[str, tuple[int, ...]] = {}
    if small_matmul is not None:
        backends["small"] = lambda xs: [small_matmul(xs, w, None) for w in weights]
        limited["small"] = small_rows
    seconds = _timed(backends, x, (*SMALL_ROWS, *BATCH_ROWS), limited)
    return LinearTimings(seconds)


def time_bf16(onednn_pack: Callable[[torch.Tensor], torch.Tensor], bf16_packs: bool,
              small_matmul: Linear | None = None,
              panel_pack: Callable[[torch.Tensor], object] | None = None) -> Bf16Timings:
    """Time bf16 linears at SMALL_ROWS and BATCH_ROWS rows: F.linear on the bf16 weights, `onednn_pack`'s copies of
    their fp32 values (`via_fp32`) and, where oneDNN packs bf16 (`bf16_packs`), its bf16 copies; where given, the
    small-rows kernel on the bf16 weights at SMALL_KERNEL_ROWS, and the panels (`panel_pack`:
    panel_packed.PanelWeight), which are timed with the copies at PREFILL_ROWS too."""
    weights, x = _probe_weights(torch.bfloat16, PREFILL_ROWS if panel_pack is not None else max(BATCH_ROWS))
    backends: dict[str, Callable[[torch.Tensor], list]] = {
        "f_linear": lambda xs: [F.linear(xs, w) for w in weights],
        "via_fp32": _over([onednn_pack(w.float()) for w in weights], via_fp32)}
    decode_rows = (*SMALL_ROWS, *BATCH_ROWS)
    limited = {"f_linear": decode_rows, "onednn": BATCH_ROWS}  # the batch rows decide bf16 arithmetic or copies
    if bf16_packs:
        backends["onednn"] = _over([onednn_pack(w) for w in weights],
                                   lambda xs, p: torch.ops.mkldnn._linear_pointwise(xs, p, None, "none", [], ""))
    if small_matmul is not None:
        backends["small"] = lambda xs: [small_matmul(xs, w, None) for w in weights]
        limited["small"] = SMALL_KERNEL_ROWS
        if bf16_packs:  # what the kernel would replace at its rows
            limited["onednn"] = tuple(sorted({*BATCH_ROWS, *SMALL_KERNEL_ROWS}))
    rows = decode_rows
    if panel_pack is not None:
        backends["panels"] = _over([panel_pack(w) for w in weights], lambda xs, p: p.linear(xs))
        limited["onednn"] = (*limited["onednn"], PREFILL_ROWS)
        rows = (*rows, PREFILL_ROWS)
    return Bf16Timings(_timed(backends, x, rows, limited, BF16_REPEATS))


def _timed(backends: dict[str, Callable[[torch.Tensor], list]], x: torch.Tensor, rows_timed: tuple[int, ...],
           limited: dict[str, tuple[int, ...]] | None = None, repeats: int = REPEATS) -> dict[str, dict[int, float]]:
    """Best seconds per call of each backend on the first rows of `x`, per row count (the backends in `limited` only
    at the rows it gives them), the backends alternating."""
    limited = limited or {}
    seconds: dict[str, dict[int, float]] = {name: {} for name in backends}
    with torch.no_grad():
        for rows in rows_timed:
            xs = x[:rows].contiguous()
            calls = {name: _bound(run, xs) for name, run in backends.items() if rows in limited.get(name, (rows,))}
            for call in calls.values():
                call()  # first calls build kernels
            for name, s in _best_of(calls, repeats).items():
                seconds[name][rows] = s
    return seconds


def _over(packs: list, linear: Callable[[torch.Tensor, object], torch.Tensor]) -> Callable[[torch.Tensor], list]:
    return lambda xs: [linear(xs, p) for p in packs]


def _bound(run: Callable[[torch.Tensor], list], xs: torch.Tensor) -> Callable[[], list]:
    return lambda: run(xs)
