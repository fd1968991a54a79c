"""The one mapping between OpenAI / vLLM request names and `SamplingParams` fields.

OpenAI's completion API and vLLM's `SamplingParams` say `max_tokens`, `min_tokens` and `stop` where the engine says
`max_new_tokens`, `min_new_tokens` and `stop_strings`; the other sampling names are the same on both sides. The
server translates requests with it (and names OpenAI's field when the engine rejects a value), the client accepts
either spelling, and a trainer's vLLM-style `generation_kwargs` become SamplingParams overrides through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from rollout.sampling_params import SamplingParams

# OpenAI / vLLM name -> SamplingParams field, where the two differ.
RENAMED: dict[str, str] = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "stop": "stop_strings"}
# Sampling names OpenAI / vLLM and SamplingParams share.
SAME_NAMES: frozenset[str] = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                        "stop_token_ids", "ignore_eos", "n"})
# vLLM generation kwargs that are accepted and ignored: the group size is the trainer's own setting, logprobs are
# always returned, and detokenization settings do not change which tokens are sampled.
IGNORED_GENERATION_KWARGS: frozenset[str] = frozenset({"n", "logprobs", "detokenize", "skip_special_tokens",
                                                       "spaces_between_special_tokens"})

_TO_OPENAI = {field: name for name, field in RENAMED.items()}
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def sampling_name(name: str) -> str:
    """The SamplingParams field an OpenAI / vLLM name means (names the two share come back unchanged)."""
    return RENAMED.get(name, name)


def openai_name(field: str) -> str:
    """The OpenAI request name of a SamplingParams field (the inverse of `sampling_name`)."""
    return _TO_OPENAI.get(field, field)


def to_openai(values: Mapping[str, Any]) -> dict[str, Any]:
    """Request fields under OpenAI names, whichever spelling the caller used; None values are dropped."""
    return {openai_name(name): value for name, value in values.items() if value is not None}


def sampling_overrides(kwargs: Mapping[str, Any], source: str = "generation_kwargs",
                       ignored: frozenset[str] = IGNORED_GENERATION_KWARGS) -> dict[str, Any]:
    """vLLM-style generation kwargs as SamplingParams overrides (for `SamplingParams.with_overrides`).

    OpenAI / vLLM names and SamplingParams names are both accepted; names in `ignored` are skipped. An unknown name
    raises ValueError naming it (as `source[name]`) and listing what is supported, instead of being dropped silently.
    """
    overrides: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in ignored:
            continue
        name = sampling_name(key)
        if name not in _SAMPLING_FIELDS:
            supported = sorted(_SAMPLING_FIELDS | set(RENAMED))
            raise ValueError(f"{source}[{key!r}] is not supported by the rollout engine; supported: {supported} "
                             f"(ignored: {sorted(ignored)})")
        overrides[name] = value
    return overrides


__all__ = ["IGNORED_GENERATION_KWARGS", "RENAMED", "SAME_NAMES", "openai_name", "sampling_name",
           "sampling_overrides", "to_openai"]
