"""Prompt logprobs, computed in the prefill that runs anyway: `SamplingParams(prompt_logprobs=k)`.

The logits at position p give the logprob of token p + 1. For a request that asks, each prefill chunk adds the
positions whose logits some prompt token still needs to the rows the model keeps (`StepPlan.prompt_rows`; the
model runner appends them after the sampling rows), and `compute` turns them into logprobs: fp32
log_softmax(logits / prompt_logprobs_temperature) of the next prompt token, plus its k most likely alternatives. The
scheduler writes them onto the request with the step's tokens (Scheduler.update).
Requests that do not ask change nothing: the model keeps only their sampling rows, as before.

Prefix caching: a hit skips computing the cached tokens, and with them their logits. So a request that still needs
prompt logprobs takes cached blocks only up to the first position whose logits it needs
(`Request.max_cached_tokens`): one that wants every prompt token's logprob (`prompt_logprobs_start=1`, OpenAI's echo)
recomputes its whole prompt, while scoring a completion after a prompt (`prompt_logprobs_start=len(prompt)`) reuses
the prompt's cached blocks. Either way the blocks it computes are published for later requests, and positions recorded
once are never recomputed for logprobs (after a preemption, or for group members forking off the prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.sample.sampler import host_lists
from rollout.engine.sample.top_logprobs import top_dicts

ROWS_PER_SLICE = 256  # logit rows converted to fp32 at a time: bounds the extra memory of a long prefill chunk


class PromptSource(Protocol):
    """What prompt logprobs read of a request."""

    prompt_ids: list[int]
    sampling: ResolvedSampling


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs from one step: positions first + 1 ... of its prompt."""

    entry: int  # the request's entry in the step plan
    first: int  # the logits position they start from (the logprob of prompt token first + 1)
    logprobs: list[float]
    top: list[dict[int, float]] | None  # the k most likely tokens per position, where the request asked


@torch.inference_mode()
def compute(prompt_rows: Sequence[tuple[int, int, int]], requests: Sequence[PromptSource], logits: torch.Tensor,
            num_sample: int) -> tuple[torch.Tensor, list[PromptLogprobs]]:
    """Split the runner's `logits` into the sampling rows and the prompt rows after them (`StepPlan.prompt_rows`
    items `(entry, first, count)`), and the prompt logprobs those give. Every request's numbers are read on the host
    together, after the last slice: one sync on an accelerator, not one per request and slice."""
    row, reads, asked = num_sample, [], []
    for entry, first, count in prompt_rows:
        sampling = requests[entry].sampling
        targets = requests[entry].prompt_ids[first + 1:first + 1 + count]
        wants_top = bool(sampling.prompt_logprobs)
        for start in range(0, count, ROWS_PER_SLICE):
            block = logits[row + start:row + min(count, start + ROWS_PER_SLICE)].float()
            if sampling.prompt_logprobs_temperature != 1.0:
                block = block / sampling.prompt_logprobs_temperature
            logprobs = torch.log_softmax(block, dim=-1)
            ids = torch.tensor(targets[start:start + len(block)], dtype=torch.long).to(logprobs.device,
                                                                                       non_blocking=True)
            reads.append(logprobs.gather(1, ids[:, None]).squeeze(1))
            if wants_top:
                reads.extend(torch.topk(logprobs, min(sampling.prompt_logprobs, logprobs.shape[1]), dim=-1))
        asked.append((entry, first, count, wants_top))
        row += count
    host = iter(host_lists(reads) if reads else [])
    out = []
    for entry, first, count, wants_top in asked:  # the reads in the order they were queued
        values: list[float] = []
        top: list[dict[int, float]] | None = [] if wants_top else None
        for _ in range(0, count, ROWS_PER_SLICE):
            values.extend(next(host))
            if top is not None:
                top.extend(top_dicts(next(host), next(host)))
        out.append(PromptLogprobs(entry, first, values, top))
    return logits[:num_sample], out
