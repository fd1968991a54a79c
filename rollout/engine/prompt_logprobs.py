"""Prompt logprobs, computed in the prefill that runs anyway: `SamplingParams(prompt_logprobs=k)`.

The logits at position p give the logprob of token p + 1. For a request that asks, each prefill chunk adds the
positions whose logits some prompt token still needs to the rows the model keeps (`StepPlan.prompt_rows`; the
model runner appends them after the sampling rows), and `record` turns them into logprobs on the request: fp32
log_softmax(logits / prompt_logprobs_temperature) of the next prompt token, plus its k most likely alternatives.
Requests that do not ask change nothing: the model keeps only their sampling rows, as before.

Prefix caching: a hit skips computing the cached tokens, and with them their logits. So a request that still needs
prompt logprobs takes cached blocks only up to the first position whose logits it needs
(`Request.max_cached_tokens`): one that wants every prompt token's logprob (`prompt_logprobs_start=1`, OpenAI's echo)
recomputes its whole prompt, while scoring a completion after a prompt (`prompt_logprobs_start=len(prompt)`) reuses
the prompt's cached blocks. Either way the blocks it computes are published for later requests, and positions recorded
once are never recomputed for logprobs (after a preemption, or for group members forking off the prefill).
"""

from __future__ import annotations

import torch

from rollout.engine.step import StepPlan
from rollout.engine.top_logprobs import top_dicts

ROWS_PER_SLICE = 256  # logit rows converted to fp32 at a time: bounds the extra memory of a long prefill chunk


@torch.inference_mode()
def record(plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
    """Take the prompt rows (after the sampling rows) of the runner's `logits`, record what they give on their
    requests, and return the sampling rows."""
    num_sample = len(plan.sample_rows)
    row = num_sample
    for entry, first, count in plan.prompt_rows:
        request = plan.requests[entry]
        if len(request.prompt_logprobs) != first + 1:  # the scheduler keeps them contiguous; never write a gap
            raise RuntimeError(f"{request.request_id}: prompt logprobs recorded up to {len(request.prompt_logprobs)}, "
                               f"but this step computes them from position {first + 1}")
        sampling = request.sampling
        targets = request.prompt_ids[first + 1:first + 1 + count]
        for start in range(0, count, ROWS_PER_SLICE):
            block = logits[row + start:row + min(count, start + ROWS_PER_SLICE)].float()
            if sampling.prompt_logprobs_temperature != 1.0:
                block = block / sampling.prompt_logprobs_temperature
            logprobs = torch.log_softmax(block, dim=-1)
            ids = torch.tensor(targets[start:start + len(block)], dtype=torch.long, device=logprobs.device)
            request.prompt_logprobs.extend(logprobs.gather(1, ids[:, None]).squeeze(1).tolist())
            if sampling.prompt_logprobs:
                k = min(sampling.prompt_logprobs, logprobs.shape[1])
                request.prompt_top_logprobs.extend(top_dicts(*torch.topk(logprobs, k, dim=-1)))
        row += count
    return logits[:num_sample]
