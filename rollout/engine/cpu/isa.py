"""The CPU's instruction-set flags and how the C kernels were built: facts every CPU module reads, with no
dependency on any of them (cpu_kernel builds from these, cpu_features probes and summarises on top of both)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The flags that matter to our fast paths (names as torch.cpu.get_capabilities spells them).
ISA_FLAGS = ("sse4_2", "avx2", "fma3", "avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16",
             "avx_ne_convert", "amx_tile", "amx_bf16", "neon", "sve")
# /proc/cpuinfo spellings that differ from torch's
_PROC_NAMES = {"fma": "fma3", "avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
               "avx512dq": "avx512_dq", "asimd": "neon"}

@functools.lru_cache(maxsize=1)
def isa_flags() -> frozenset[str]:
    """The ISA_FLAGS of the CPU this process runs on (CPUID through torch; /proc/cpuinfo where torch lacks it)."""
    try:
        caps = torch.cpu.get_capabilities()
        return frozenset(name for name in ISA_FLAGS if caps.get(name) is True)
    except (AttributeError, RuntimeError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    names = {_PROC_NAMES.get(word, word) for word in line.partition(":")[2].split()}
    return frozenset(name for name in ISA_FLAGS if name in names)



@dataclass(frozen=True)
class KernelBuild:
    """How the C kernels (attention, linears of a few rows) were built and loaded here, or why they are not used."""

    available: bool
    march: str = ""
    isa: str = ""  # widest vector ISA compiled in: avx512f, avx2, avx, sse4.2, sse2, neon or scalar
    openmp: bool = False
    reason: str = ""  # why it is unavailable (empty when available)

    def describe(self) -> str:
        if not self.available:
            return f"unavailable ({self.reason})"
        return f"-march={self.march} {self.isa}, {'OpenMP' if self.openmp else 'single-threaded (no OpenMP)'}"
