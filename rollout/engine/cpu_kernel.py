"""The CPU paged-attention kernel (csrc/paged_attention.c): built once per machine with the system C compiler, loaded
with ctypes, and called once per layer for the whole packed batch.

Why C and not more PyTorch ops: attention over paged K/V in PyTorch needs a gather of every page into a contiguous
buffer before SDPA reads it again, so each key is moved three times; the kernel reads each one once where it lies, and
needs no per-bucket masks or per-request calls. It is plain C with OpenMP (no torch headers), so it compiles in about
a second; the library shares torch's OpenMP runtime, so the two thread pools never fight over the cores.

When no compiler is available, the build fails, the dtype is not fp32/bf16, or `ROLLOUT_CPU_KERNEL=0` is set, the
engine uses the PyTorch path in attention.py; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
ENV_SWITCH = "ROLLOUT_CPU_KERNEL"
ENV_CACHE_DIR = "ROLLOUT_KERNEL_CACHE"
# -ffast-math lets expf/tanhf vectorize; it is given to the compile step only, so the link does not add the
# crtfastmath startup code that would flush denormals for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU: the cache key includes this machine's CPU flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout", "kernels")
    return Path(root)


def _build(compiler: str) -> Path:
    """Compile (or reuse) the shared library; returns its path. Raises CalledProcessError/OSError on failure."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    name = f"paged_attention-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"rollout-kernels-{os.getuid()}"):
        if (folder / name).exists():
            return folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue  # a read-only home: build under the temp dir instead
    target = folder / name
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        obj, lib = Path(tmp) / "paged_attention.o", Path(tmp) / "paged_attention.so"
        for cmd in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                    [compiler, str(obj), *LINK_FLAGS, "-o", str(lib)]):
            subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(lib, target)  # atomic: concurrent builders each publish a complete library
    return target


@functools.lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """The kernel library, or None (with the reason logged once) when it cannot be used here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU attention kernel disabled by %s=0; using the PyTorch path", ENV_SWITCH)
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC or install gcc): CPU attention uses the slower PyTorch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except subprocess.CalledProcessError as err:
        logger.warning("building the CPU attention kernel failed; using the PyTorch path.\n%s\n%s",
                       " ".join(err.cmd), err.stderr)
        return None
    except OSError as err:
        logger.warning("could not build or load the CPU attention kernel (%s); using the PyTorch path", err)
        return None
    fn = lib.rollout_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
                   + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    return lib


def kernel_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can serve a cache of this device and dtype (it is built on the first call)."""
    return device.type == "cpu" and dtype in DTYPES and load_kernel() is not None


@dataclass
class KernelBatch:
    """Per-step metadata read by every layer's call: each packed token's position and block-table row."""

    positions: torch.Tensor  # [T] int64
    token_rows: torch.Tensor  # [T] int64
    tables: torch.Tensor  # [R, max_blocks] int64, contiguous

    def __post_init__(self) -> None:
        self.positions = self.positions.contiguous()
        self.token_rows = self.token_rows.contiguous()
        self.tables = self.tables.contiguous()


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: KernelBatch,
                    page_size: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention of `query` `[T, H, D]` (any strides but the last) over the paged cache (`[slots, KVH, D]`);
    returns `[T, H, D]`, contiguous."""
    lib = load_kernel()
    if query.dtype != k_cache.dtype or query.stride(-1) != 1:
        query = query.to(k_cache.dtype).contiguous()
    tokens, heads, dim = query.shape
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    status = lib.rollout_paged_attention(
        query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        batch.positions.data_ptr(), batch.token_rows.data_ptr(), batch.tables.data_ptr(), tokens,
        batch.tables.shape[1], heads, k_cache.shape[1], dim, page_size, scale, window or 0, softcap or 0.0,
        DTYPES[k_cache.dtype], torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU attention kernel could not allocate its per-thread scratch memory")
    return out
