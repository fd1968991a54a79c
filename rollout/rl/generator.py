"""RolloutGenerator: GRPO-style groups of samples with the logprob contract and versioned, in-place weight updates.

It wraps a ContinuousBatchingManager. The n samples of a prompt are one engine group: the prompt is prefilled once,
its full KV blocks are shared and the partial last block copied, and each sample draws with its own seed derived from
a base seed, so a batch is reproducible and independent of what else runs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.request import RequestStatus
from rollout.manager import ContinuousBatchingManager, sequence_ids
from rollout.rl.weights import WeightUpdateError, apply_staged, stage_update
from rollout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = Sequence[int] | str | list[dict]
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class RolloutSample:
    """One completion, with everything a policy-gradient trainer needs per token."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]  # the stop token (eos / stop id) included when generation stopped on it
    logprobs: list[float]  # under the truncated distribution actually sampled from
    policy_logprobs: list[float]  # fp32 log_softmax(logits / T) over the full vocabulary
    kept_logmass: list[float]  # log of the mass truncation kept: logprobs = policy_logprobs - kept_logmass
    weight_versions: list[int]  # weight version that produced each token
    finish_reason: str
    text: str | None = None


@dataclass
class RolloutBatch:
    """Samples in prompt-major order: the n samples of prompt 0, then those of prompt 1, ..."""

    samples: list[RolloutSample]
    group_sizes: list[int]
    stats: dict = field(default_factory=dict)

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


