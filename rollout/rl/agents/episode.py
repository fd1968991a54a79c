"""Episode and EpisodeBatch: what a multi-turn rollout hands a trainer.

An episode is one token sequence: the prompt, then model turns and environment turns in order. The trainer scores
exactly `token_ids` (the tokens the model saw, never re-tokenized) and takes the loss on `model_mask == 1` only; the
per-token RL contract (logprobs, policy_logprobs, kept_logmass, weight_versions; see RolloutSample) covers the model's
tokens, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.rl.batch import RolloutBatch, RolloutSample

FINISH_REASONS = ("done", "max_turns", "length", "error")


@dataclass
class TurnSpan:
    """Where one turn lies in `Episode.token_ids`: the model's tokens, then the environment's answer."""

    start: int  # first model token
    model_end: int  # model tokens: token_ids[start:model_end]
    end: int  # environment tokens: token_ids[model_end:end] (empty when the episode ended on this turn)
    finish_reason: str  # the model turn's: "stop" or "length"
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)  # the environment's EnvResponse.info


@dataclass
class Episode:
    """One finished episode. `finish_reason`: "done" (the environment ended it), "max_turns", "length" (no room left
    for another turn under max_length), or "error" (`error` says what failed: the environment, its timeout, or the
    engine)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]  # prompt, then every turn
    model_mask: list[int]  # per token of token_ids: 1 where the model produced it
    logprobs: list[float]  # per model token, in order (see RolloutSample for the three logprob fields)
    policy_logprobs: list[float]
    kept_logmass: list[float]
    weight_versions: list[int]
    turns: list[TurnSpan]
    rewards: list[float]  # one per environment answer
    finish_reason: str
    error: str | None = None
    seconds: float = 0.0  # from the start of the call until this episode ended

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its rewards."""
        return float(sum(self.rewards))

    @property
    def completion_ids(self) -> list[int]:
        """Everything after the prompt: model and environment tokens."""
        return self.token_ids[len(self.prompt_ids):]

    @property
    def completion_mask(self) -> list[int]:
        """`model_mask` over `completion_ids`."""
        return self.model_mask[len(self.prompt_ids):]

    def dense(self, values: list, fill=0) -> list:
        """Per-model-token `values` spread over `completion_ids` (`fill` at environment tokens)."""
        it = iter(values)
        return [next(it) if m else fill for m in self.completion_mask]

    def as_sample(self) -> RolloutSample:
        """The episode as one RolloutSample: completion = every token after the prompt, per-token fields dense."""
        return RolloutSample(
            prompt_index=self.prompt_index, prompt_ids=self.prompt_ids, completion_ids=self.completion_ids,
            logprobs=self.dense(self.logprobs, 0.0), policy_logprobs=self.dense(self.policy_logprobs, 0.0),
            kept_logmass=self.dense(self.kept_logmass, 0.0), weight_versions=self.dense(self.weight_versions, 0),
            finish_reason=self.finish_reason)


@dataclass
class EpisodeBatch:
    """Episodes in prompt-major order (the n episodes of prompt 0, then prompt 1, ...), each prompt's a group."""

    episodes: list[Episode]
    group_sizes: list[int]
    stats: dict = field(default_factory=dict)  # the call's EngineStats window plus episode and environment figures

    def __len__(self) -> int:
        return len(self.episodes)

    def group(self, prompt_index: int) -> list[Episode]:
        start = sum(self.group_sizes[:prompt_index])
        return self.episodes[start:start + self.group_sizes[prompt_index]]

    def as_rollout_batch(self) -> RolloutBatch:
        """The same episodes as a RolloutBatch (completions include environment tokens; see `Episode.as_sample`)."""
        return RolloutBatch([e.as_sample() for e in self.episodes], list(self.group_sizes), dict(self.stats))

    def to_tensors(self, pad_token_id: int = 0, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """RolloutBatch.to_tensors' keys (completion = everything after the prompt, environment tokens included;
        per-token fields 0 at environment tokens) plus `model_mask` (b, completion): the loss mask, 1 at model
        tokens; and `rewards` (b,): each episode's return."""
        out = self.as_rollout_batch().to_tensors(pad_token_id)
        mask = torch.zeros_like(out["completion_mask"])
        for i, e in enumerate(self.episodes):
            if e.completion_mask:
                mask[i, :len(e.completion_mask)] = torch.tensor(e.completion_mask)
        out["model_mask"] = mask
        out["rewards"] = torch.tensor([e.reward for e in self.episodes], dtype=torch.float32)
        return {k: v.to(device) for k, v in out.items()} if device is not None else out
