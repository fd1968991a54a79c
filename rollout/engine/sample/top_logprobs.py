"""Top-k alternatives of generated tokens, and the model's raw logprob of each: what `SamplingParams(logprobs=k)` adds.

The sampler already holds, per row, the distribution it sampled from (`sample_lp`) and the policy, fp32
log_softmax(logits / T). For the rows that ask (and only those) this adds the raw distribution, fp32
log_softmax(logits) at temperature 1 before any logits processor (what OpenAI-style APIs report: a greedy or
tempered request still gets the model's own numbers), the raw logprob of the sampled token, and the k most likely
tokens of each of the three distributions as {token id: logprob}, most likely first.

Tokens the sampled distribution gives no mass (cut by truncation or a mask) are left out of its alternatives, and a
greedy row's sampled distribution is a point mass on its token, so its alternatives are {token: 0.0}, matching the
`logprobs` contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.engine.sample.rows import SampleRow, TokenAlternatives


def top_dicts(values: torch.Tensor, ids: torch.Tensor, counts: Sequence[int] | None = None) -> list[dict[int, float]]:
    """Rows of `torch.topk(..., sorted=True)` results as {token id: logprob} dicts, -inf entries left out; row i
    keeps its first counts[i] entries (all of them by default)."""
    out = []
    for i, (row_values, row_ids) in enumerate(zip(values.tolist(), ids.tolist())):
        k = len(row_values) if counts is None else counts[i]
        out.append({t: v for t, v in zip(row_ids[:k], row_values[:k]) if v != float("-inf")})
    return out


@torch.inference_mode()
def token_alternatives(logits: torch.Tensor, policy: torch.Tensor, sample_lp: torch.Tensor, tokens: torch.Tensor,
                       rows: Sequence[SampleRow], temps: torch.Tensor) -> dict[int, TokenAlternatives]:
    """{row: TokenAlternatives} for the rows whose request set `logprobs` (empty, at no cost, when none did).

    `logits` are the fp32 logits before any processor, `policy` log_softmax(logits / temps), `sample_lp` the
    distribution each row sampled from and `tokens` what it sampled.
    """
    asking = [i for i, r in enumerate(rows) if r.sampling.logprobs is not None]
    if not asking:
        return {}
    idx = torch.tensor(asking, dtype=torch.long, device=logits.device)
    policy_rows = policy[idx]
    tempered = temps[idx, 0].to(logits.device) != 1.0  # greedy rows use T = 1 too
    raw = policy_rows
    if bool(tempered.any()):
        raw = torch.where(tempered[:, None], torch.log_softmax(logits[idx], dim=-1), policy_rows)
    chosen = tokens[idx]
    raw_chosen = raw.gather(1, chosen[:, None]).squeeze(1).tolist()
    counts = [min(rows[i].sampling.logprobs, logits.shape[1]) for i in asking]
    k = max(counts)
    if k == 0:
        return {i: TokenAlternatives(raw_chosen[j], {}, {}, {}) for j, i in enumerate(asking)}
    sampled_top = top_dicts(*torch.topk(sample_lp[idx], k, dim=-1), counts)
    policy_top = top_dicts(*torch.topk(policy_rows, k, dim=-1), counts)
    # Untempered rows: the raw distribution is the policy (copies, so no dict is shared by two lists).
    raw_top = [dict(d) for d in policy_top] if raw is policy_rows else top_dicts(*torch.topk(raw, k, dim=-1), counts)
    out = {}
    for j, i in enumerate(asking):
        top = {int(chosen[j]): 0.0} if rows[i].sampling.greedy and counts[j] else sampled_top[j]
        out[i] = TokenAlternatives(raw_chosen[j], top, policy_top[j], raw_top[j])
    return out
