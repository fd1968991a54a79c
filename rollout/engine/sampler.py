"""Vectorized per-request sampling and the RL logprob contract.

One pass over the `[rows, vocab]` logits applies each row's own repetition penalty, min-new-tokens guard,
temperature, top-k, top-p and min-p (transformers' order), then samples by inverse CDF. The uniform of a seeded row
comes from a generator keyed by (seed, position) alone, so its tokens do not depend on the rest of the batch and
repeat across runs.

Per token it returns `logprobs` (under the truncated, renormalised distribution actually sampled from),
`policy_logprobs` (fp32 log_softmax(logits / T) over the full vocabulary: what a trainer recomputes) and
`kept_logmass` (log of the policy mass truncation kept), so logprobs = policy_logprobs - kept_logmass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.sampling_params import ResolvedSampling
from rollout.seeding import SeedStream, derive_seed

_NEG_INF = float("-inf")


@dataclass
class SampleRow:
    """What the sampler needs to know about one row: settings, history (for penalties) and its RNG key."""

    sampling: ResolvedSampling
    tokens: list[int]
    num_generated: int


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    kept_logmass: list[float]


def keyed_uniforms(keys: list[int]) -> np.ndarray:
    """One uniform in [0, 1) per key: the splitmix64 finaliser (a counter-based generator), vectorized over rows.

    A torch.Generator per seeded row cost microseconds of Python each; this is one numpy pass with 53-bit results.
    """
    z = np.array(keys, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Sampler:
    """Stateless except for the generator that feeds unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        logits = logits.float()
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SampleResult([], [], [], [])
        params = [r.sampling for r in rows]
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
        temps = torch.tensor([1.0 if p.greedy or p.temperature == 0 else p.temperature for p in params])[:, None]

        unit = bool((temps == 1.0).all())
        policy = torch.log_softmax(logits if unit else logits / temps, dim=-1)
        processed = self._apply_processors(logits, rows)
        plain = processed is logits  # no penalty or guard: the policy is what gets truncated and sampled
        processed = processed if unit else processed / temps
        keep = self._truncation_mask(processed, params)
        if keep is not None:
            sample_lp = torch.log_softmax(processed.masked_fill(~keep, _NEG_INF), dim=-1)
        else:
            sample_lp = policy if plain else torch.log_softmax(processed, dim=-1)

        tokens = self._draw(sample_lp, rows, greedy)
        idx = tokens[:, None]
        logprobs = sample_lp.gather(1, idx).squeeze(1)
        policy_lp = policy.gather(1, idx).squeeze(1)
        if keep is not None:
            truncating = torch.tensor([p.truncates and not p.greedy for p in params], dtype=torch.bool)
            kept = torch.logsumexp(policy.masked_fill(~keep, _NEG_INF), dim=-1)
            kept = torch.where(truncating, kept, torch.zeros_like(kept))
        else:
            kept = torch.zeros(num_rows)
        # Greedy samples a point mass: logprob 0, and the kept mass is the chosen token's policy probability.
        logprobs = torch.where(greedy, torch.zeros_like(logprobs), logprobs)
        kept = torch.where(greedy, policy_lp, kept)
        return SampleResult(tokens.tolist(), logprobs.tolist(), policy_lp.tolist(), kept.tolist())

    # -------------------------------------------------------------- processors
    @staticmethod
    def _apply_processors(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Repetition penalty and the min-new-tokens EOS guard, only on the rows that ask for them."""
        out = logits
        for i, row in enumerate(rows):
            p = row.sampling
            banned = row.num_generated < p.min_new_tokens and (p.eos_token_ids or p.stop_token_ids)
            if p.repetition_penalty == 1.0 and not banned:
                continue
            if out is logits:
                out = logits.clone()
            if p.repetition_penalty != 1.0:
                ids = torch.tensor(sorted(set(row.tokens)), dtype=torch.long)
                scores = out[i, ids]
                out[i, ids] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            if banned:
                out[i, sorted(p.eos_token_ids | p.stop_token_ids)] = _NEG_INF
        return out

    @staticmethod
    def _truncation_mask(scaled: torch.Tensor, params: list[ResolvedSampling]) -> torch.Tensor | None:
        """Tokens each row keeps after top-k, top-p (on the top-k survivors) and min-p; None if nobody truncates."""
        if not any(p.truncates and not p.greedy for p in params):
            return None
        vocab = scaled.shape[1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params])
        top_p = torch.tensor([p.top_p if not p.greedy else 1.0 for p in params])
        min_p = torch.tensor([p.min_p if not p.greedy else 0.0 for p in params])

        sorted_vals, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        kth = sorted_vals.gather(1, (top_k - 1)[:, None])
        keep_sorted = sorted_vals >= kth  # ties with the k-th value are kept, as in transformers
        probs = torch.softmax(sorted_vals.masked_fill(~keep_sorted, _NEG_INF), dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        keep_sorted &= (before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1.0)
        if bool((min_p > 0).any()):
            probs = torch.softmax(sorted_vals.masked_fill(~keep_sorted, _NEG_INF), dim=-1)
            keep_sorted &= (probs >= min_p[:, None] * probs[:, :1]) | (ranks == 0)
        return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)

    # ------------------------------------------------------------------ drawing
    def _draw(self, sample_lp: torch.Tensor, rows: list[SampleRow], greedy: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling with one uniform per row: the first token whose cumulative probability exceeds u.

        A seeded row draws u from a counter-based generator keyed by (seed, position), so its token depends on nothing
        else in the batch. One uniform per row (not one per vocabulary entry) keeps the cost of randomness negligible.
        """
        num_rows = sample_lp.shape[0]
        if bool(greedy.all()):
            return torch.argmax(sample_lp, dim=-1)
        uniforms = torch.zeros(num_rows, dtype=torch.float64)
        unseeded = [i for i, r in enumerate(rows) if r.sampling.seed is None and not r.sampling.greedy]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
        seeded = [i for i, r in enumerate(rows) if r.sampling.seed is not None and not r.sampling.greedy]
        if seeded:
            keys = [derive_seed(rows[i].sampling.seed, len(rows[i].tokens), SeedStream.NOISE) for i in seeded]
            uniforms[seeded] = torch.from_numpy(keyed_uniforms(keys))
        cdf = sample_lp.exp().cumsum(dim=-1, dtype=torch.float64)
        threshold = uniforms[:, None] * cdf[:, -1:]  # scaled by the row's total: robust to rounding in the sum
        drawn = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
        # u * total < total, so a token is always found; the clamp only guards the last ulp.
        drawn = drawn.clamp_max(sample_lp.shape[1] - 1)
        if bool(greedy.any()):
            drawn = torch.where(greedy, torch.argmax(sample_lp, dim=-1), drawn)
        return drawn
