"""The plain data a sampling step exchanges: SampleRow in (one row's settings, history and grammar state),
SampleResult out (tokens, the logprob contract, failures, alternatives). The scheduler builds the rows and is the only
one to write what comes back into its requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.engine.sample.resolve import ResolvedSampling
from rollout.engine.sample.structured_output import GrammarState


@dataclass
class TokenAlternatives:
    """What one sampled token adds for a row that asked for `logprobs`."""

    raw_logprob: float
    top: dict[int, float]  # under the sampled distribution (the one `logprobs` describes)
    policy_top: dict[int, float]
    raw_top: dict[int, float]


@dataclass
class SampleRow:
    """What the sampler needs to know about one row: settings, history (prompt + generated, for penalties and
    processors), its RNG key, and its grammar matcher if it has a structured output."""

    sampling: ResolvedSampling
    tokens: list[int]
    num_generated: int
    grammar: GrammarState | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.num_generated:]

    @property
    def processed(self) -> bool:
        """Whether this step runs any logits processor on the row (the min-new-tokens mask only while it lasts)."""
        s = self.sampling
        return (s.shapes_logits or self.grammar is not None
                or (self.num_generated < s.min_new_tokens and bool(s.stop_ids)))


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    kept_logmass: list[float]
    errors: dict[int, str] = field(default_factory=dict)  # rows whose request fails (their token is meaningless)
    alternatives: dict[int, TokenAlternatives] = field(default_factory=dict)  # rows that asked for `logprobs`
