"""Vectorized per-request sampling and the RL logprob contract.

One pass over the `[rows, vocab]` logits applies each row's own logits processors (repetition penalty, logit bias,
token masks, min-new-tokens, its own processors and structured-output grammar: see logits_processors.py), then
temperature, top-k, top-p and min-p (transformers' order), then samples by inverse CDF. The uniform of a seeded row
comes from a generator keyed by (seed, position) alone, so its tokens do not depend on the rest of the batch and
repeat across runs.

Per token it returns `logprobs` (under the processed, truncated, renormalised distribution actually sampled from),
`policy_logprobs` (fp32 log_softmax(logits / T) of the raw logits over the full vocabulary: what a trainer
recomputes) and `kept_logmass` (log of the policy mass that masks and truncation kept), so logprobs = policy_logprobs
- kept_logmass whenever the processors only mask. A row whose processors fail is reported in `errors` instead.
Rows that ask for `logprobs=k` also get top-k alternatives and the raw logprob (see top_logprobs.py).

The logits may live on any device. Per-row settings are decided in Python and copied over without waiting on the
device, and everything the host reads of a step (tokens, logprobs, alternatives, which rows' processors left nothing)
comes back in one `to_host` call: on an accelerator, the step's only sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout.engine.cpu.kernel import draw_tokens
from rollout.engine.sample.logits_processors import ProcessedLogits, apply_processors, to_device
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.sample.rows import SampleResult, SampleRow
from rollout.engine.sample.structured_output import GrammarMasker
from rollout.engine.sample.top_logprobs import ask_alternatives, read_alternatives
from rollout.engine.sample.truncation import masked, truncation_mask
from rollout.engine.sample.units import lp_units
from rollout.seeding import SeedStream, derive_seed

_NEG_INF = float("-inf")


def to_host(buffer: torch.Tensor) -> torch.Tensor:
    """The one device-to-host copy of a step, and so its one sync: every host read of the sampler (and of prompt
    logprobs) passes here, which lets a test count them."""
    return buffer.cpu()


def host_lists(tensors: Sequence[torch.Tensor]) -> list[list]:
    """Each tensor as (nested) Python lists, of its own dtype. On the CPU that costs nothing and is done directly;
    elsewhere they share one `to_host` call, packed into one float64 buffer (exact for token ids, fp32 values and
    flags), so reading them syncs once instead of once per tensor."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.tolist() for t in tensors]
    return unpack(to_host(pack(tensors)), tensors)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors` flattened into one float64 buffer, in order, on their device."""
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])


def unpack(host: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[list]:
    """`host`, a copy of `pack(tensors)`, split back into lists of each tensor's shape and dtype."""
    parts = host.split([t.numel() for t in tensors])
    return [part.view(t.shape).to(t.dtype).tolist() for part, t in zip(parts, tensors)]


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
    """Stateless except for the generator that feeds unseeded rows and the grammar masker's reused bitmask."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else torch.seed())
        self.grammar = GrammarMasker()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        logits = logits.float()
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SampleResult([], [], [], [])
        device = logits.device
        params = [r.sampling for r in rows]
        temperatures = [1.0 if p.greedy or p.temperature == 0 else p.temperature for p in params]
        greedy_rows = [p.greedy for p in params]
        greedy = to_device(greedy_rows, torch.bool, device) if any(greedy_rows) else None

        unit = all(t == 1.0 for t in temperatures)
        temps = None if unit else to_device(temperatures, torch.float32, device)[:, None]
        policy_scaled = logits if unit else logits / temps
        policy = torch.log_softmax(policy_scaled, dim=-1)
        processed = apply_processors(logits, rows, self.grammar)
        # where no processor ran, the sampled logits are the policy's (one division by the temperatures, not two)
        scaled = policy_scaled if processed.logits is logits else (
            processed.logits if unit else processed.logits / temps)
        keep = truncation_mask(scaled, params)
        if keep is not None:
            sample_lp = torch.log_softmax(masked(scaled, keep), dim=-1)
        elif len(processed.touched) == num_rows:
            sample_lp = torch.log_softmax(scaled, dim=-1)
        elif processed.touched:  # only the processed rows differ from the policy
            idx = to_device(processed.touched, torch.long, device)
            sample_lp = policy.index_copy(0, idx, torch.log_softmax(scaled[idx], dim=-1))
        else:
            sample_lp = policy  # nothing touched: the policy is what gets sampled

        tokens = self._draw(sample_lp, rows, greedy)
        idx = tokens[:, None]
        logprobs = sample_lp.gather(1, idx).squeeze(1)
        policy_lp = policy.gather(1, idx).squeeze(1)
        kept = self._kept_logmass(policy, sample_lp, policy_lp - logprobs, params, processed, keep is not None)
        if greedy is not None:
            # Greedy samples a point mass: logprob 0, and the kept mass is the chosen token's policy probability.
            logprobs = torch.where(greedy, torch.zeros_like(logprobs), logprobs)
            kept = torch.where(greedy, policy_lp, kept)
        asked = ask_alternatives(logits, policy, sample_lp, tokens, rows, temperatures)
        reads = [tokens, logprobs, policy_lp, kept]
        if processed.dead is not None:
            reads.append(processed.dead)
        host = host_lists(reads + (asked.tensors if asked is not None else []))
        if processed.dead is not None:
            processed.fail_dead(host[4])
        alternatives = read_alternatives(asked, host[len(reads):], host[0], rows) if asked is not None else {}
        return SampleResult(host[0], host[1], host[2], host[3], processed.errors, alternatives)

    @staticmethod
    def _kept_logmass(policy: torch.Tensor, sample_lp: torch.Tensor, difference: torch.Tensor,
                      params: list[ResolvedSampling], processed: ProcessedLogits, truncation: bool) -> torch.Tensor:
        """Log of the policy mass on the tokens a row could sample; exactly 0 for rows nothing narrowed.

        A truncated row that no processor touched samples the policy renormalized over the kept tokens, so its kept
        mass is `difference` (policy logprob minus sampled logprob of its token): no pass over the vocabulary. Rows a
        processor touched sum the policy over the tokens left (a logsumexp over the row)."""
        truncated = {i for i, p in enumerate(params) if p.truncates and not p.greedy} if truncation else set()
        touched = set(processed.touched)
        summed = sorted((truncated & touched) | set(processed.narrowed))
        by_difference = sorted(truncated - touched)
        if len(by_difference) == len(params):
            return difference
        kept = torch.zeros(len(params), device=policy.device)
        if by_difference:
            idx = to_device(by_difference, torch.long, policy.device)
            kept[idx] = difference[idx]
        if len(summed) == len(params):
            kept = torch.logsumexp(policy.masked_fill(torch.isinf(sample_lp), _NEG_INF), dim=-1)
        elif summed:
            idx = to_device(summed, torch.long, policy.device)
            kept[idx] = torch.logsumexp(policy[idx].masked_fill(torch.isinf(sample_lp[idx]), _NEG_INF), dim=-1)
        return kept

    # ------------------------------------------------------------------ drawing
    def _draw(self, sample_lp: torch.Tensor, rows: list[SampleRow], greedy: torch.Tensor | None) -> torch.Tensor:
        """Inverse-CDF sampling with one uniform per row: the first token whose cumulative probability exceeds u.

        A seeded row draws u from a counter-based generator keyed by (seed, position), so its token depends on nothing
        else in the batch. One uniform per row (not one per vocabulary entry) keeps the cost of randomness negligible.
        The uniforms are drawn on the host (unseeded ones from the CPU generator, whatever the device), so the stream of
        draws is the same on every device, and copied over once. `greedy` flags the greedy rows, None if none is.
        """
        num_rows = sample_lp.shape[0]
        if all(r.sampling.greedy for r in rows):
            return torch.argmax(sample_lp, dim=-1)
        uniforms = torch.zeros(num_rows, dtype=torch.float64)
        unseeded = [i for i, r in enumerate(rows) if r.sampling.seed is None and not r.sampling.greedy]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
        seeded = [i for i, r in enumerate(rows) if r.sampling.seed is not None and not r.sampling.greedy]
        if seeded:
            keys = [derive_seed(rows[i].sampling.seed, len(rows[i].tokens), SeedStream.NOISE) for i in seeded]
            uniforms[seeded] = torch.from_numpy(keyed_uniforms(keys))
        uniforms = uniforms.to(sample_lp.device, non_blocking=True)
        drawn = inverse_cdf(sample_lp, uniforms)
        if greedy is not None:
            drawn = torch.where(greedy, torch.argmax(sample_lp, dim=-1), drawn)
        return drawn


CDF_BLOCK = 1024  # vocabulary entries per block of the two-level search


def inverse_cdf(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds `u * total`, counted in whole units of 2^-40 of
    exp(logprobs) (units.lp_units): the threshold is floor(u * total units), and the token the first whose cumulative
    units pass it. A row with no units at all (every log-probability under units.LOWEST_LP) takes its argmax.

    On CPU the kernel library does it in one pass per row (csrc/draw.c). Elsewhere, in two levels, so no
    `[rows, vocab]` cumulative sum is built: the blocks' sums and their running total find the block the threshold
    falls in, then that block alone is summed token by token. Both draw the same tokens: they compute the same units,
    and integer sums are exact in any order."""
    drawn = draw_tokens(logprobs, uniforms)
    if drawn is not None:
        return drawn
    units = lp_units(logprobs)
    rows, vocab = units.shape
    full = vocab // CDF_BLOCK * CDF_BLOCK
    sums = [units[:, :full].view(rows, -1, CDF_BLOCK).sum(-1)] if full else []
    if full < vocab:
        sums.append(units[:, full:].sum(-1, keepdim=True))
    ends = torch.cat(sums, dim=1).cumsum(dim=1)  # [rows, blocks]: cumulative units at each block's end
    total = ends[:, -1:]
    threshold = torch.minimum((uniforms[:, None] * total.double()).floor().long(), total - 1)
    block = torch.searchsorted(ends, threshold, right=True).clamp_max(ends.shape[1] - 1)  # [rows, 1]
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp_min(0)), 0)
    index = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=logprobs.device)  # [rows, CDF_BLOCK]: its tokens
    within = units.gather(1, index.clamp_max(vocab - 1)).masked_fill(index >= vocab, 0)
    drawn = (block * CDF_BLOCK + torch.searchsorted(before + within.cumsum(dim=1), threshold, right=True)).squeeze(1)
    return torch.where(total.squeeze(1) > 0, drawn.clamp_max(vocab - 1), logprobs.argmax(dim=-1))
