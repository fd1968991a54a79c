"""The policy-gradient pieces a hand-written loop needs on top of a RolloutBatch: per-token logprobs of the
completions under the trained model, group-normalised advantages, and the GRPO loss with off-policy correction.

The correction follows decoupled PPO: the engine's `policy_logprobs` are the behaviour policy (the weights that
sampled each token, possibly a few versions old), the trained model at the start of the step is the proximal policy,
and each token's importance weight exp(proximal - behaviour) is truncated at `cap` (TRL's "token_truncate") or the
token is dropped past it ("token_mask"). With one gradient step per batch the proximal policy is the model itself,
so PPO's clipped ratio is 1 and only the importance weight remains.
"""

from __future__ import annotations

import torch

IS_MODES = ("token_truncate", "token_mask")


def completion_logprobs(model, tensors: dict, temperature: float) -> torch.Tensor:
    """Per-token log_softmax(logits / T) of the completion tokens under `model` (what the engine calls policy), for
    the padded tensors of `RolloutBatch.to_tensors`."""
    ids = torch.cat([tensors["prompt_ids"], tensors["completion_ids"]], dim=1)
    mask = torch.cat([tensors["prompt_mask"], tensors["completion_mask"]], dim=1)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = tensors["completion_ids"].shape[1]
    logits = logits[:, -width - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, tensors["completion_ids"][..., None]).squeeze(-1)


def group_advantages(rewards: torch.Tensor, group_sizes: list[int], eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation."""
    out = []
    for group in torch.split(rewards.float(), group_sizes):
        std = group.std() if len(group) > 1 else torch.zeros(())
        out.append((group - group.mean()) / (std + eps))
    return torch.cat(out)


def decoupled_grpo_loss(logps: torch.Tensor, behaviour_logps: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cap: float = 2.0, mode: str = "token_truncate"
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean GRPO loss for one gradient step, importance-corrected for tokens sampled by older weights.

    `logps` (with grad) and `behaviour_logps` are [rows, tokens]; `advantages` one per row; `mask` marks real
    completion tokens. Returns the loss and the IS statistics (mean/max ratio, fraction of tokens clipped or
    masked)."""
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1 (the importance weight's upper bound), got {cap!r}")
    mask = mask.float()
    proximal = logps.detach()
    ratio = torch.exp(proximal - behaviour_logps)
    over = (ratio > cap).float() * mask
    weight = ratio.clamp(max=cap) if mode == "token_truncate" else ratio * (ratio <= cap)
    per_token = -weight * torch.exp(logps - proximal) * advantages[:, None]
    tokens = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / tokens
    real = ratio[mask.bool()]
    stats = {"is_ratio/mean": float(real.mean()) if real.numel() else 1.0,
             "is_ratio/max": float(real.max()) if real.numel() else 1.0,
             "is_ratio/min": float(real.min()) if real.numel() else 1.0,
             "is_ratio/p99": float(torch.quantile(real, 0.99)) if real.numel() else 1.0,
             "clipped_fraction" if mode == "token_truncate" else "masked_fraction": float(over.sum() / tokens)}
    return loss, stats
