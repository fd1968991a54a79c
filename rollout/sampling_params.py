"""Per-request sampling and stopping settings, and how they merge with a model's `GenerationConfig`.

`SamplingParams` is what a caller writes (every field optional); `ResolvedSampling` is what the engine consumes
(every field concrete, validated once at submission so the sampler never meets a bad value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig

from rollout.validation import check_sampling

if TYPE_CHECKING:
    import torch
    from transformers import LogitsProcessor

    from rollout.engine.logits_processors import RequestProcessors
    from rollout.engine.structured_output import CompiledConstraint, StructuredOutput

    LogitsProcessorLike = Callable[[list[int], torch.Tensor], torch.Tensor] | LogitsProcessor

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class SamplingParams:
    """Sampling/stopping settings for one request. `None` means: take it from the generation config.

    Greedy decoding is `temperature=0` or `do_sample=False`. `top_k=0`, `top_p=1` and `min_p=0` disable truncation.
    `seed` makes the request's samples independent of the rest of the batch and repeatable across runs.
    `stop_strings` end a sequence once its decoded text contains one (the engine needs a tokenizer for them).

    Shaping the distribution (see rollout/engine/logits_processors.py): `logit_bias` ({token id: -100..100}, added
    to the logits as OpenAI does), `allowed_token_ids` (only these may be sampled), `bad_words_ids` (token sequences
    that may not be completed), `min_new_tokens` (EOS and stop ids are masked until then) and `logits_processors`
    (callables `(generated_ids, logits_row) -> logits_row` or transformers `LogitsProcessor` objects).
    Structured outputs (at most one; the engine needs a tokenizer and xgrammar): `json_schema` (a dict or JSON text),
    `regex`, `grammar` (EBNF) or `choice` (the output is exactly one of these strings).

    Logprobs beyond the RL contract (see rollout/engine/prompt_logprobs.py and top_logprobs.py): `logprobs=k` adds,
    per generated token, the model's own log_softmax(logits) of it (`raw_logprobs`) and the k most likely tokens
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


@dataclass(frozen=True)
class ResolvedSampling:
    """Concrete, validated settings the engine uses for one sequence."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    seed: int | None
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    processors: RequestProcessors | None = None  # logit bias, token masks and the request's own processors
    structured: StructuredOutput | None = None  # the structured-output spec, as asked
    constraint: CompiledConstraint | None = None  # that spec compiled for the engine's tokenizer (by the engine)
    logprobs: int | None = None  # top alternatives per generated token; None: none (and no raw logprobs)
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None: no prompt logprobs
    prompt_logprobs_start: int = 1  # first prompt position whose logprob is wanted
    prompt_logprobs_temperature: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @cached_property
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature, truncation and the min-new-tokens stop mask touches this request's
        logits at every step: the sampler skips the processor pass for batches where no row does."""
        return self.repetition_penalty != 1.0 or self.processors is not None or self.structured is not None

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends the sequence: EOS and stop_token_ids (masked until min_new_tokens are out)."""
        return self.eos_token_ids | self.stop_token_ids


def _pick(value: Any, fallback: Any, default: Any) -> Any:
    if value is not None:
        return value
    return default if fallback is None else fallback


def _as_id_set(value: int | list[int] | tuple[int, ...] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset([value])
    return frozenset(int(v) for v in value)


def resolve_sampling(
    params: SamplingParams | None,
    generation_config: GenerationConfig | None,
    model_eos: int | list[int] | None = None,
) -> ResolvedSampling:
    """Merge request params over the generation config and validate. Raises ValueError naming the bad field."""
    # Imported here: the engine package imports this module, so a module-level import would be circular.
    from rollout.engine.logits_processors import request_processors
    from rollout.engine.structured_output import structured_output

    p = params or SamplingParams()
    g = generation_config or GenerationConfig()
    temperature = float(_pick(p.temperature, getattr(g, "temperature", None), 1.0))
    if p.temperature == 0 or p.do_sample is False:
        greedy = True
    elif p.do_sample is True or p.temperature is not None:
        greedy = False
    else:
        greedy = not bool(getattr(g, "do_sample", False)) or temperature == 0
    resolved = ResolvedSampling(
        greedy=greedy,
        temperature=temperature,
        top_k=int(_pick(p.top_k, getattr(g, "top_k", None), 0)),
        top_p=float(_pick(p.top_p, getattr(g, "top_p", None), 1.0)),
        min_p=float(_pick(p.min_p, getattr(g, "min_p", None), 0.0)),
        repetition_penalty=float(_pick(p.repetition_penalty, getattr(g, "repetition_penalty", None), 1.0)),
        seed=p.seed,
        max_new_tokens=int(_pick(p.max_new_tokens, getattr(g, "max_new_tokens", None), DEFAULT_MAX_NEW_TOKENS)),
        min_new_tokens=int(_pick(p.min_new_tokens, getattr(g, "min_new_tokens", None), 0)),
        stop_token_ids=_as_id_set(p.stop_token_ids),
        stop_strings=tuple(p.stop_strings or ()) if not isinstance(p.stop_strings, str) else (p.stop_strings,),
        eos_token_ids=frozenset()
        if p.ignore_eos
        else _as_id_set(_pick(p.eos_token_id, getattr(g, "eos_token_id", None), model_eos)),
        processors=request_processors(p),
        structured=structured_output(p),
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        prompt_logprobs_start=1 if p.prompt_logprobs_start is None else p.prompt_logprobs_start,
        prompt_logprobs_temperature=1.0 if p.prompt_logprobs_temperature is None else p.prompt_logprobs_temperature,
    )
    check_sampling(resolved, p)
    return resolved
