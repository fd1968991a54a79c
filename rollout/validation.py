"""What makes a request servable, written once: the engine, the generator and the server all call these.

Each failure is an `InvalidRequestError` (a ValueError) that names the offending field in `param` (SamplingParams'
names, or "prompt") and a machine-readable `code`, so the server can answer a 400 naming the field without checking
anything a second time.
"""

from __future__ import annotations

import numbers

# Below this a sampled (non-greedy) temperature turns logits / T into infinities and the logprobs into NaN; it is
# vLLM's floor too. Greedy requests (temperature 0) never divide by it.
MIN_TEMPERATURE = 1e-2
# The penalty divides positive logits and multiplies negative ones: outside this range it can overflow them to inf.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
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
