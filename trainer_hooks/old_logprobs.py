"""When the engine's policy logprobs can stand in for TRL's old-logprob pass, and handing them to TRL.

TRL runs our trainers in its vLLM mode, where it recomputes `old_per_token_logps` with an extra forward over the
generation batch for its importance-sampling correction. The engine computed exactly those (fp32 log_softmax of the
same weights) while sampling, so when nothing differs between the two sides the pass is skipped and TRL's ratio is 1.
"""

from __future__ import annotations

import torch

from rollout.rl.batch import RolloutSample
from rollout.sampling_params import SamplingParams
from trainer_hooks.sync import unwrap


def inexact_reason(trainer, params: SamplingParams, engine_dtype: torch.dtype | None) -> str | None:
    """Why the engine's policy logprobs cannot stand in for TRL's recompute in this setup (None: they can).

    Exact means: the same weights in the same precision (fp32 or fp64: in half precision the engine's and the
    trainer's kernels round differently, by ~1e-2 in log space, which TRL's correction is there to absorb), the
    same policy (no repetition penalty), and old logprobs that are only ever compared with the optimizer step
    they were generated for.
    """
    args = trainer.args
    if engine_dtype is None:
        return "the engine runs in a separate `rollout serve` process whose precision this trainer cannot check"
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        return "tool calls append tokens the engine did not score"
    if getattr(trainer, "rollout_func", None) is not None:
        return "a custom rollout_func generates outside the engine"
    if getattr(trainer, "num_iterations", 1) != 1:
        return f"num_iterations={trainer.num_iterations} reuses each generation for several optimizer steps"
    if args.steps_per_generation > args.gradient_accumulation_steps:
        return (f"steps_per_generation={args.steps_per_generation} > gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps} reuses generations across optimizer steps")
    if (params.repetition_penalty or 1.0) != 1.0:
        return f"repetition_penalty={params.repetition_penalty} changes the sampling policy"
    if params.do_sample is False or params.temperature != trainer.temperature:
        return (f"the engine samples at temperature {params.temperature} (do_sample={params.do_sample}), TRL "
                f"scores at {trainer.temperature}")
    if trainer.accelerator.mixed_precision != "no":
        return f"the trainer computes under {trainer.accelerator.mixed_precision} autocast"
    trained = _dtype(unwrap(trainer.model))
    engine = engine_dtype
    if engine != trained:
        return f"the engine runs in {engine}, the trainer in {trained}"
    if engine not in (torch.float32, torch.float64):
        return f"{engine} on both sides: the engine's and the trainer's kernels round differently"
    if _dropout_active(unwrap(trainer.model)):
        return "dropout is active in the trainer's forward"
    return None


def _dtype(model: torch.nn.Module) -> torch.dtype | None:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _dropout_active(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


class PendingOldLogps:
    """One generation batch's engine logprobs, waiting for the old-logprob pass TRL runs right after generation."""

    def __init__(self, samples: list[RolloutSample], use_engine: bool, reason: str) -> None:
        self.samples = samples
        self.use_engine = use_engine
        self.reason = reason

    def as_old_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     logits_to_keep: int) -> torch.Tensor | None:
        """TRL's (batch, logits_to_keep) old logprobs, 0 where TRL masks, or None if TRL's batch is not this one."""
        rows = len(self.samples)
        lengths = torch.tensor([len(s.completion_ids) for s in self.samples], dtype=torch.long)
        if input_ids.size(0) != rows or max(lengths.tolist(), default=0) > logits_to_keep:
            return None
        filled = torch.arange(logits_to_keep)[None, :] < lengths[:, None]
        ids = torch.tensor([t for s in self.samples for t in s.completion_ids], dtype=torch.long)
        if not torch.equal(input_ids[:, -logits_to_keep:].cpu()[filled], ids):
            return None
        logps = torch.zeros(rows, logits_to_keep, dtype=torch.float32)
        logps[filled] = torch.tensor([lp for s in self.samples for lp in s.policy_logprobs], dtype=torch.float32)
        # TRL's forward scores 0 wherever the attention mask is 0 (padding, masked truncated completions).
        logps.masked_fill_(attention_mask[:, -logits_to_keep:].cpu() == 0, 0.0)
        return logps.to(input_ids.device)
