"""Top-k alternatives of generated tokens, and the model's raw logprob of each: what `SamplingParams(logprobs=k)` adds.

The sampler already holds, per row, the distribution it sampled from (`sample_lp`) and the policy, fp32
log_softmax(logits / T). For the rows that ask (and only those) this adds the raw distribution, fp32
log_softmax(logits) at temperature 1 before any logits processor (what OpenAI-style APIs report: a greedy or
tempered request still gets the model's own numbers), the raw logprob of the sampled token, and the k most likely
tokens of each of the three distributions as {token id: logprob}, most likely first.

Tokens the sampled distribution gives no mass (cut by truncation or a mask) are left out of its alternatives, and a
greedy row's sampled distribution is a point mass on its token, so its alternatives are {token: 0.0}, matching the
`logprobs` contract.

The work comes in two halves so that the sampler reads these numbers with the rest of the step in one transfer:
`ask_alternatives` queues the device work, `read_alternatives` builds the dicts from the host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.engine.sample.rows import SampleRow, TokenAlternatives


def top_dicts(values: list[list[float]], ids: list[list[int]],
              counts: Sequence[int] | None = None) -> list[dict[int, float]]:
    """Rows of `torch.topk(..., sorted=True)` results, read on the host, as {token id: logprob} dicts, -inf entries
    left out; row i keeps its first counts[i] entries (all of them by default)."""
    out = []
    for i, (row_values, row_ids) in enumerate(zip(values, ids)):
        k = len(row_values) if counts is None else counts[i]
        out.append({t: v for t, v in zip(row_ids[:k], row_values[:k]) if v != float("-inf")})
    return out


@dataclass
class AskedAlternatives:
    """The device tensors the asking rows need read on the host, with the step's other results (one sync)."""

    asking: list[int]  # the rows that asked
    counts: list[int]  # alternatives each of them gets
    tensors: list[torch.Tensor]  # the raw logprob of each chosen token, then (values, ids) of each top-k
    shared_raw: bool  # the raw distribution is the policy (no asking row is tempered): its top-k is not computed


@torch.inference_mode()
def ask_alternatives(logits: torch.Tensor, policy: torch.Tensor, sample_lp: torch.Tensor, tokens: torch.Tensor,
                     rows: Sequence[SampleRow], temperatures: Sequence[float]) -> AskedAlternatives | None:
    """What the rows whose request set `logprobs` need (None, at no cost, when none did); `read_alternatives` turns it
    into their TokenAlternatives once read.

    `logits` are the fp32 logits before any processor, `policy` log_softmax(logits / T) with T = `temperatures` (1 for
    greedy rows), `sample_lp` the distribution each row sampled from and `tokens` what it sampled.
    """
    asking = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    if not asking:
        return None
    device = logits.device
    idx = torch.tensor(asking, dtype=torch.long).to(device, non_blocking=True)
    policy_rows = policy[idx]
    tempered = [temperatures[i] != 1.0 for i in asking]
    raw = policy_rows
    if any(tempered):
        flags = torch.tensor(tempered, dtype=torch.bool).to(device, non_blocking=True)
        raw = torch.where(flags[:, None], torch.log_softmax(logits[idx], dim=-1), policy_rows)
    tensors = [raw.gather(1, tokens[idx][:, None]).squeeze(1)]
    counts = [min(rows[i].sampling.logprobs, logits.shape[1]) for i in asking]
    k = max(counts)
    if k:
        tensors.extend(torch.topk(sample_lp[idx], k, dim=-1))
        tensors.extend(torch.topk(policy_rows, k, dim=-1))
        if raw is not policy_rows:
            tensors.extend(torch.topk(raw, k, dim=-1))
    return AskedAlternatives(asking, counts, tensors, raw is policy_rows)


def read_alternatives(asked: AskedAlternatives, host: list[list], tokens: Sequence[int],
                      rows: Sequence[SampleRow]) -> dict[int, TokenAlternatives]:
    """{row: TokenAlternatives} from `asked.tensors` read on the host (`host`, in order) and the step's tokens."""
    raw_chosen = host[0]
    if len(host) == 1:
        return {i: TokenAlternatives(raw_chosen[j], {}, {}, {}) for j, i in enumerate(asked.asking)}
    counts = asked.counts
    sampled_top = top_dicts(host[1], host[2], counts)
    policy_top = top_dicts(host[3], host[4], counts)
    # Untempered rows: the raw distribution is the policy (copies, so no dict is shared by two lists).
    raw_top = [dict(d) for d in policy_top] if asked.shared_raw else top_dicts(host[5], host[6], counts)
    out = {}
    for j, i in enumerate(asked.asking):
        top = {tokens[i]: 0.0} if rows[i].sampling.greedy and counts[j] else sampled_top[j]
        out[i] = TokenAlternatives(raw_chosen[j], top, policy_top[j], raw_top[j])
    return out
