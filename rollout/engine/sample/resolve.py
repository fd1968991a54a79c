"""Resolving a request's settings: SamplingParams merged over the model's GenerationConfig into ResolvedSampling,
every value concrete and range-checked, its processors and structured-output spec built, once, where the request
enters the engine. The sampler only ever meets resolved values.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from transformers import GenerationConfig

from rollout.engine.sample.processor_specs import RequestProcessors, request_processors
from rollout.engine.sample.structured_output import CompiledConstraint, StructuredOutput, structured_output
from rollout.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from rollout.validation import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE, InvalidRequestError

_FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32: larger values become inf there


def _finite32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX


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
    n: int = 1  # sequences of the request: one prefill, n samples

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
        n=p.n if isinstance(p.n, int) and not isinstance(p.n, bool) else 1,  # a bad n is refused below, by name
    )
    check_sampling(resolved, p)
    return resolved


def check_sampling(r: ResolvedSampling, p: SamplingParams) -> None:
    """Ranges of the merged settings; the first bad field raises. Every float must be finite (in float32, where the
    sampler uses it), so no setting can put NaN into a logprob."""
    floats = {"temperature": r.temperature, "top_p": r.top_p, "min_p": r.min_p,
              "repetition_penalty": r.repetition_penalty}
    for param, value in floats.items():
        if not _finite32(value):
            raise InvalidRequestError(f"Invalid sampling parameters: {param} must be a finite number, got {value}.",
                                      param)
    checks: Sequence[tuple[bool, str, str]] = [
        (r.temperature >= 0, "temperature", f"must be >= 0, got {r.temperature}"),
        (r.greedy or r.temperature == 0 or r.temperature >= MIN_TEMPERATURE, "temperature",
         f"must be 0 (greedy) or at least {MIN_TEMPERATURE} when sampling, got {r.temperature}"),
        (r.top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {r.top_k}"),
        (0.0 < r.top_p <= 1.0, "top_p", f"must be in (0, 1], got {r.top_p}"),
        (0.0 <= r.min_p <= 1.0, "min_p", f"must be in [0, 1], got {r.min_p}"),
        (REPETITION_PENALTY_RANGE[0] <= r.repetition_penalty <= REPETITION_PENALTY_RANGE[1], "repetition_penalty",
         f"must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]}], got {r.repetition_penalty}"),
        (r.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0 (0: prefill only), got {r.max_new_tokens}"),
        (0 <= r.min_new_tokens <= r.max_new_tokens, "min_new_tokens",
         f"must be in [0, max_new_tokens={r.max_new_tokens}], got {r.min_new_tokens}"),
        (isinstance(p.n, int) and p.n >= 1, "n", f"must be >= 1, got {p.n}"),
        (all(isinstance(x, str) and x for x in r.stop_strings), "stop_strings", "must be non-empty strings"),
        (r.seed is None or isinstance(r.seed, int), "seed", f"must be an int, got {r.seed!r}"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequestError(f"Invalid sampling parameters: {param} {message}.", param)
    _check_logprob_settings(r)


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _check_logprob_settings(r: ResolvedSampling) -> None:
    """`logprobs`, `prompt_logprobs` (None or a count of alternatives), and where and how prompt logprobs apply."""
    temperature = r.prompt_logprobs_temperature
    checks: Sequence[tuple[bool, str, str]] = [
        (r.logprobs is None or _is_count(r.logprobs), "logprobs",
         f"must be None or an int >= 0 (alternatives per token), got {r.logprobs!r}"),
        (r.prompt_logprobs is None or _is_count(r.prompt_logprobs), "prompt_logprobs",
         f"must be None or an int >= 0 (alternatives per prompt token), got {r.prompt_logprobs!r}"),
        (_is_count(r.prompt_logprobs_start), "prompt_logprobs_start",
         f"must be an int >= 0, got {r.prompt_logprobs_start!r}"),
        (isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and _finite32(temperature)
         and temperature >= MIN_TEMPERATURE, "prompt_logprobs_temperature",
         f"must be a finite number >= {MIN_TEMPERATURE}, got {temperature!r}"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequestError(f"Invalid sampling parameters: {param} {message}.", param)
