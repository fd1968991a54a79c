"""What a rollout call returns: samples with their per-token logprob contract and weight versions, grouped by
prompt, and the padded tensors a trainer consumes. Plain data: every backend (in process, servers, Ray) builds these.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Prompt = Sequence[int] | str | list[dict]


@dataclass
class RolloutSample:
    """One completion, with everything a policy-gradient trainer needs per token."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]  # the stop token (eos / stop id) included when generation stopped on it
    logprobs: list[float]  # under the distribution actually sampled from (after processors and truncation)
    policy_logprobs: list[float]  # fp32 log_softmax(logits / T) over the full vocabulary
    kept_logmass: list[float]  # log of the mass masks and truncation kept: logprobs = policy_logprobs - kept_logmass
    weight_versions: list[int]  # weight version that produced each token
    finish_reason: str
    text: str | None = None
    sequence_id: str | None = None  # the engine sequence: what `continues` names when its KV was kept (keep_kv)


@dataclass
class RolloutBatch:
    """Samples in prompt-major order: the n samples of prompt 0, then those of prompt 1, ..."""

    samples: list[RolloutSample]
    group_sizes: list[int]
    stats: dict = field(default_factory=dict)  # this call's EngineStats window (as_dict) + seconds, tokens_per_second

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def n(self) -> int:
        """Samples per prompt (0 if groups differ in size)."""
        sizes = set(self.group_sizes)
        return sizes.pop() if len(sizes) == 1 else 0

    def group(self, prompt_index: int) -> list[RolloutSample]:
        start = sum(self.group_sizes[:prompt_index])
        return self.samples[start:start + self.group_sizes[prompt_index]]

    def to_tensors(self, pad_token_id: int = 0, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Padded tensors for a trainer: prompts left-padded, completions right-padded, with masks.

        Keys: prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, policy_logprobs, kept_logmass,
        weight_versions (padded positions hold 0 and are masked out).
        """
        b = len(self.samples)
        lp = max(len(s.prompt_ids) for s in self.samples)
        lc = max(1, max(len(s.completion_ids) for s in self.samples))
        out = {
            "prompt_ids": torch.full((b, lp), pad_token_id, dtype=torch.long),
            "prompt_mask": torch.zeros(b, lp, dtype=torch.long),
            "completion_ids": torch.full((b, lc), pad_token_id, dtype=torch.long),
            "completion_mask": torch.zeros(b, lc, dtype=torch.long),
            "logprobs": torch.zeros(b, lc),
            "policy_logprobs": torch.zeros(b, lc),
            "kept_logmass": torch.zeros(b, lc),
            "weight_versions": torch.zeros(b, lc, dtype=torch.long),
        }
        for i, s in enumerate(self.samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            out["prompt_ids"][i, lp - p:] = torch.tensor(s.prompt_ids)
            out["prompt_mask"][i, lp - p:] = 1
            if c:
                out["completion_ids"][i, :c] = torch.tensor(s.completion_ids)
                out["completion_mask"][i, :c] = 1
                out["logprobs"][i, :c] = torch.tensor(s.logprobs)
                out["policy_logprobs"][i, :c] = torch.tensor(s.policy_logprobs)
                out["kept_logmass"][i, :c] = torch.tensor(s.kept_logmass)
                out["weight_versions"][i, :c] = torch.tensor(s.weight_versions)
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


def group_sizes(n: int | Sequence[int], count: int) -> list[int]:
    """One group size per prompt, each an int >= 1; ValueError naming the bad value and its prompt otherwise."""
    if isinstance(n, numbers.Integral) and not isinstance(n, bool):
        if n < 1:
            raise ValueError(f"n must be >= 1 (samples per prompt), got {n}")
        return [int(n)] * count
    if isinstance(n, (str, bytes)) or not isinstance(n, Sequence):
        raise ValueError(f"n must be an int >= 1 or one int >= 1 per prompt, got {n!r}")
    if len(n) != count:
        raise ValueError(f"n has {len(n)} values for {count} prompts; pass one int, or exactly one per prompt")
    for j, k in enumerate(n):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"n[{j}] (the group size of prompt {j}) must be an int >= 1, got {k!r}")
    return [int(k) for k in n]
