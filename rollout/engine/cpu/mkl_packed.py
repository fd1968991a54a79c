"""MKL's packed sgemm (`cblas_sgemm_pack` / `cblas_sgemm_compute`), reached inside torch's own library, for the
engine's fp32 linears where it measures faster than oneDNN's packed copies.

Why: MKL keeps a weight in its own packed layout, and its compute on that layout beat oneDNN's packed matmul at
every row count we measured on Intel CPUs (benchmarks/linear_backends.py; the table is in benchmarks/RESULTS.md,
"Linears"). Each call also costs far less fixed overhead than `torch.ops.mkldnn._linear_pointwise`, and needs no row
padding (oneDNN builds kernels per row count). At 1-2 rows MKL's sgemv on the weights as stored is a little faster:
`F.linear` keeps those steps (cpu_features.UNPACKED_MAX_ROWS_MKL_PACKED).

How: torch's x86-64 Linux wheels link MKL statically and export its CBLAS functions from libtorch_cpu; they are
called through ctypes (which releases the GIL for the call), so there is nothing to build and no new dependency. A
weight is packed into a buffer of the size MKL asks for (`cblas_sgemm_pack_get_size` reserves several MB it never
writes; those pages are never touched, so they take no memory) and repacked into the same buffer when the weight
changes (a packed matrix must not move). Repacking after a weight update is faster than oneDNN's in-place refresh
(benchmarks/results-history.md, "Linears on MKL's packed sgemm").

Where: used only where `available()` says so: a torch with MKL whose library exports the functions, a probe that
compares packed results with `F.linear` at several row counts passes, and `ROLLOUT_MKL_PACKED` is not 0. The engine
uses it where it is also timed faster than oneDNN's copies on this CPU (cpu/linear_timing.py; on AMD EPYCs MKL can
run generic code paths), unless `ROLLOUT_MKL_PACKED=1` asks for it on any CPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

ENV_SWITCH = "ROLLOUT_MKL_PACKED"
# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count a weight is packed for. MKL's pack records its own layout (the compute call is not told the packed
# row count), and products at other row counts matched F.linear in every test here; the probe checks 1-300 rows.
PACK_ROWS_HINT = 256
PROBE_ROWS = (1, 3, 17, 300)


@functools.lru_cache(maxsize=1)
def _functions() -> tuple[object, object, object] | str:
    """(pack_get_size, pack, compute) from the loaded torch library that exports them, or why there are none."""
    if not torch.backends.mkl.is_available():
        return "this torch is built without MKL"
    lib_dir = Path(torch.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libtorch_cpu.*")) + sorted(lib_dir.glob("torch_cpu.*"))
    for path in candidates:
        try:
            lib = ctypes.CDLL(str(path))
            get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
        except (OSError, AttributeError):
            continue
        get_size.restype = ctypes.c_size_t
        get_size.argtypes = [ctypes.c_int] * 4
        pack.restype = None
        pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        compute.restype = None
        compute.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        return get_size, pack, compute
    return f"no library under {lib_dir} exports cblas_sgemm_pack/cblas_sgemm_compute"


class MklPackedWeight:
    """One fp32 weight `[out_features, in_features]` in MKL's packed layout; `linear(x, bias)` is `F.linear`."""

    def __init__(self, weight: torch.Tensor) -> None:
        functions = _functions()
        if isinstance(functions, str):
            raise RuntimeError(f"MKL's packed sgemm is unavailable: {functions}")
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"MKL packs 2-D fp32 CPU weights, got {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}")
        self._get_size, self._pack, self._compute = functions
        self.out_features, self.in_features = weight.shape
        nbytes = self._get_size(_B_MATRIX, PACK_ROWS_HINT, self.out_features, self.in_features)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # 64-byte aligned, as MKL wants
        self.repack(weight)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def repack(self, weight: torch.Tensor) -> None:
        """Pack the current values of `weight` (same shape, fp32) into this buffer."""
        if tuple(weight.shape) != self.shape or weight.dtype != torch.float32:
            raise ValueError(f"repack of an fp32 {self.shape} pack with a {weight.dtype} weight of shape "
                             f"{tuple(weight.shape)}")
        weight = weight.detach().contiguous()
        self._pack(_ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS_HINT, self.out_features, self.in_features, 1.0,
                   weight.data_ptr(), self.in_features, self.buffer.data_ptr())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W.T + bias` for fp32 `x` of shape `[..., in_features]`."""
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) < self.in_features):
            flat = flat.contiguous()
        rows = flat.shape[0]
        out, beta = torch.empty(rows, self.out_features, dtype=torch.float32), 0.0
        if bias is not None:  # MKL adds the product to it (beta 1)
            out.copy_(bias.expand(rows, self.out_features))
            beta = 1.0
        if rows:
            self._compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, self.out_features, self.in_features, flat.data_ptr(),
                          max(flat.stride(0), self.in_features), self.buffer.data_ptr(), self.in_features, beta,
                          out.data_ptr(), self.out_features)
        return out.view(*x.shape[:-1], self.out_features)


def probe() -> str:
    """Pack a weight and compare its products with F.linear at PROBE_ROWS rows; "" when every row agrees to fp32
    rounding, else why not."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 72, generator=g), torch.randn(40, generator=g)
    x = torch.randn(max(PROBE_ROWS), 72, generator=g)
    try:
        packed = MklPackedWeight(weight)
        for rows in PROBE_ROWS:
            if not torch.allclose(packed.linear(x[:rows], bias), F.linear(x[:rows], weight, bias), rtol=1e-5,
                                  atol=1e-5):
                return f"the packed result differs from F.linear at {rows} rows"
    except (RuntimeError, ValueError, OSError) as err:
        return str(err).splitlines()[0][:200]
    return ""


def _switch() -> str:
    value = os.environ.get(ENV_SWITCH, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_SWITCH}={value!r}: expected 0 (never use MKL's packed sgemm), 1 (use it on any CPU "
                         "where it works) or unset (where it measures faster than oneDNN's copies)")
    return value


def forced() -> bool:
    """Whether $ROLLOUT_MKL_PACKED=1 asks for MKL's copies on any CPU (not only where they measure faster)."""
    return _switch() == "1"


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str:
    """Why MKL's packed sgemm cannot serve in this process ("" when it can): $ROLLOUT_MKL_PACKED=0, no MKL, or the
    probe failed."""
    if _switch() == "0":
        return f"{ENV_SWITCH}=0"
    functions = _functions()
    return functions if isinstance(functions, str) else probe()


def available() -> bool:
    return not unavailable_reason()
