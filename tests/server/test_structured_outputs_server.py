"""Structured outputs through the OpenAI-compatible server, with the official `openai` client: `response_format`
(json_object, json_schema), vLLM's `structured_outputs` extension, `logit_bias`, and forced tool calls (`tools` +
`tool_choice` "required" or a named function). A random-weight model must still answer schema-valid JSON.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import torch

from rollout import ContinuousBatchingConfig
from rollout.client import RolloutClient
from rollout.server import create_app
from tests.helpers.models import tiny_model
from tests.helpers.server import running_server
from tests.helpers.tokenizers import json_tokenizer

MODEL = "tiny-json"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome", "oslo"]},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
MESSAGES = [{"role": "user", "content": "w1 w2 ok"}]


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = json_tokenizer()
    model = tiny_model("qwen3", seed=1, lm_head_scale=1.0, vocab_size=384)
    app = create_app(model, tokenizer, MODEL, ContinuousBatchingConfig(page_size=8, num_blocks=256))
    with running_server(app) as url:
        yield SimpleNamespace(url=url, tokenizer=tokenizer, engine=app.state.backend.engine)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(oai, **kw):
    kw = {"max_tokens": 120, "temperature": 1.0, "seed": 3, **kw}
    return oai.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)


def test_response_format_json_schema(oai):
    r = chat(oai, n=3, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_schema_streamed(oai):
    stream = chat(oai, stream=True, response_format={"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object_with_logit_bias(server, oai):
    """Any JSON object; biases toward '}' (and against the merged '{"' token) make the random model close it at
    once (both features at work)."""
    tok = server.tokenizer
    bias = {str(tok.convert_tokens_to_ids("}")): 30, str(tok.convert_tokens_to_ids('{"')): -100}
    r = chat(oai, response_format={"type": "json_object"}, logit_bias=bias)
    assert json.loads(r.choices[0].message.content) == {}
    completion = oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=60, temperature=1.0, seed=2,
                                        extra_body={"response_format": {"type": "json_object"}}, logit_bias=bias)
    assert json.loads(completion.choices[0].text) == {}


def test_structured_outputs_extension_on_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="w1", max_tokens=30, temperature=1.0, seed=5, n=4,
                               extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2,4}"}})
    assert all(re.fullmatch(r"\d{3}-[a-z]{2,4}", c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["positive", "negative", "neutral"]
    r = oai.completions.create(model=MODEL, prompt="w1", max_tokens=30, temperature=1.0, seed=5, n=4,
                               extra_body={"structured_outputs": {"choice": choices}})
    assert {c.text for c in r.choices} <= set(choices)


def test_rollout_client_sends_structured_outputs(server):
    with RolloutClient(server.url, timeout=60) as client:
        samples = client.generate(["w1 w2"], n=3, max_new_tokens=40, temperature=1.0, seed=4, json_schema=SCHEMA)
    for sample in samples:
        assert sample["finish_reason"] == "stop"
        jsonschema.validate(json.loads(sample["text"]), SCHEMA)


def test_logit_bias_forces_and_bans_tokens(server, oai):
    forced = server.tokenizer.convert_tokens_to_ids("x")
    r = oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=6, temperature=0, logit_bias={str(forced): 100},
                               extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [forced] * 6
    plain = oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=6, temperature=0,
                                   extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    banned = oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=6, temperature=0,
                                    logit_bias={str(t): -100 for t in plain},
                                    extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
    assert not set(banned) & set(plain)


def test_named_tool_choice_forces_that_function(oai):
    r = chat(oai, n=3, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_forces_a_valid_call_of_some_tool(oai):
    names = set()
    for seed in range(4):
        r = chat(oai, seed=seed, n=2, tools=TOOLS, tool_choice="required")
        for choice in r.choices:
            (call,) = choice.message.tool_calls
            schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
            names.add(call.function.name)
    assert names == {"get_weather", "get_time"}, "the model picks the tool: both should appear"


def test_auto_tool_choice_constrains_nothing(oai):
    r = chat(oai, max_tokens=8, tools=TOOLS, tool_choice="auto")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kw, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", stream=True), "stream"),
    (dict(tools=[{"type": "function"}], tool_choice="required"), "tools[0]"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a+"}}),
     "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
    (dict(logit_bias={"5": 150}), "logit_bias"),
    (dict(logit_bias={"100000": 1}), "logit_bias"),
    (dict(logit_bias={"five": 1}), "logit_bias"),
])
def test_bad_structured_requests_are_400s_naming_the_field(oai, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(oai, **kw)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
