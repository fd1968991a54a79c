"""The one mapping between OpenAI / vLLM request names and `SamplingParams` fields.

OpenAI's completion API and vLLM's `SamplingParams` say `max_tokens`, `min_tokens` and `stop` where the engine says
`max_new_tokens`, `min_new_tokens` and `stop_strings`, and put a structured output in vLLM's `structured_outputs`
object (`json`, `regex`, `choice`, `grammar`, `json_object`) where the engine has the fields `json_schema`, `regex`,
`choice` and `grammar`; the other sampling names are the same on both sides. The
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
                                        "stop_token_ids", "ignore_eos", "n", "logit_bias", "allowed_token_ids",
                                        "bad_words_ids", "logits_processors", "logprobs", "prompt_logprobs"})
# vLLM generation kwargs that are accepted and ignored: the group size is the trainer's own setting, logprobs are
# always returned, and detokenization settings do not change which tokens are sampled.
IGNORED_GENERATION_KWARGS: frozenset[str] = frozenset({"n", "logprobs", "detokenize", "skip_special_tokens",
                                                       "spaces_between_special_tokens"})

# OpenAI's response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# vLLM's `structured_outputs` keys (a dict, or its StructuredOutputsParams) -> SamplingParams fields. `json_object`
# asks for any JSON object.
STRUCTURED_OUTPUTS: dict[str, str] = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                                      "json_object": "json_schema"}
# Flat generation_kwargs names for them (as TRL spells its `vllm_structured_outputs_regex`).
STRUCTURED_KWARGS: dict[str, str] = {f"structured_outputs_{key}": key for key in STRUCTURED_OUTPUTS}

_TO_OPENAI = {field: name for name, field in RENAMED.items()}
_STRUCTURED_TO_VLLM = {field: key for key, field in STRUCTURED_OUTPUTS.items() if key != "json_object"}
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def sampling_name(name: str) -> str:
    """The SamplingParams field an OpenAI / vLLM name means (names the two share come back unchanged)."""
    return RENAMED.get(name, name)


def openai_name(field: str) -> str:
    """The OpenAI request name of a SamplingParams field (the inverse of `sampling_name`)."""
    return _TO_OPENAI.get(field, field)


def to_openai(values: Mapping[str, Any]) -> dict[str, Any]:
    """Request fields under OpenAI names, whichever spelling the caller used; None values are dropped. A structured
    output (json_schema, regex, choice, grammar) goes into vLLM's `structured_outputs` object, as the server takes
    it."""
    body: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in _STRUCTURED_TO_VLLM:
            body.setdefault("structured_outputs", {})[_STRUCTURED_TO_VLLM[name]] = value
        else:
            body[openai_name(name)] = value
    return body


def structured_output_fields(spec: Any, source: str = "structured_outputs") -> dict[str, Any]:
    """vLLM's `structured_outputs` (a dict or an object with those attributes) as SamplingParams fields; a key this
    engine does not support raises ValueError naming it."""
    items = spec.items() if isinstance(spec, Mapping) else vars(spec).items()
    fields_: dict[str, Any] = {}
    for key, value in items:
        if value is None or value is False:
            continue
        if key not in STRUCTURED_OUTPUTS:
            raise ValueError(f"{source}[{key!r}] is not supported by the rollout engine; supported: "
                             f"{sorted(STRUCTURED_OUTPUTS)}")
        name = STRUCTURED_OUTPUTS[key]
        if name in fields_:
            raise ValueError(f"{source} sets more than one of json and json_object; pass one")
        fields_[name] = JSON_OBJECT_SCHEMA if key == "json_object" else value
    return fields_


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
        if key == "structured_outputs" and value is not None:
            overrides.update(structured_output_fields(value, f"{source}['structured_outputs']"))
            continue
        if key in STRUCTURED_KWARGS:
            if value is not None:
                overrides.update(structured_output_fields({STRUCTURED_KWARGS[key]: value}, source))
            continue
        name = sampling_name(key)
        if name not in _SAMPLING_FIELDS:
            supported = sorted(_SAMPLING_FIELDS | set(RENAMED) | set(STRUCTURED_KWARGS) | {"structured_outputs"})
            raise ValueError(f"{source}[{key!r}] is not supported by the rollout engine; supported: {supported} "
                             f"(ignored: {sorted(ignored)})")
        overrides[name] = value
    return overrides


__all__ = ["IGNORED_GENERATION_KWARGS", "JSON_OBJECT_SCHEMA", "RENAMED", "SAME_NAMES", "STRUCTURED_KWARGS",
           "STRUCTURED_OUTPUTS", "openai_name", "sampling_name", "sampling_overrides", "structured_output_fields",
           "to_openai"]
