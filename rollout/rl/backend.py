"""RolloutBackend: what a trainer holds to generate its rollouts, whatever runs them.

`RolloutGenerator` (an engine in this process), `rollout.distributed.RolloutPool` (engines on Ray) and
`rollout.distributed.RolloutServerPool` (`rollout serve` processes) all implement it, so the trainers hold one
backend and read its capabilities instead of branching on its type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from rollout.rl.batch import Prompt, RolloutBatch
from rollout.sampling_params import SamplingParams


@runtime_checkable
class RolloutBackend(Protocol):
    """Groups of n samples with the logprob contract, versioned weight updates, and what the backend can carry."""

    # One backend serves every data-parallel process (its servers are shared): only the main process sends weights.
    shared_by_processes: bool
    # generate(keep_kv=True, continues=...) carries conversations' KV across calls.
    keeps_kv: bool

    @property
    def weight_version(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype | None:
        """The weights' dtype where the backend can tell (None: it runs elsewhere and cannot be checked)."""

    def check_sampling(self, params: SamplingParams) -> None:
        """ValueError naming every setting this backend cannot apply (before anything is submitted)."""

    def generate(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
                 sampling_params: SamplingParams | None = None) -> RolloutBatch: ...

    def update_weights(self, source, on_update: str = "keep") -> int: ...
