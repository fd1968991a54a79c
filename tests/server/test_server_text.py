"""Streamed completion text: the deltas add up to the non-streamed text, and each delta decodes only new tokens."""

import pytest

from rollout.server.text import CompletionText, text_decoder
from tests.helpers.tokenizers import json_tokenizer, tiny_tokenizer

TEXT = 'héllo wörld ✓ 日本語 {"name": "alice", "tags": ["a", "b"]} ' * 12


class CountingTokenizer:
    """Wraps a tokenizer and counts the ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _stream(text: CompletionText, tokens: list[int], finish_reason: str = "length") -> str:
    out = [text.delta(tokens[:i], finished=False) for i in range(1, len(tokens))]
    return "".join(out) + text.delta(tokens, finished=True, finish_reason=finish_reason)


@pytest.mark.parametrize("make", [json_tokenizer, tiny_tokenizer])
def test_streamed_deltas_add_up_to_the_whole_text(make):
    tok = make()
    source = TEXT if make is json_tokenizer else " ".join(f"w{i % 200}" for i in range(300))
    tokens = tok.encode(source, add_special_tokens=False)
    context = tok.encode("w1 w2 w3" if make is tiny_tokenizer else "{", add_special_tokens=False)
    whole = CompletionText(tok, context=context).full_text(tokens, "length")
    assert _stream(CompletionText(tok, context=context), tokens) == whole
    if make is json_tokenizer:
        assert whole == TEXT  # byte-level: multi-byte characters split over tokens come out whole


def test_each_delta_decodes_only_the_new_tokens_and_a_bounded_context():
    tok = CountingTokenizer(json_tokenizer())
    tokens = tok.tokenizer.encode(TEXT, add_special_tokens=False)
    text = CompletionText(tok)
    _stream(text, tokens)
    per_delta = 2 * CompletionText.CONTEXT_TOKENS + 4  # context twice, the new token, a held-back character
    # decoding the whole completion each time would cost len(tokens)**2 / 2 ids (tens of thousands here)
    assert tok.decoded_ids <= len(tokens) * per_delta + 2 * len(tokens)


def test_stop_strings_are_held_back_and_cut_when_streamed():
    tok = json_tokenizer()
    tokens = tok.encode('{"name": "alice", "age": 31}', add_special_tokens=False)
    streamed = _stream(CompletionText(tok, stop_strings=['"age"']), tokens, finish_reason="stop")
    assert streamed == '{"name": "alice", '


@pytest.mark.parametrize("make", [json_tokenizer, tiny_tokenizer])
def test_the_text_decoder_equals_decode_skipping_special_tokens(make):
    tok = make()
    decode = text_decoder(tok)
    assert decode.__name__ == "backend_decode"  # these need no clean-up: the Rust backend is called directly
    source = TEXT if make is json_tokenizer else " ".join(f"w{i % 200}" for i in range(300))
    ids = tok.encode(source, add_special_tokens=False)
    special = sorted(tok.all_special_ids)
    for start in range(0, len(ids), 7):
        piece = ids[start:start + 11] + special  # special ids are dropped, as decode(skip_special_tokens=True) does
        assert decode(piece) == tok.decode(piece, skip_special_tokens=True)


def test_the_text_decoder_keeps_decode_where_it_would_clean_up_spaces_or_is_not_a_backend():
    tok = tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    assert text_decoder(tok).__name__ == "tokenizer_decode"
    counting = CountingTokenizer(json_tokenizer())
    assert text_decoder(counting)([5, 6, 7]) == counting.tokenizer.decode([5, 6, 7], skip_special_tokens=True)
    assert counting.decoded_ids == 3


def test_the_text_decoder_keeps_a_subclass_own_decode():
    class Shouting(type(tiny_tokenizer())):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    tok = tiny_tokenizer()
    tok.__class__ = Shouting
    assert text_decoder(tok)([5, 6]) == tok.decode([5, 6], skip_special_tokens=True) == "W0 W1"
