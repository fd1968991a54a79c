"""ContinuousBatchingConfig: the hardware-centric knobs (memory, scheduling, kernels).

Model-centric settings (sampling, stopping) live in `GenerationConfig` / `SamplingParams`; this object only says how
the engine may use the machine. Defaults and validation follow transformers' `ContinuousBatchingConfig`, so a
transformers user can pass the same arguments.
"""

from __future__ import annotations

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
DEFAULT_MAX_REQUESTS = 1024
# On CPU the KV cache lives in the same RAM as everything else: without a workload hint the pool is capped here so a
# small model does not reserve gigabytes for a handful of requests.
CPU_DEFAULT_CACHE_BYTES = 512 * 1024**2
CPU_DEFAULT_CACHE_TOKENS = 65536


@dataclass
class ContinuousBatchingConfig:
    """How the engine uses memory and schedules work. All fields are optional; `None` means "infer"."""

    page_size: int = 256
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
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    use_async_batching: bool | None = None
    default_compile_level: int = 0
    cpu_group_timeout: float | None = 300.0
    max_queue_size: int = 0
    per_request_processors: bool = True
    # CPU only: attend with the C kernel (rollout/engine/csrc, built with the system compiler at first use) instead of
    # page gathers + SDPA. None: the kernel when it builds (fp32/bf16 caches), else the PyTorch path.
    cpu_attention_kernel: bool | None = None
    # CPU only: run fp32/bf16 linears on oneDNN-packed weight copies (faster at every batch size; costs one extra copy
    # of the linear weights in RAM). None: on whenever the torch build has oneDNN.
    prepack_weights: bool | None = None
    # Deprecated alias of page_size, kept so transformers-style code keeps working.
    block_size: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.block_size is not None:
            warnings.warn("`block_size` is deprecated, use `page_size` instead.", FutureWarning, stacklevel=3)
            self.page_size = self.block_size
            self.block_size = None
        if not isinstance(self.page_size, int) or self.page_size < MIN_PAGE_SIZE:
            raise ValueError(f"page_size must be an integer >= {MIN_PAGE_SIZE}, got {self.page_size!r}.")
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
        if self.default_compile_level not in (0, 1, 2, 3):
            raise ValueError(f"default_compile_level must be 0, 1, 2 or 3, got {self.default_compile_level!r}.")
        if self.cpu_offload_space is not None and self.cpu_offload_space < 0:
            raise ValueError(f"cpu_offload_space must be >= 0 GiB or None, got {self.cpu_offload_space!r}.")

    # ------------------------------------------------------------------ sizing
    def resolve_batch_tokens(self, device: torch.device) -> int:
        """Token budget per forward: the user's value as given, else the default capped by free memory (>= 256)."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        if device.type == "cuda":  # keep the activations of one step well inside free memory
            per_token = 64 * 1024  # bytes of activations per token, a conservative bound for mid-size models
            cap = int(_free_memory_bytes(device) * 0.05 // per_token)
            return max(MIN_BATCH_TOKENS, min(DEFAULT_BATCH_TOKENS, cap))
        return DEFAULT_BATCH_TOKENS

    def resolve_num_blocks(
        self, bytes_per_block: int, device: torch.device, tokens_hint: int | None = None
    ) -> int:
        """Number of KV blocks: explicit, or sized for the known workload, capped by the memory budget."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = _free_memory_bytes(device) * (self.max_memory_percent or 0.8)
        if device.type == "cpu" and tokens_hint is None:
            budget = min(budget, CPU_DEFAULT_CACHE_BYTES,
                         CPU_DEFAULT_CACHE_TOKENS * bytes_per_block // self.page_size)
        max_blocks = max(1, int(budget // bytes_per_block))
        if tokens_hint is not None:
            wanted = math.ceil(tokens_hint / self.page_size) + 1
            return max(1, min(wanted, max_blocks))
        return max_blocks


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        import os

        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
