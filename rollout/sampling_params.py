"""Per-request sampling and stopping settings, as a caller writes them (every field optional).

What the engine consumes is their resolution over the model's `GenerationConfig`, `ResolvedSampling`
(rollout.engine.sample.resolve): every field concrete and validated once, at submission.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import LogitsProcessor

    LogitsProcessorLike = Callable[[list[int], torch.Tensor], torch.Tensor] | LogitsProcessor

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class SamplingParams:
    """Sampling/stopping settings for one request. `None` means: take it from the generation config.

    Greedy decoding is `temperature=0` or `do_sample=False`. `top_k=0`, `top_p=1` and `min_p=0` disable truncation.
    `seed` makes the request's samples independent of the rest of the batch and repeatable across runs.
    `stop_strings` end a sequence once its decoded text contains one (the engine needs a tokenizer for them).

    Shaping the distribution (see rollout/engine/sample/logits_processors.py): `logit_bias` ({token id: -100..100},
    added to the logits as OpenAI does), `allowed_token_ids` (only these may be sampled), `bad_words_ids` (token
    sequences that may not be completed), `min_new_tokens` (EOS and stop ids are masked until then) and
    `logits_processors` (callables `(generated_ids, logits_row) -> logits_row` or transformers `LogitsProcessor`
    objects).
    Structured outputs (at most one; the engine needs a tokenizer and xgrammar): `json_schema` (a dict or JSON text),
    `regex`, `grammar` (EBNF) or `choice` (the output is exactly one of these strings).

    Logprobs beyond the RL contract (see rollout/engine/sample/prompt_logprobs.py and top_logprobs.py): `logprobs=k`
    adds, per generated token, the model's own log_softmax(logits) of it (`raw_logprobs`) and the k most likely tokens
    under the sampled, the policy and the raw distribution. `prompt_logprobs=k` (0: only each prompt token's own)
    fills `prompt_logprobs` in the same prefill: log_softmax(logits / prompt_logprobs_temperature) (default 1) of
    prompt token i given tokens [0, i), from `prompt_logprobs_start` (default 1; earlier positions, and always
    position 0, are None). `max_new_tokens=0` prefills and stops without sampling.
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    ignore_eos: bool | None = None
    do_sample: bool | None = None
    eos_token_id: int | list[int] | None = None
    n: int = 1
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words_ids: Sequence[Sequence[int]] | None = None
    logits_processors: Sequence[LogitsProcessorLike] | None = None
    json_schema: Mapping[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int | None = None
    prompt_logprobs_temperature: float | None = None

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """A copy with the given fields replaced; unknown names are a clear error."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown sampling parameter(s) {unknown}; valid names are {sorted(known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})
