"""ContinuousBatchingConfig: the hardware-centric knobs (memory, scheduling, kernels).

Model-centric settings (sampling, stopping) live in `GenerationConfig` / `SamplingParams`; this object only says how
the engine may use the machine. Defaults and validation follow transformers' `ContinuousBatchingConfig`, so a
transformers user can pass the same arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

SCHEDULER_TYPES = ("fifo", "prefill_first")
DEFAULT_SAFETY_MARGIN = {"fifo": 0.15, "prefill_first": 0.0}
MIN_PAGE_SIZE = 4
MIN_BATCH_TOKENS = 256
DEFAULT_BATCH_TOKENS = 8192
# CPU: small steps let a wave of arrivals start in turns and put decode rows beside prefill chunks, where they cost
# little (a step of decodes alone reads all the weights for a few rows): a server's closed loop of 64 streams gets more
# tokens per second and its first tokens sooner with smaller budgets, and W1 itself is the same at any of them
# (benchmarks/RESULTS.md, "Serving").
CPU_DEFAULT_BATCH_TOKENS = 512
DEFAULT_MAX_REQUESTS = 1024
DEFAULT_MEMORY_PERCENT = 0.8  # share of usable memory the KV cache may take when max_memory_percent is unset
# Headroom kept beside the cache for one step: activations per token of max_batch_tokens (a conservative bound for
# mid-size models) and, per logit of up to max_requests_per_batch sampled rows, the logits, their fp32 copy and the
# sampler's work.
ACTIVATION_BYTES_PER_TOKEN = 64 * 1024
LOGIT_BYTES = 12
# Without a workload hint (and without max_memory_percent) the pool is capped by a token budget and a byte budget, so a
# default engine does not take memory that others need. CPU: the cache lives in the same RAM as everything else, so a
# small model does not reserve gigabytes for a handful of requests. CUDA: the GPU is often shared with a trainer,
# whose first optimizer step must still fit; the byte budget is a share of the device's total memory.
CPU_DEFAULT_CACHE_BYTES = 512 * 1024**2
CPU_DEFAULT_CACHE_TOKENS = 65536
CUDA_DEFAULT_CACHE_FRACTION = 0.25
CUDA_DEFAULT_CACHE_TOKENS = 262144
# Tokens per KV page when `page_size` is left unset, per device type. CPU: small pages waste less of the last page per
# sequence and keep the attention kernel's per-page loop short; on W1 16, 32 and 64 are within noise of each other
# while 256 is slower and takes more memory, on AVX-512 and AVX2 machines alike (benchmarks/RESULTS.md, "Page size";
# AVX2: results-history.md). CUDA: the page flash-attn's paged kernels need when they serve the cache (flash-attn
# importable, fp16/bf16); without them the SDPA path gathers whole pages per decode row, so small pages read less.
DEFAULT_PAGE_SIZE = {"cpu": 32, "cuda": 16}
FLASH_PAGE_SIZE = 256
FALLBACK_PAGE_SIZE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# torch.compile of the engine's forward (rollout/engine/worker/compiled_forward.py): the keywords a compile config
# may hold, and what each default_compile_level means (as in transformers).
COMPILE_KEYS = ("mode", "dynamic", "fullgraph", "options", "backend")
MAX_COMPILE_LEVEL = 3

# Fields transformers' ContinuousBatchingConfig has and this engine does not implement (yet): name -> (the only value
# accepted, why). Kept so the same arguments construct; anything else raises instead of being ignored.
UNIMPLEMENTED_FIELDS: dict[str, tuple[object, str]] = {
    "use_cuda_graph": (None, "CUDA graphs are not implemented"),
    "use_async_batching": (None, "asynchronous batching is not implemented"),
    "max_queue_size": (0, "the request queue is unbounded"),
    "per_request_processors": (True, "per-request settings are always honoured"),
}


@dataclass
class ContinuousBatchingConfig:
    """How the engine uses memory and schedules work. All fields are optional; `None` means "infer"."""

    page_size: int | None = None  # None: default_page_size for the model's device, dtype and kernels
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    # Compiled steps only (see default_compile_level): each step's token count padded to a bucket, the next power of
    # two up to this, then a multiple of it (0: none, or 64 on a static path); the block table's width padded up to a
    # multiple of this many tokens (0: none).
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    use_async_batching: bool | None = None
    # Compiled forward (CPU; see README "Compile levels"). 0: eager; 1: torch.compile mode "default", dynamic shapes;
    # 2: "max-autotune-no-cudagraphs", dynamic; 3: "max-autotune-no-cudagraphs", static token counts padded to
    # buckets. varlen_compile_config / decode_compile_config (at the end: dicts of torch.compile keywords, or
    # transformers' CompileConfig) override it for mixed/prefill steps and for decode-only steps.
    default_compile_level: int = 0
    cpu_group_timeout: float | None = 300.0
    max_queue_size: int = 0
    per_request_processors: bool = True
    # CPU only: attend with the C kernel (rollout/engine/cpu/csrc, built with the system compiler at first use)
    # instead of page gathers + SDPA. None: the kernel when it builds (fp32/bf16 caches), else the PyTorch path.
    cpu_attention_kernel: bool | None = None
    # CPU only: run fp32/bf16 linears on prepacked weight copies (oneDNN's; for fp32 MKL's where timed faster; faster
    # except at steps of a few rows, which keep F.linear or a C kernel; costs one extra copy of the linear weights in
    # RAM).
    # None: packs the dtypes this CPU and torch build support (bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    # elsewhere bf16 keeps F.linear, same tokens). True: error if the model's dtype cannot be packed here.
    prepack_weights: bool | None = None
    # CPU only: intra-op threads of an engine step. None: the stepping thread's own count (torch.set_num_threads of
    # the thread that steps; the manager's loop adopts its last submitter's). An int: that many. "auto": at most the
    # stepping thread's count, fewer while other processes keep this process's cores busy (spinning OpenMP workers
    # on shared cores cost an order of magnitude; see rollout/engine/cpu/core_budget.py). `rollout serve` uses "auto".
    cpu_threads: int | str | None = None
    # Deprecated alias of page_size, kept so transformers-style code keeps working.
    block_size: int | None = field(default=None, repr=False)
    # torch.compile keywords (mode, dynamic, fullgraph, options, backend) for mixed/prefill steps and for decode-only
    # steps; None: those default_compile_level implies (None at level 0: eager).
    varlen_compile_config: dict | None = None
    decode_compile_config: dict | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None:
            warnings.warn("`block_size` is deprecated, use `page_size` instead.", FutureWarning, stacklevel=3)
            self.page_size = self.block_size
            self.block_size = None
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < MIN_PAGE_SIZE):
            raise ValueError(f"page_size must be an integer >= {MIN_PAGE_SIZE} or None (the device's default), "
                             f"got {self.page_size!r}.")
        if self.scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"scheduler_type must be one of {SCHEDULER_TYPES}, got {self.scheduler_type!r}.")
        if self.safety_margin is None:
            self.safety_margin = DEFAULT_SAFETY_MARGIN[self.scheduler_type]
        if not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(f"safety_margin must be in [0, 1), got {self.safety_margin!r}.")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}.")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens!r}.")
        if self.max_requests_per_batch is not None and self.max_requests_per_batch < 1:
            raise ValueError(f"max_requests_per_batch must be >= 1, got {self.max_requests_per_batch!r}.")
        if self.max_memory_percent is not None and not 0.0 < self.max_memory_percent <= 1.0:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent!r}.")
        if self.cpu_threads is not None and self.cpu_threads != "auto" and (
                isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be None (the stepping thread's own count), 'auto' (fewer while other "
                             f"processes keep the cores busy) or an integer >= 1, got {self.cpu_threads!r}.")
        blocks = self.max_blocks_per_request
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0):
            raise ValueError(f"max_blocks_per_request must be None (any table width), 0 (no decode fast path) or a "
                             f"positive number of blocks, got {self.max_blocks_per_request!r}.")
        timeout = self.cpu_group_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"cpu_group_timeout must be the seconds a tensor-parallel collective may block (> 0) or "
                             f"None (no bound), got {timeout!r}.")
        self._check_offload()
        self._check_compile()
        self._reject_unimplemented()

    def _check_offload(self) -> None:
        space, share = self.cpu_offload_space, self.cpu_offload_space_safety_threshold
        if space is not None and (isinstance(space, bool) or not isinstance(space, (int, float)) or space < 0):
            raise ValueError(f"cpu_offload_space must be the CPU swap space in GiB (>= 0; 0 turns offloading off) or "
                             f"None (sized from cpu_offload_space_safety_threshold of available RAM), got {space!r}.")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise ValueError(f"cpu_offload_space_safety_threshold must be a fraction of available RAM in (0, 1], "
                             f"got {share!r}.")

    def resolve_fast_path_blocks(self, flash: bool, sliding: bool) -> int | None:
        """`max_blocks_per_request` as the engine applies it: the widest block table a decode-only step may have to
        take flash-attn's `flash_attn_with_kvcache` (None: any; 0: every step takes the varlen kernel). Forced to 0
        for a model with sliding layers, as in transformers; without flash-attn on CUDA there is no such fast path
        (the CPU kernel and the PyTorch path read block tables of any width in every step), so an explicit value only
        logs that it has no effect."""
        if not flash:
            if self.max_blocks_per_request is not None:
                logger.warning("max_blocks_per_request=%d has no effect: it sizes the decode fast path of flash-attn's "
                               "flash_attn_with_kvcache, used only on CUDA with flash-attn installed; here every step "
                               "reads block tables of any width", self.max_blocks_per_request)
            return None
        if sliding:
            logger.info("the decode fast path is off (max_blocks_per_request=0): some of the model's attention types "
                        "(sliding windows) do not support kernel block tables%s",
                        f"; the {self.max_blocks_per_request} set is ignored" if self.max_blocks_per_request else "")
            return 0
        return self.max_blocks_per_request

    def resolve_swap_blocks(self, bytes_per_block: int, cache_bytes_in_ram: int = 0) -> int:
        """Blocks of the CPU swap space (0: offloading off): `cpu_offload_space` GiB, never more than
        `cpu_offload_space_safety_threshold` of the RAM available (less a CPU cache's own bytes, which the OS may not
        have mapped yet); all of that share when `cpu_offload_space` is None."""
        if self.cpu_offload_space == 0:
            return 0
        available = max(0, _memory_bytes(torch.device("cpu"))[0] - cache_bytes_in_ram)
        cap = available * self.cpu_offload_space_safety_threshold
        wanted = cap if self.cpu_offload_space is None else self.cpu_offload_space * 2**30
        if wanted > cap:
            logger.warning("CPU offload: %.2f GiB asked for, but %.0f%% of the %.2f GiB of RAM available is %.2f GiB; "
                           "using that", wanted / 2**30, self.cpu_offload_space_safety_threshold * 100,
                           available / 2**30, cap / 2**30)
        blocks = int(min(wanted, cap) // bytes_per_block)
        logger.info("CPU offload: a swap space of %d blocks (%.1f MiB)", blocks, blocks * bytes_per_block / 2**20)
        return blocks

    def _check_compile(self) -> None:
        level = self.default_compile_level
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_COMPILE_LEVEL:
            raise ValueError(f"default_compile_level must be an integer from 0 (eager) to {MAX_COMPILE_LEVEL}, got "
                             f"{level!r}.")
        for name in ("q_padding_interval_size", "kv_padding_interval_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: no padding), got {value!r}.")
        self.varlen_compile_config = check_compile_config("varlen_compile_config", self.varlen_compile_config)
        self.decode_compile_config = check_compile_config("decode_compile_config", self.decode_compile_config)
        if (self.q_padding_interval_size or self.kv_padding_interval_size) and self.compile_configs() == (None, None):
            raise ValueError("q_padding_interval_size and kv_padding_interval_size pad the steps of the compiled "
                             "forward so their shapes repeat; with default_compile_level=0 and no compile config "
                             "nothing is compiled. Set default_compile_level (1-3) or leave the padding at 0.")

    def compile_configs(self) -> tuple[dict | None, dict | None]:
        """torch.compile keywords for (mixed/prefill steps, decode-only steps): the explicit config, else the one
        default_compile_level implies; None runs that path eagerly."""
        default = level_compile_config(self.default_compile_level)
        return (self.varlen_compile_config if self.varlen_compile_config is not None else default,
                self.decode_compile_config if self.decode_compile_config is not None else default)

    def _reject_unimplemented(self) -> None:
        """transformers' fields that this engine does not implement are accepted only at their defaults: a setting
        that would silently do nothing is an error."""
        for name, (default, what) in UNIMPLEMENTED_FIELDS.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(f"ContinuousBatchingConfig.{name}={value!r} is not supported: {what}. Remove it or "
                                 f"leave it at its default ({default!r}).")

    # ------------------------------------------------------------------ sizing
    def for_device(self, device: torch.device, dtype: torch.dtype | None = None,
                   flash_attn: bool = False) -> ContinuousBatchingConfig:
        """A copy with every device-dependent default resolved (the caller's object is left as given).
        `flash_attn`: whether flash-attn imports in this process (the engine passes what its worker found)."""
        if self.page_size is not None:
            return self
        return dataclasses.replace(self, page_size=default_page_size(device, dtype, flash_attn))

    def resolve_batch_tokens(self, device: torch.device) -> int:
        """Token budget per forward: the user's value as given, else the default capped by free memory (>= 256)."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        if device.type == "cuda":  # keep the activations of one step well inside free memory
            cap = int(_memory_bytes(device)[0] * 0.05 // ACTIVATION_BYTES_PER_TOKEN)
            return max(MIN_BATCH_TOKENS, min(DEFAULT_BATCH_TOKENS, cap))
        return CPU_DEFAULT_BATCH_TOKENS if device.type == "cpu" else DEFAULT_BATCH_TOKENS

    def resolve_num_blocks(self, bytes_per_block: int, device: torch.device, tokens_hint: int | None = None,
                           batch_tokens: int | None = None, vocab_size: int = 0) -> int:
        """Number of KV blocks: `num_blocks` as given; else what the workload hint needs, or without one the device's
        default budget, never more than `max_memory_percent` of usable memory nor than what leaves a step's
        activations room (a cache that fills the device fails the first step, or the trainer's beside it)."""
        if self.num_blocks is not None:
            logger.info("KV cache: %d blocks of %d tokens (num_blocks)", self.num_blocks, self.page_size)
            return self.num_blocks
        usable, total = _memory_bytes(device)
        batch_tokens = batch_tokens or self.resolve_batch_tokens(device)
        rows = min(batch_tokens, self.max_requests_per_batch or DEFAULT_MAX_REQUESTS)
        headroom = batch_tokens * ACTIVATION_BYTES_PER_TOKEN + rows * vocab_size * LOGIT_BYTES
        share = self.max_memory_percent or DEFAULT_MEMORY_PERCENT
        budgets = [(usable * share, f"{share:.0%} of {usable / 2**30:.1f} GiB usable"),
                   (usable - headroom, f"{usable / 2**30:.1f} GiB usable less {headroom / 2**30:.2f} GiB for a step")]
        per_token = bytes_per_block / self.page_size
        if tokens_hint is not None:
            budgets.append(((math.ceil(tokens_hint / self.page_size) + 1) * bytes_per_block,
                            f"the workload hint of {tokens_hint} tokens"))
        elif self.max_memory_percent is None and device.type == "cpu":
            budgets += [(CPU_DEFAULT_CACHE_BYTES, f"the CPU default of {CPU_DEFAULT_CACHE_BYTES // 2**20} MiB"),
                        (CPU_DEFAULT_CACHE_TOKENS * per_token, f"the CPU default of {CPU_DEFAULT_CACHE_TOKENS} tokens")]
        elif self.max_memory_percent is None and device.type == "cuda":
            budgets += [(total * CUDA_DEFAULT_CACHE_FRACTION,
                         f"the CUDA default of {CUDA_DEFAULT_CACHE_FRACTION:.0%} of {total / 2**30:.1f} GiB"),
                        (CUDA_DEFAULT_CACHE_TOKENS * per_token,
                         f"the CUDA default of {CUDA_DEFAULT_CACHE_TOKENS} tokens")]
        budget, reason = min(budgets, key=lambda b: b[0])
        blocks = int(budget // bytes_per_block)
        if blocks < 1:
            logger.warning("KV cache: no memory left for it (%s); using 1 block: set num_blocks or free memory", reason)
            return 1
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), from %s", blocks, self.page_size,
                    blocks * bytes_per_block / 2**20, reason)
        return blocks


def default_page_size(device: torch.device, dtype: torch.dtype | None, flash_attn: bool) -> int:
    """Tokens per page when `page_size` is unset: flash-attn's page on CUDA where its kernels can serve the cache,
    else the device's small page."""
    if device.type == "cuda" and flash_attn and dtype in FLASH_DTYPES:
        return FLASH_PAGE_SIZE
    return DEFAULT_PAGE_SIZE.get(device.type, FALLBACK_PAGE_SIZE)


def level_compile_config(level: int) -> dict | None:
    """The torch.compile keywords a default_compile_level stands for (None for 0: eager)."""
    if level == 0:
        return None
    return {"mode": "default" if level == 1 else "max-autotune-no-cudagraphs", "dynamic": level <= 2,
            "fullgraph": False}


def check_compile_config(name: str, value: object) -> dict | None:
    """A compile config as a plain dict (transformers' CompileConfig is converted), or ValueError saying what is
    wrong with it and what is accepted."""
    if value is None:
        return None
    if hasattr(value, "to_dict") and not isinstance(value, dict):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be None (from default_compile_level) or a dict of torch.compile keywords "
                         f"({', '.join(COMPILE_KEYS)}), got {value!r}.")
    unknown = sorted(set(value) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}: use only torch.compile keywords "
                         f"({', '.join(COMPILE_KEYS)}).")
    modes = tuple(torch._inductor.list_mode_options())
    if value.get("mode") is not None and value["mode"] not in modes:
        raise ValueError(f"{name}['mode']={value['mode']!r} is not a torch.compile mode; use one of {modes}.")
    if value.get("dynamic") not in (None, True, False):
        raise ValueError(f"{name}['dynamic'] must be True (dynamic shapes), False (static, padded) or None (torch "
                         f"decides), got {value['dynamic']!r}.")
    if not isinstance(value.get("fullgraph", False), bool):
        raise ValueError(f"{name}['fullgraph'] must be a bool, got {value['fullgraph']!r}.")
    if not isinstance(value.get("options") or {}, dict):
        raise ValueError(f"{name}['options'] must be a dict of inductor options, got {value['options']!r}.")
    backend = value.get("backend", "inductor")
    if not isinstance(backend, str):
        raise ValueError(f"{name}['backend'] must be the name of a torch.compile backend, got {backend!r}.")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"{name}['backend']={backend!r} is not a torch.compile backend; use one of "
                         f"{torch._dynamo.list_backends(exclude_tags=())}.")
    if backend != "inductor" and (value.get("mode") not in (None, "default") or value.get("options")):
        raise ValueError(f"{name}: mode and options are inductor settings; drop them or use backend='inductor' "
                         f"(got backend={backend!r}).")
    return dict(value)


def _memory_bytes(device: torch.device) -> tuple[int, int]:
    """(usable, total) bytes of the device's memory. On CUDA, memory torch's caching allocator holds but no tensor
    uses counts as usable: it serves this process's next allocations without asking the driver."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached)), int(total)
    try:
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        import os

        page = os.sysconf("SC_PAGE_SIZE")
        return int(os.sysconf("SC_AVPHYS_PAGES") * page), int(os.sysconf("SC_PHYS_PAGES") * page)
