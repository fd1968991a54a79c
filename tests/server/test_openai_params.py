"""rollout.openai_params: the one mapping between OpenAI / vLLM request names and SamplingParams fields."""

from dataclasses import fields

import pytest

from rollout.openai_params import (
    IGNORED_GENERATION_KWARGS,
    JSON_OBJECT_SCHEMA,
    RENAMED,
    SAME_NAMES,
    STRUCTURED_OUTPUTS,
    openai_name,
    sampling_name,
    sampling_overrides,
    to_openai,
)
from rollout.sampling_params import SamplingParams

# Set by the server (from the model, from `echo`) or by scoring, never by an OpenAI request.
ENGINE_ONLY = {"do_sample", "eos_token_id", "prompt_logprobs_start", "prompt_logprobs_temperature"}


def test_every_sampling_field_has_exactly_one_openai_spelling():
    sampling_fields = {f.name for f in fields(SamplingParams)}
    structured = set(STRUCTURED_OUTPUTS.values())  # spelled inside vLLM's structured_outputs object
    mapped = set(RENAMED.values()) | SAME_NAMES | structured
    assert mapped | ENGINE_ONLY == sampling_fields, "a SamplingParams field the OpenAI mapping does not know"
    assert not set(RENAMED) & sampling_fields, "an OpenAI name that is also a different SamplingParams field"
    for field in sampling_fields - ENGINE_ONLY - structured:
        assert sampling_name(openai_name(field)) == field


def test_names_translate_both_ways():
    assert sampling_name("max_tokens") == "max_new_tokens" and openai_name("max_new_tokens") == "max_tokens"
    assert sampling_name("stop") == "stop_strings" and openai_name("min_new_tokens") == "min_tokens"
    assert sampling_name("top_p") == openai_name("top_p") == "top_p"


def test_to_openai_accepts_either_spelling_and_drops_none():
    assert to_openai({"max_new_tokens": 8, "stop_strings": ["x"], "temperature": 0.5, "seed": None}) == {
        "max_tokens": 8, "stop": ["x"], "temperature": 0.5}
    assert to_openai({"max_tokens": 8, "min_tokens": 2}) == {"max_tokens": 8, "min_tokens": 2}


def test_generation_kwargs_become_sampling_overrides():
    overrides = sampling_overrides({"max_tokens": 12, "stop": ["\n"], "top_k": 5, "min_new_tokens": 1, "n": 8,
                                    "skip_special_tokens": False, "logprobs": 0})
    assert overrides == {"max_new_tokens": 12, "stop_strings": ["\n"], "top_k": 5, "min_new_tokens": 1}
    params = SamplingParams(temperature=1.0).with_overrides(**overrides)
    assert params.max_new_tokens == 12 and params.stop_strings == ["\n"] and params.n == 1
    assert {"n", "logprobs"} <= IGNORED_GENERATION_KWARGS


def test_unknown_generation_kwarg_is_a_clear_error():
    with pytest.raises(ValueError, match=r"generation_kwargs\['best_of'\] is not supported.*max_tokens"):
        sampling_overrides({"temperature": 1.0, "best_of": 2})
    with pytest.raises(ValueError, match=r"request\['use_beam_search'\]"):
        sampling_overrides({"use_beam_search": True}, source="request")
    assert sampling_overrides({"n": 2}, ignored=frozenset()) == {"n": 2}  # n is a real field when not ignored


def test_structured_outputs_fold_into_vllms_object_and_back():
    assert to_openai({"regex": "a+", "max_new_tokens": 3}) == {"structured_outputs": {"regex": "a+"}, "max_tokens": 3}
    assert to_openai({"json_schema": {"type": "object"}}) == {"structured_outputs": {"json": {"type": "object"}}}
    assert sampling_overrides({"structured_outputs": {"json": {"type": "array"}}}) == {"json_schema": {"type": "array"}}
    assert sampling_overrides({"structured_outputs": {"json_object": True}}) == {"json_schema": JSON_OBJECT_SCHEMA}
    assert sampling_overrides({"structured_outputs_regex": r"\d+", "structured_outputs_choice": None}) == {
        "regex": r"\d+"}
    assert sampling_overrides({"logit_bias": {"3": -1.0}, "allowed_token_ids": [1]}) == {
        "logit_bias": {"3": -1.0}, "allowed_token_ids": [1]}
    with pytest.raises(ValueError, match=r"structured_outputs'\]\['structural_tag'\] is not supported"):
        sampling_overrides({"structured_outputs": {"structural_tag": "x"}})
    with pytest.raises(ValueError, match="more than one of json and json_object"):
        sampling_overrides({"structured_outputs": {"json": {}, "json_object": True}})
