"""Top-k, top-p and min-p: which tokens each row of a step may sample.

The rules, in transformers' order:
- top-k keeps every token whose scaled logit is at least the row's k-th largest (ties with it kept, as in
  transformers);
- top-p renormalizes the top-k survivors and orders them by probability, then by token id; it keeps a prefix of that
  order: a token stays while the probability mass strictly before it is below top_p, and the first token always
  stays. The mass is an exact sum in units of 2^-40 (units.py), so no summation order moves the boundary;
- min-p keeps the survivors whose renormalized probability is at least min_p times the row's largest.

Why no sort: sorting each row is O(vocab log vocab), and at a real vocabulary (151,936 tokens) torch.sort of a 64-row
step takes longer than the model's decode step. Each rule needs one boundary per row. Top-k's is torch.topk's last
value. Top-p's, on CPU, the kernel library finds by radix select in a few linear passes (csrc/truncation.c);
elsewhere, or without the library, a stable sort and an integer cumulative sum find it, and both keep exactly the
same tokens.
"""

from __future__ import annotations

import torch

from rollout.engine.cpu.kernel import top_p_keep
from rollout.engine.sample.logits_processors import to_device
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.sample.units import MASS_UNITS, mass_units

NO_BUDGET = 1 << 62  # a row without top-p: no mass reaches it
_NEG_INF = float("-inf")


def truncation_mask(scaled: torch.Tensor, params: list[ResolvedSampling]) -> torch.Tensor | None:
    """Tokens each row keeps after top-k, top-p and min-p of `scaled` (its logits over its temperature); None if no
    row truncates. A greedy row keeps everything (it takes the argmax anyway)."""
    if not any(p.truncates and not p.greedy for p in params):
        return None
    vocab, device = scaled.shape[1], scaled.device
    top_k = [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params]
    top_p = [p.top_p if not p.greedy else 1.0 for p in params]
    min_p = [p.min_p if not p.greedy else 0.0 for p in params]
    keep = None
    if any(k < vocab for k in top_k):
        kth = row_kth_largest(scaled, top_k)
        keep = scaled >= kth[:, None]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(masked(scaled, keep), dim=-1)
        budgets = to_device([int(p * MASS_UNITS) if p < 1.0 else NO_BUDGET for p in top_p], torch.long, device)
        nucleus = row_top_p_keep(probs, budgets)
        keep = nucleus if keep is None else keep & nucleus
    if any(m > 0 for m in min_p):
        probs = torch.softmax(masked(scaled, keep), dim=-1)
        floor = to_device(min_p, torch.float32, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        above = probs >= floor
        keep = above if keep is None else keep & above
    return keep


def masked(scaled: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """`scaled` with the tokens `keep` drops at -inf: one pass (masked_fill of ~keep is a copy, a negation and a
    fill)."""
    return scaled if keep is None else torch.where(keep, scaled, _NEG_INF)


def row_kth_largest(values: torch.Tensor, k: list[int]) -> torch.Tensor:
    """Per row of `values` `[rows, vocab]`, its `k[row]`-th largest value (1 <= k <= vocab; NaN counts as the
    largest). torch.topk selects rather than sorts: at the k of sampling recipes (tens to a thousand) it costs a few
    linear passes."""
    ks = to_device(k, torch.long, values.device)
    return values.topk(max(k), dim=-1).values.gather(1, (ks - 1)[:, None]).squeeze(1)


def row_top_p_keep(probs: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` `[rows, vocab]`, the prefix of its tokens in (probability descending, token id ascending)
    order whose mass before each token, in units of 2^-40, stays below the row's budget; the first token always.
    Probabilities <= 0 and NaN count as 0."""
    found = top_p_keep(probs, budgets)
    if found is not None:
        return found
    ordered, order = torch.where(probs > 0, probs, 0.0).sort(dim=-1, descending=True, stable=True)
    units = mass_units(ordered)
    keep_ordered = torch.cumsum(units, dim=-1) - units < budgets[:, None]
    keep_ordered[:, 0] = True
    return torch.zeros_like(keep_ordered).scatter(1, order, keep_ordered)
