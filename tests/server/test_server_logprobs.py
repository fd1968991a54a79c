"""Logprobs through the OpenAI API, checked with the official `openai` client: echo with prompt logprobs, max_tokens=0,
top-k alternatives, chat logprobs, streaming, and the /score_completions extension, against a plain forward."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
import torch

from rollout.client import RolloutClient
from tests.helpers.models import random_prompts, tiny_model
from tests.helpers.server import running_server, tiny_app

MODEL = "tiny"
TOL = 1e-5


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine loop, the references and the clients share this process
    model = tiny_model("qwen3")
    app = tiny_app(model=model)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, model=model, tokenizer=app.state.backend.tokenizer,
                              oai=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))
    torch.set_num_threads(threads)


@torch.no_grad()
def reference(server, ids: list[int]) -> torch.Tensor:
    """The model's own fp32 log_softmax(logits) over `ids` (row i: the distribution of token i + 1)."""
    return server.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def text_of(server, token: int) -> str:
    return server.tokenizer.decode([token], skip_special_tokens=False)


def check_legacy(server, logprobs, ids: list[int], k: int, first_is_prompt: bool = True) -> None:
    """tokens, token_logprobs, top_logprobs (the k likeliest plus the token itself) and text_offset over `ids`."""
    ref = reference(server, ids)
    assert logprobs.tokens == [text_of(server, t) for t in ids]
    offsets = [0]
    for tok in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert logprobs.text_offset == offsets
    if first_is_prompt:
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row, token = ref[i - 1], ids[i]
        assert abs(logprobs.token_logprobs[i] - row[token].item()) < TOL, i
        top = logprobs.top_logprobs[i]
        values, alternatives = row.topk(k)
        expected = {text_of(server, t): v for t, v in zip(alternatives.tolist(), values.tolist())}
        expected.setdefault(text_of(server, token), row[token].item())
        assert top.keys() == expected.keys() and len(top) <= k + 1
        assert all(abs(top[key] - expected[key]) < TOL for key in top)


@pytest.mark.parametrize("k", [0, 3])
def test_echo_with_max_tokens_zero_returns_the_prompts_logprobs(server, k):
    text, ids = "w7 w3 w99 w12 w5", random_prompts([13], seed=1)[0]
    r = server.oai.completions.create(model=MODEL, prompt=[text, ids], max_tokens=0, echo=True, logprobs=k)
    assert [c.text for c in r.choices] == [text, server.tokenizer.decode(ids)]
    assert r.usage.completion_tokens == 0 and all(c.finish_reason == "length" for c in r.choices)
    check_legacy(server, r.choices[0].logprobs, server.tokenizer(text)["input_ids"], k)
    check_legacy(server, r.choices[1].logprobs, ids, k)


def test_echo_and_generation_report_the_models_own_logprobs(server):
    ids = random_prompts([9], seed=2)[0]
    r = server.oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, echo=True, logprobs=5, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    generated = choice.model_extra["token_ids"]
    assert len(generated) == 6 and len(choice.logprobs.tokens) == len(ids) + 6
    check_legacy(server, choice.logprobs, ids + generated, 5)
    # Greedy: the sampled distribution is a point mass (the rollout contract says 0), the API field is the model's.
    assert choice.model_extra["rollout"]["logprobs"] == [0.0] * 6
    assert all(lp < 0 for lp in choice.logprobs.token_logprobs[len(ids):])
    for i in range(len(ids), len(ids) + 6):  # a greedy token is the likeliest of its alternatives
        top = choice.logprobs.top_logprobs[i]
        assert max(top, key=top.get) == choice.logprobs.tokens[i]


def test_sampled_tokens_report_untempered_logprobs_and_n_choices_agree(server):
    ids = random_prompts([7], seed=3)[0]
    r = server.oai.completions.create(model=MODEL, prompt=ids, max_tokens=5, logprobs=2, temperature=0.6,
                                      n=2, seed=11, echo=True,
                                      extra_body={"top_k": 5, "ignore_eos": True, "return_token_ids": True})
    for choice in r.choices:
        check_legacy(server, choice.logprobs, ids + choice.model_extra["token_ids"], 2)
    prompt_part = [c.logprobs.token_logprobs[:len(ids)] for c in r.choices]
    assert prompt_part[0] == prompt_part[1]


def test_logprobs_bounds_and_max_tokens_zero_needs_echo(server):
    r = server.oai.completions.create(model=MODEL, prompt="w1 w2 w3", max_tokens=2, logprobs=20, temperature=0)
    assert all(20 <= len(top) <= 21 for top in r.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as info:
        server.oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        server.oai.completions.create(model=MODEL, prompt="w1 w2", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        server.oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1"}], max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_chat_logprobs_in_the_chat_format(server):
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    r = server.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True,
                                           top_logprobs=4, temperature=0.9, seed=3,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = r.choices[0]
    prompt = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    generated = choice.model_extra["token_ids"]
    ref = reference(server, prompt + generated)
    assert len(choice.logprobs.content) == len(generated) == 5
    for t, (entry, token) in enumerate(zip(choice.logprobs.content, generated)):
        row = ref[len(prompt) - 1 + t]
        assert entry.token == text_of(server, token) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - row[token].item()) < TOL
        values, alternatives = row.topk(4)
        assert [a.token for a in entry.top_logprobs] == [text_of(server, a) for a in alternatives.tolist()]
        assert torch.allclose(torch.tensor([a.logprob for a in entry.top_logprobs]), values, atol=TOL)
    plain = server.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                               temperature=0)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)


def test_streamed_echo_logprobs_equal_the_whole_response(server):
    ids = random_prompts([10], seed=4)[0]
    kwargs = dict(model=MODEL, prompt=ids, echo=True, logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    for max_tokens in (0, 4):
        whole = server.oai.completions.create(max_tokens=max_tokens, **kwargs).choices[0].logprobs
        chunks = [c.choices[0].logprobs for c in server.oai.completions.create(max_tokens=max_tokens, stream=True,
                                                                               **kwargs)]
        streamed = [lp for lp in chunks if lp is not None]
        for name in ("tokens", "token_logprobs", "top_logprobs"):
            assert [x for lp in streamed for x in getattr(lp, name)] == getattr(whole, name), name


def test_score_endpoint(server):
    prompt = random_prompts([21], seed=5)[0]
    completions = random_prompts([6, 9], seed=6)
    with RolloutClient(server.url, timeout=60) as client:
        body = client.score([prompt, prompt, "w1 w2"], [*completions, "w3 w4"], top_logprobs=2)
    assert body["weight_version"] == 0 and [d["index"] for d in body["data"]] == [0, 1, 2]
    for d in body["data"]:
        p, c = d["prompt_token_ids"], d["token_ids"]
        ref = reference(server, p + c)
        expected = [ref[len(p) - 1 + t, tok].item() for t, tok in enumerate(c)]
        assert d["logprobs"] == pytest.approx(expected, abs=TOL)
        assert [len(top) for top in d["top_logprobs"]] == [2] * len(c)
        assert list(map(int, d["top_logprobs"][0])) == ref[len(p) - 1].topk(2).indices.tolist()
    assert body["data"][0]["token_ids"] == completions[0]
    with RolloutClient(server.url, timeout=60) as client:
        with pytest.raises(Exception, match="one completion per prompt"):
            client.score([prompt], [])