def generation_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A private copy of the trainer's model for generation.

    TRL patches `forward` onto the model *instance*, and that patched forward keeps calling the trainer's module;
    dropping the copied instance attribute makes the copy run its own weights.
    """
    gen = copy.deepcopy(model)
    if "forward" in vars(gen):
        del gen.forward
    if dtype is not None:
        gen.to(dtype)
    gen.eval()
    gen.requires_grad_(False)
    return gen


class RolloutGenerator:
    """Generates groups of completions for RL and keeps its weights in sync with a trainer.

    share_weights=True generates from `model` itself (zero copy; train it freely between calls: its attention
    implementation and train/eval mode are left as they were). Otherwise a private copy is kept, optionally in
    another dtype, and refreshed with `update_weights`.
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, share_weights: bool = False,
                 dtype: torch.dtype | None = None, generation_config: GenerationConfig | None = None,
                 seed: int | None = None) -> None:
        if share_weights and dtype is not None and dtype != next(model.parameters()).dtype:
            raise ValueError("share_weights=True generates from the trainer's own tensors; a different dtype needs a "
                             "copy: pass share_weights=False")
        self.share_weights = share_weights
        self.model = model if share_weights else generation_copy(model, dtype)
        self.tokenizer = tokenizer
        config = dataclasses.replace(continuous_batching_config or ContinuousBatchingConfig(), return_logprobs=True)
        gen_config = generation_config or getattr(model, "generation_config", None)
        self.manager = ContinuousBatchingManager(self.model, gen_config, config, tokenizer=tokenizer)
        self._rng = random.Random(seed if seed is not None else config.seed)
        self._calls = 0
        self.last_update_seconds = 0.0

    # ------------------------------------------------------------------ status
    @property
    def weight_version(self) -> int:
        return self.manager.engine.weight_version

    def stats(self) -> dict:
        return self.manager.stats()

    def close(self) -> None:
        self.manager.destroy()

    def __enter__(self) -> RolloutGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- generation
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt given as ids, text, or chat messages (chat template + generation prompt)."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("text and chat prompts need a tokenizer: RolloutGenerator(model, tokenizer=...)")
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if isinstance(prompt, torch.Tensor):
            return prompt.flatten().tolist()
        return [int(t) for t in prompt]

    def submit(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
               sampling_params: SamplingParams | None = None) -> list[tuple[int, list[int], list[str]]]:
        """Queue the prompts as n-sample groups; returns (prompt index, prompt ids, sequence ids) per prompt.

        `n` is one group size for all prompts or one per prompt.
        """
        sizes = [n] * len(prompts) if isinstance(n, int) else list(n)
        if len(sizes) != len(prompts) or any(k < 1 for k in sizes):
            raise ValueError(f"n must be >= 1 (one value, or one per prompt); got {n!r} for {len(prompts)} prompts")
        params = sampling_params or SamplingParams()
        base = params.seed if params.seed is not None else self._rng.getrandbits(62)
        self._calls += 1
        if not self.manager.is_running():
            self.manager.start()
        groups = []
        for j, prompt in enumerate(prompts):
            ids = self.encode(prompt)
            seed = hash((base, j, 0x90)) & _SEED_MASK
            rid = f"rollout{self._calls}-{j}"
            self.manager.add_request(ids, request_id=rid,
                                     sampling_params=params.with_overrides(n=sizes[j], seed=seed))
            groups.append((j, ids, sequence_ids(rid, sizes[j])))
        return groups

    def generate(self, prompts: Sequence[Prompt], n: int | Sequence[int] = 1,
                 sampling_params: SamplingParams | None = None) -> RolloutBatch:
        """n completions per prompt (or n[j] for prompt j), prompt-major. Raises ValueError if a prompt was rejected."""
        start = time.perf_counter()
        self.manager.engine.reset_peak()
        before = self.manager.stats()
        samples, errors = [], []
        groups = self.submit(prompts, n, sampling_params)
        for j, ids, seq_ids in groups:
            for rid in seq_ids:
                out = self.manager.get_result(rid)
                if out.status == RequestStatus.FAILED:
                    errors.append(out.error)
                samples.append(RolloutSample(
                    prompt_index=j, prompt_ids=ids, completion_ids=out.generated_tokens, logprobs=out.logprobs,
                    policy_logprobs=out.policy_logprobs, kept_logmass=out.kept_logmass,
                    weight_versions=out.weight_versions, finish_reason=out.finish_reason or "",
                    text=self.tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
                    if self.tokenizer is not None else None))
        if errors:
            raise ValueError(f"{len(errors)} rollout sample(s) failed; first error: {errors[0]}")
        after = self.manager.stats()
        elapsed = time.perf_counter() - start
        stats = {key: after[key] - before[key] for key in ("prefill_tokens", "decode_tokens", "generated_tokens",
                                                          "prefix_hit_tokens", "steps", "preemptions")}
        stats.update(seconds=elapsed, tokens_per_second=stats["generated_tokens"] / max(elapsed, 1e-9),
                     kv_cache_usage=after["peak_used_blocks"] / after["num_blocks"],
                     weight_version=after["weight_version"])
        return RolloutBatch(samples=samples, group_sizes=[len(g[2]) for g in groups], stats=stats)

    # ----------------------------------------------------------------- weights
    def update_weights(self, source, on_update: str = "keep") -> int:
        """Load new weights in place and bump the weight version; returns the new version.

        source: an nn.Module, a state dict, or an iterable of (name, tensor) pairs (HF names, any dtype, PEFT-merged
        names, tied weights once). Everything is validated before anything is copied: a rejected update raises
        WeightUpdateError and leaves the old weights in use. The KV cache and all engine buffers keep their storage.
        Safe to call while requests run: the loop is paused at a step boundary. `on_update="keep"` lets running
        requests keep their KV (fast, slightly off-policy); `"recompute"` re-prefills them under the new weights.
        From now on no new request reuses prefix blocks computed under older weights.
        """
        if on_update not in ("keep", "recompute"):
            raise ValueError(f"on_update must be 'keep' or 'recompute', got {on_update!r}")
        start = time.perf_counter()
        staged = None
        if not (self.share_weights and source is self.model):
            staged = stage_update(self.model, source)
        with self.manager.pause():
            if staged is not None:
                apply_staged(staged)
            engine = self.manager.engine
            engine.set_weight_version(engine.weight_version + 1, recompute=on_update == "recompute")
            version = engine.weight_version
        self.last_update_seconds = time.perf_counter() - start
        logger.debug("weights updated to version %d in %.3fs", version, self.last_update_seconds)
        return version


__all__ = ["RolloutBatch", "RolloutGenerator", "RolloutSample", "WeightUpdateError", "generation_copy"]
