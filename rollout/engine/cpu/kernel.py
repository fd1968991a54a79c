"""The CPU paged-attention kernel (csrc/paged_attention.c): built once per machine with the system C compiler, loaded
with ctypes, and called once per layer for the whole packed batch.

Why C and not more PyTorch ops: attention over paged K/V in PyTorch needs a gather of every page into a contiguous
buffer before SDPA reads it again, so each key is moved three times; the kernel reads each one once where it lies, and
needs no per-bucket masks or per-request calls. It is plain C with OpenMP (no torch headers), so it compiles in about
a second; the library shares torch's OpenMP runtime, so the two thread pools never fight over the cores.

Portability: the library is built for `-march=native` by default; `ROLLOUT_KERNEL_MARCH` picks another target (e.g.
`x86-64-v2`, which every x86-64 CPU since about 2009 runs, or `x86-64-v3` for AVX2 machines) and is part of the build
cache key. The C source has no intrinsics, so every target gets the same portable code, auto-vectorized for its ISA (the
weight-sync transpose uses the compilers' generic vectors, which every target lowers to its own shuffles). After
loading, the library reports what it was compiled for (rollout_kernel_features); if that needs a flag the running CPU
lacks (say an AVX-512 build in a cache shared with an AVX2 machine), it is not used: it would die on SIGILL. CPU flags
come from CPUID via isa.isa_flags.

OpenMP: if the compiler or its OpenMP runtime cannot build with -fopenmp (e.g. clang without libomp), the kernel is
built again without it and runs single-threaded, with the same results (its work split never changes the numbers);
a warning says so and how to get OpenMP. On a many-core machine the multi-threaded PyTorch path may then be faster:
`ROLLOUT_CPU_KERNEL=0` selects it.

When no compiler is available, the build fails, the library does not fit this CPU, the dtype is not fp32/bf16, or
`ROLLOUT_CPU_KERNEL=0` is set, the engine uses the PyTorch path in attention.py; the reason is logged once and shows
in the CPU summary line (cpu/features.py).
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

from rollout.engine.cpu.isa import KernelBuild, isa_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every C file there goes into the one library
SOURCE = CSRC / "paged_attention.c"
MATMUL_SOURCE = CSRC / "small_matmul.c"
# The matmuls' sums (this one's and panel_matmul.c's) keep the order the source writes, on every target: -ffast-math
# would let the compiler reassociate or vectorize a sum in an order of its own, and contraction would fuse a multiply
# and an add where the target has FMA (so an AVX-512 and an AVX2 build gave different bits). Their fused multiply-adds
# are explicit in the source instead.
# The RMSNorm kernel likewise: it must round where the module's own ops round (a contracted multiply-add, or a sum of
# squares reassociated by the vectorizer, would change bf16 outputs). The top-p and draw kernels must see NaN
# probabilities as NaN (they count as 0), which -ffast-math lets the compiler assume away, and the draw's exp must round
# at every step as units.py's PyTorch operations do (without traps or errno floor vectorizes; no result changes).
NORM_SOURCE = CSRC / "rms_norm.c"
SOURCE_FLAGS = {MATMUL_SOURCE.name: ["-fno-fast-math", "-ffp-contract=off"],
                NORM_SOURCE.name: ["-fno-fast-math", "-ffp-contract=off"],
                "panel_matmul.c": ["-fno-fast-math", "-ffp-contract=off"],
                "truncation.c": ["-fno-fast-math"],
                "draw.c": ["-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"]}
ENV_SWITCH = "ROLLOUT_CPU_KERNEL"
ENV_CACHE_DIR = "ROLLOUT_KERNEL_CACHE"
ENV_MARCH = "ROLLOUT_KERNEL_MARCH"
DEFAULT_MARCH = "native"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Bits of rollout_kernel_features() in the C source, and the CPU flag (cpu_features.ISA_FLAGS) each one needs.
FEATURE_BITS = {"openmp": 1, "sse4.2": 2, "avx": 4, "avx2": 8, "fma": 16, "avx512f": 32, "avx512bf16": 64,
                "neon": 128}
CPU_FLAG_NEEDED = {"sse4.2": "sse4_2", "avx2": "avx2", "fma": "fma3", "avx512f": "avx512_f",
                   "avx512bf16": "avx512_bf16"}
WIDEST_FIRST = ("avx512f", "avx2", "avx", "sse4.2", "neon")

_unavailable = {"reason": "not loaded yet"}  # why the last load_kernel() returned None, for kernel_build()


def kernel_march() -> str:
    """The -march the kernel is built for: $ROLLOUT_KERNEL_MARCH, else native."""
    return os.environ.get(ENV_MARCH, "").strip() or DEFAULT_MARCH


def _flags(march: str, openmp: bool) -> tuple[list[str], list[str]]:
    """Compile and link flags. -ffast-math lets expf/tanhf vectorize; it is given to the compile step only, so the
    link does not add the crtfastmath startup code that would flush denormals for the whole process."""
    omp = ["-fopenmp"] if openmp else []
    return ["-O3", f"-march={march}", "-ffast-math", *omp, "-fPIC", "-std=c11"], ["-shared", *omp, "-lm"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature(march: str) -> str:
    """-march=native code must not run on another CPU: for it the cache key includes this machine's CPU flags (from
    /proc/cpuinfo, and from CPUID, which differ under an emulator). A named -march builds the same code anywhere."""
    if march != "native":
        return platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags + " ".join(sorted(isa_flags()))


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout", "kernels")
    return Path(root)


def _build(compiler: str, march: str, openmp: bool) -> Path:
    """Compile (or reuse) the shared library; returns its path. Raises CalledProcessError/OSError on failure."""
    # the attention source first: benchmarks/attention_kernel.py points SOURCE at another revision of it
    sources = (SOURCE, *sorted(p for p in CSRC.glob("*.c") if p.name != "paged_attention.c"))
    compile_flags, link_flags = _flags(march, openmp)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    headers = sorted(CSRC.glob("*.h"))  # included by the sources: a change must rebuild too
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in (*sources, *headers)), version.encode(),
                                     " ".join(compile_flags + link_flags).encode(), repr(SOURCE_FLAGS).encode(),
                                     _cpu_signature(march).encode()])).hexdigest()[:16]
    name = f"rollout_kernels-{key}.so"
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
        objs, lib = [str(Path(tmp) / f"{s.stem}.o") for s in sources], Path(tmp) / "rollout_kernels.so"
        compiles = [[compiler, *compile_flags, *SOURCE_FLAGS.get(s.name, []), "-c", str(s), "-o", o]
                    for s, o in zip(sources, objs)]
        for cmd in [*compiles, [compiler, *objs, *link_flags, "-o", str(lib)]]:
            subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(lib, target)  # atomic: concurrent builders each publish a complete library
    return target


def _build_any(compiler: str, march: str) -> tuple[Path, bool]:
    """Build with OpenMP, else without it (single-threaded); returns (library, has OpenMP). Raises like _build."""
    try:
        return _build(compiler, march, openmp=True), True
    except subprocess.CalledProcessError as err:
        omp_error = (err.stderr or "").strip().splitlines()
    path = _build(compiler, march, openmp=False)
    logger.warning("the C compiler could not build with OpenMP (%s); the CPU attention kernel runs single-threaded. "
                   "For multi-threaded attention install the compiler's OpenMP runtime (libgomp for gcc, libomp for "
                   "clang), or set %s=0 to use the PyTorch path", omp_error[0] if omp_error else "no message",
                   ENV_SWITCH)
    return path, False


def compiled_features(lib: ctypes.CDLL) -> frozenset[str]:
    """What a loaded library was compiled for (the FEATURE_BITS names its rollout_kernel_features() reports)."""
    bits = lib.rollout_kernel_features()
    return frozenset(name for name, bit in FEATURE_BITS.items() if bits & bit)


def _missing_cpu_flags(compiled: frozenset[str]) -> list[str]:
    """CPU flags the library needs that this CPU lacks (none when the CPU's flags are unknown)."""
    cpu = isa_flags()
    if not cpu:
        return []
    return [CPU_FLAG_NEEDED[name] for name in sorted(compiled) if name in CPU_FLAG_NEEDED
            and CPU_FLAG_NEEDED[name] not in cpu]


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.rollout_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6
                   + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])
    for fn, restype in ((lib.rollout_small_matmul, None), (lib.rollout_small_matmul_bf16, ctypes.c_int)):
        fn.restype = restype
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
                       + [ctypes.c_int])
    for fn, restype in ((lib.rollout_panel_matmul, None), (lib.rollout_panel_matmul_bf16, ctypes.c_int)):
        fn.restype = restype
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
                       + [ctypes.c_int])
    fn = lib.rollout_any_nonfinite
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn = lib.rollout_transpose_blocks
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5
                   + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    fn = lib.rollout_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn = lib.rollout_draw_tokens
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn = lib.rollout_top_p_keep
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """Build and load the library; returns it, or None and why not (already logged)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU attention kernel disabled by %s=0; using the PyTorch path", ENV_SWITCH)
        return None, f"disabled by {ENV_SWITCH}=0"
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC or install gcc): CPU attention uses the slower PyTorch path")
        return None, "no C compiler found"
    march = kernel_march()
    try:
        path, _ = _build_any(compiler, march)
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as err:
        logger.warning("building the CPU attention kernel failed; using the PyTorch path.\n%s\n%s",
                       " ".join(err.cmd), err.stderr)
        return None, f"build failed for -march={march}"
    except OSError as err:
        logger.warning("could not build or load the CPU attention kernel (%s); using the PyTorch path", err)
        return None, f"could not build or load it: {err}"
    missing = _missing_cpu_flags(compiled_features(lib))
    if missing:
        logger.warning("the CPU attention kernel built for -march=%s needs %s, which this CPU lacks; using the "
                       "PyTorch path (set %s to a target this CPU runs, e.g. x86-64-v2)", march,
                       ", ".join(missing), ENV_MARCH)
        return None, f"-march={march} needs {', '.join(missing)}, which this CPU lacks"
    _declare(lib)
    lib._rollout_march = march
    return lib, ""


@functools.lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """The kernel library, or None (with the reason logged once) when it cannot be used here."""
    lib, reason = _load()
    _unavailable["reason"] = reason
    return lib


def kernel_build() -> KernelBuild:
    """How the loaded kernel was built (-march, widest vector ISA compiled in, OpenMP), or why there is none."""
    lib = load_kernel()
    if lib is None:
        return KernelBuild(False, reason=_unavailable["reason"])
    compiled = compiled_features(lib)
    fallback = "sse2" if platform.machine().lower() in ("x86_64", "amd64") else "scalar"
    isa = next((name for name in WIDEST_FIRST if name in compiled), fallback)
    return KernelBuild(True, march=lib._rollout_march, isa=isa, openmp="openmp" in compiled)


def kernel_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can serve a cache of this device and dtype (it is built on the first call)."""
    if device.type != "cpu":
        return False
    return dtype in DTYPES and load_kernel() is not None


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`, the mean in fp32, as transformers' RMSNorm modules
    compute it (csrc/rms_norm.c), for a CPU fp32/bf16 `x` (any strides but the last) and a contiguous 1-D `weight` of
    x's dtype and last size; returns a new contiguous tensor of x's shape. No autograd: for the engine's forward only
    (rms_norm.FusedNorms)."""
    shape = x.shape
    dim = shape[-1]
    flat = x
    if not x.is_contiguous():
        flat = x.reshape(-1, dim)  # a view where the leading dims allow one, else a copy
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
    # as few calls into torch as can be (empty_like is the cheaper allocation): this runs 100+ times per decode step
    out = torch.empty_like(flat, memory_format=torch.contiguous_format)
    load_kernel().rollout_rms_norm(flat.data_ptr(), dim if flat is x else flat.stride(0), weight.data_ptr(),
                                   out.data_ptr(), flat.numel() // dim, dim, eps, DTYPES[x.dtype],
                                   norm_sum_order()[0], torch.get_num_threads())
    return out if flat is x else out.view(shape)


@functools.lru_cache(maxsize=1)
def norm_sum_order() -> tuple[int, bool]:
    """(lanes, whether they give torch's bits): the floats per vector of torch's CPU sum that the RMSNorm kernel sums
    a row's squares by, so that its mean, and so every output, has torch's bits. The first of 16, 8 and 4 whose fp32
    norms equal torch's on random rows (with tails, and long enough for the sum's cascade); (16, False) if none does:
    then an output can differ from torch's in its last bits."""
    lib = load_kernel()
    gen = torch.Generator().manual_seed(0)
    for lanes in (16, 8, 4):
        for rows, dim in ((64, 1000), (3, 5000), (2, 20003)):
            x = torch.randn(rows, dim, generator=gen)
            weight = torch.ones(dim)
            expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            out = torch.empty_like(x)
            lib.rollout_rms_norm(x.data_ptr(), dim, weight.data_ptr(), out.data_ptr(), rows, dim, 1e-6,
                                 DTYPES[torch.float32], lanes, 1)
            if not torch.equal(out, expected):
                break
        else:
            return lanes, True
    return 16, False


def all_finite(values: torch.Tensor) -> bool | None:
    """Whether every value of a contiguous fp32/bf16 CPU tensor is finite, in one pass (csrc/weight_sync.c); None
    where the kernel cannot say (another dtype, layout or device, or no kernel library here)."""
    if values.dtype not in DTYPES or values.device.type != "cpu" or not values.is_contiguous():
        return None
    lib = load_kernel()
    if lib is None:
        return None
    return lib.rollout_any_nonfinite(values.data_ptr(), values.numel(), DTYPES[values.dtype],
                                     torch.get_num_threads()) == 0


def transpose_blocks(src: torch.Tensor, dst: torch.Tensor, offset: int, blocks: int, group: int, block_stride: int,
                     column_stride: int, plain: torch.Tensor | None = None) -> None:
    """Write `blocks` groups of `group` rows of `src` (2-D, 32- or 16-bit elements, rows contiguous), each stored
    column by column, into the flat buffer `dst` (elements of the same width, or fp32 for a bf16 `src`: widened) from
    element `offset` on (csrc/weight_sync.c): element (r, c) of group b goes to `offset + b * block_stride + c *
    column_stride + r`. `plain` (2-D like `src`, rows contiguous): also copy those rows of `src` there in the same pass.
    Bounds are checked here, not in C."""
    rows, cols = src.shape
    width, dst_width = src.element_size(), dst.element_size()
    widened = src.dtype == torch.bfloat16 and dst.dtype == torch.float32
    if width not in (2, 4) or (dst_width != width and not widened) or src.stride(1) != 1 or dst.dim() != 1 \
            or dst.stride(0) != 1 or rows < blocks * group:
        raise ValueError("transpose_blocks takes 32- or 16-bit elements: a 2-D source with contiguous rows, a flat "
                         "buffer of the same element width (or fp32 for a bf16 source)")
    if plain is not None and (plain.element_size() != width or plain.dim() != 2 or plain.stride(1) != 1
                              or plain.shape[1] != cols or plain.shape[0] < blocks * group):
        raise ValueError(f"transpose_blocks copies rows into a 2-D plain tensor of {8 * width}-bit elements with "
                         f"contiguous rows, {cols} wide and at least {blocks * group} tall, got {tuple(plain.shape)}")
    last = offset + (blocks - 1) * block_stride + (cols - 1) * column_stride + group - 1
    if offset < 0 or last >= dst.numel():
        raise ValueError(f"transpose_blocks would write element {last} of a buffer of {dst.numel()}")
    load_kernel().rollout_transpose_blocks(src.data_ptr(), src.stride(0), dst.data_ptr() + offset * dst_width,
                                           blocks, group, cols, block_stride, column_stride,
                                           None if plain is None else plain.data_ptr(),
                                           0 if plain is None else plain.stride(0), width, dst_width,
                                           torch.get_num_threads())


def top_p_keep(probs: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor | None:
    """Per row of `probs` `[rows, vocab]` (fp32, CPU), the tokens top-p keeps under the row's budget in units of 2^-40
    (truncation.py defines the rule; csrc/truncation.c finds it without a sort); None where the kernel cannot serve
    the call."""
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.device.type != "cpu" or load_kernel() is None:
        return None
    if budgets.dtype != torch.int64 or budgets.shape != (probs.shape[0],) or budgets.device.type != "cpu":
        raise ValueError(f"top_p_keep takes one int64 CPU budget per row ({probs.shape[0]}), got "
                         f"{budgets.dtype} {tuple(budgets.shape)} on {budgets.device}")
    probs, budgets = probs.contiguous(), budgets.contiguous()
    keep = torch.empty(probs.shape, dtype=torch.bool)
    if load_kernel().rollout_top_p_keep(probs.data_ptr(), probs.shape[0], probs.shape[1], budgets.data_ptr(),
                                        keep.data_ptr(), torch.get_num_threads()):
        raise MemoryError("the top-p kernel could not allocate its per-thread scratch memory")
    return keep


def draw_tokens(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor | None:
    """Per row of `logprobs` `[rows, vocab]` (fp32, CPU), the token its float64 uniform in [0, 1) draws by inverse CDF
    over whole units of 2^-40 (csrc/draw.c; sampler.inverse_cdf defines the rule); None where the kernel cannot serve
    the call."""
    if logprobs.dim() != 2 or logprobs.dtype != torch.float32 or logprobs.device.type != "cpu" \
            or load_kernel() is None:
        return None
    if uniforms.dtype != torch.float64 or uniforms.shape != (logprobs.shape[0],) or uniforms.device.type != "cpu":
        raise ValueError(f"draw_tokens takes one float64 CPU uniform per row ({logprobs.shape[0]}), got "
                         f"{uniforms.dtype} {tuple(uniforms.shape)} on {uniforms.device}")
    logprobs, uniforms = logprobs.contiguous(), uniforms.contiguous()
    out = torch.empty(logprobs.shape[0], dtype=torch.int64)
    if load_kernel().rollout_draw_tokens(logprobs.data_ptr(), logprobs.shape[0], logprobs.shape[1],
                                         uniforms.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("the draw kernel could not allocate its per-thread scratch memory")
    return out
