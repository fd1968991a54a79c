"""What makes a request servable, written once: the engine, the generator and the server all call these.

Each failure is an `InvalidRequestError` (a ValueError) that names the offending field in `param` (SamplingParams'
names, or "prompt") and a machine-readable `code`, so the server can answer a 400 naming the field without checking
anything a second time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.sampling_params import ResolvedSampling, SamplingParams

# Below this a sampled (non-greedy) temperature turns logits / T into infinities and the logprobs into NaN; it is
# vLLM's floor too. Greedy requests (temperature 0) never divide by it.
MIN_TEMPERATURE = 1e-2
# The penalty divides positive logits and multiplies negative ones: outside this range it can overflow them to inf.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
_FLOAT32_MAX = 3.4028234663852886e38  # the sampler works in float32: larger values become inf there


def _finite32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX


class InvalidRequestError(ValueError):
    """A request that cannot be served as given: fix the field `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_prompt(prompt_ids, vocab_size: int, max_positions: int | None, prefill_only: bool = False) -> list[int]:
    """The prompt as a list of ints, or InvalidRequestError saying what is wrong with it. `prefill_only`: no token
    will be sampled after it (max_new_tokens=0), so it may fill every position."""
    if prompt_ids is None or len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty; pass at least one token id", "prompt", "empty_prompt")
    if hasattr(prompt_ids, "flatten") and hasattr(prompt_ids, "tolist"):  # a tensor or an array
        prompt_ids = prompt_ids.flatten().tolist()
    wrong = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if wrong is not None:
        raise InvalidRequestError(f"token ids must be integers, got {wrong!r} ({type(wrong).__name__})", "prompt",
                                  "invalid_token_id")
    prompt = [int(t) for t in prompt_ids]
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}) "
                                  f"({len(bad)} such ids in the prompt)", "prompt", "invalid_token_id")
    if prefill_only and max_positions is not None and len(prompt) > max_positions:
        raise InvalidRequestError(f"the prompt has {len(prompt)} tokens but the model allows at most {max_positions} "
                                  "positions", "prompt", "context_length_exceeded")
    if not prefill_only and max_positions is not None and len(prompt) >= max_positions:
        raise InvalidRequestError(f"the prompt has {len(prompt)} tokens but the model allows at most {max_positions} "
                                  "positions (prompt plus at least one new token)", "prompt",
                                  "context_length_exceeded")
    return prompt


def check_fits(prompt_len: int, max_new_tokens: int, max_positions: int | None, kv_capacity_tokens: int) -> None:
    """A server's stricter promise: the whole completion fits the model's context and the KV cache."""
    total = prompt_len + max_new_tokens
    if max_positions is not None and total > max_positions:
        raise InvalidRequestError(f"this model's maximum context length is {max_positions} tokens, but {total} were "
                                  f"requested ({prompt_len} in the prompt, {max_new_tokens} for the completion); "
                                  "reduce the prompt or max_new_tokens", "max_new_tokens", "context_length_exceeded")
    if total > kv_capacity_tokens:
        raise InvalidRequestError(f"the request needs {total} tokens of KV cache but the engine has "
                                  f"{kv_capacity_tokens}; reduce the prompt or max_new_tokens", "max_new_tokens",
                                  "context_length_exceeded")


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
