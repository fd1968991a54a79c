"""Token in / token out chat: an agent framework continues a conversation from the server's own ids, so no token is
ever re-tokenized, and each turn prefills little more than what it appends."""

import pytest

pytest.importorskip("fastapi")

from rollout import ContinuousBatchingConfig
from rollout.server import create_app
from tests.helpers.models import tiny_model
from tests.helpers.server import PAGE, local_client
from tests.helpers.tokenizers import json_tokenizer, tiny_tokenizer

CHAT = {"model": "tiny", "temperature": 0, "max_tokens": 6, "return_token_ids": True}


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={**CHAT, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def test_a_conversation_continues_from_ids_with_only_the_new_turn_rendered():
    tok = tiny_tokenizer()
    with local_client() as client:
        first = [{"role": "user", "content": "w1 w2 w3"}]
        prompt, completion = _chat(client, messages=first, ignore_eos=True)
        assert prompt == tok.apply_chat_template(first, add_generation_prompt=True)["input_ids"]
        assert len(completion) == 6
        stats = client.app_state.backend.manager.stats
        before = stats()
        tool = [{"role": "user", "content": "w9 w8"}]
        again, more = _chat(client, messages=tool, prompt_token_ids=prompt + completion)
        # the given ids exactly, then the new message framed by the template and the next assistant opening
        assert again == prompt + completion + tok("<user> w9 w8 </s> <assistant>", add_special_tokens=False)[
            "input_ids"]
        assert more
        prefilled = stats().prefill_tokens - before.prefill_tokens
        appended = len(again) - len(prompt) - len(completion)
        assert prefilled <= appended + PAGE, "the conversation's KV pages should come from the prefix cache"
        only_ids, _ = _chat(client, messages=[], prompt_token_ids=again + more)
        assert only_ids == again + more


def test_ids_that_would_retokenize_differently_are_kept_as_given():
    """A byte-level BPE merges "ab" into one token, but the model may have produced "a" and "b": chat from ids keeps
    them; rendering the decoded text again would not."""
    tok = json_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tok))
    app = create_app(model, tok, "tiny", ContinuousBatchingConfig(page_size=PAGE, num_blocks=128))
    split = tok.convert_tokens_to_ids(["n", "a", "m", "e"])
    assert tok(tok.decode(split), add_special_tokens=False)["input_ids"] != split  # "name" re-tokenizes to fewer ids
    base = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)["input_ids"]
    with local_client(app) as client:
        prompt, _ = _chat(client, messages=[{"role": "tool", "content": "1"}], prompt_token_ids=base + split)
    assert prompt[:len(base) + len(split)] == base + split


def test_bad_token_input_is_a_400_naming_the_field():
    with local_client() as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": []})
        assert r.status_code == 400 and "prompt_token_ids" in r.text
        r = client.post("/v1/chat/completions", json={**CHAT, "messages": [], "prompt_token_ids": [10**6]})
        assert r.status_code == 400 and "vocabulary" in r.text
