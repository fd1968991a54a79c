"""Completion text as OpenAI returns it: stop tokens and stop strings cut off, and streamed as safe deltas.

The engine's token ids keep the stop token (trainers need it); the text does not, like OpenAI and vLLM. Streaming
decodes only the tokens that arrived since the last delta, after a few already-decoded tokens of context whose text is
then removed (a long stream costs O(new tokens) per delta, not a decode of the whole completion each time), falls back
to a whole decode whenever the context's text is not a prefix of that decode, and holds back the tail that could still
turn into a stop string or is an incomplete UTF-8 character, so the concatenated deltas equal the non-streamed text
(the last delta is cut from one whole decode).

Each decode goes straight to the `tokenizers` backend where that is what `tokenizer.decode` would do anyway
(`text_decoder`): transformers' `decode` wraps a fast Rust call in several times its cost in Python (argument
conversion, batch checks, the clean-up flag), and a stream decodes twice per token (benchmarks/RESULTS.md, "Serving").

For completions the text is decoded after a few prompt tokens of context and the context's text is then removed:
tokenizers such as SentencePiece drop a word's leading space when it is decoded alone, so "The capital is" +
"Paris" would otherwise lose the space that the model generated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

_REPLACEMENT = "\ufffd"


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string; and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, calling the Rust backend directly when that is all the
    call would do: a transformers `TokenizersBackend` with neither `decode` nor `_decode` overridden and no clean-up of
    tokenization spaces. Any other tokenizer (a slow one, a wrapper, one with clean-up) keeps its own `decode`."""
    from transformers import TokenizersBackend  # the server imports transformers anyway; text.py alone need not

    backend = getattr(tokenizer, "_tokenizer", None)
    own = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and own.decode is TokenizersBackend.decode
            and own._decode is TokenizersBackend._decode and not tokenizer.clean_up_tokenization_spaces
            and callable(getattr(backend, "decode", None))):
        def backend_decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=True)
        return backend_decode

    def tokenizer_decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer_decode


class CompletionText:
    """Turns a growing list of generated ids into text deltas for one choice."""

    CONTEXT_TOKENS = 8

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stop_ids: Collection[int] = (),
                 context: Sequence[int] = ()) -> None:
        self.decode = text_decoder(tokenizer)
        self.context = list(context)[-self.CONTEXT_TOKENS:]
        self.context_text = self.decode(self.context) if self.context else ""
        self.stop_strings = [s for s in stop_strings if s]
        self.stop_ids = set(stop_ids)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.sent = ""
        self._text = ""  # the decoded text of the first `_done` generated tokens (it ends on a whole character)
        self._done = 0

    def full_text(self, tokens: Sequence[int], finish_reason: str | None) -> str:
        """The final text of a completion: without the stop token that ended it, cut at the first stop string."""
        tokens = list(tokens)
        if finish_reason == "stop" and tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        text = self._decode(tokens) if tokens else ""
        return truncate_at_stop(text, self.stop_strings)[0]

    def _decode(self, tokens: list[int]) -> str:
        return self._after(self.context, self.context_text, tokens)

    def _after(self, context: list[int], context_text: str, tokens: list[int]) -> str:
        """The text `tokens` add after `context` (whose decoded text is `context_text`); decoded alone when the
        context's text is not a prefix of the decode of both."""
        if context:
            both = self.decode(context + tokens)
            if both.startswith(context_text):
                return both[len(context_text):]
        return self.decode(tokens)

    def _running_text(self, tokens: Sequence[int]) -> str:
        """The decoded text of `tokens`, a continuation of the last call's: only the new tokens are decoded, after
        up to CONTEXT_TOKENS decoded ones (or the prompt's context) so leading spaces and merges come out as in a
        whole decode. A piece ending in an incomplete character is not kept: it is decoded again with what follows."""
        done = self._done
        if len(tokens) < done:  # not a continuation (cannot happen for one stream): start over
            self._text, self._done, done = "", 0, 0
        new = list(tokens[done:])
        if not new:
            return self._text
        window = list(tokens[max(0, done - self.CONTEXT_TOKENS):done])
        if len(window) < self.CONTEXT_TOKENS:
            window = self.context[max(0, len(self.context) - self.CONTEXT_TOKENS + len(window)):] + window
        window_text = self.context_text if window == self.context else (
            self.decode(window) if window else "")
        piece = self._after(window, window_text, new)
        if piece.endswith(_REPLACEMENT):
            return self._text + piece
        self._text += piece
        self._done = len(tokens)
        return self._text

    def delta(self, tokens: Sequence[int], finished: bool, finish_reason: str | None = None) -> str:
        """New text since the previous call; on `finished` everything left."""
        if finished:
            text = self.full_text(tokens, finish_reason)
        else:
            text = truncate_at_stop(self._running_text(tokens), self.stop_strings)[0].rstrip(_REPLACEMENT)
            if self.stop_strings and self.hold:
                text = text[:max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent):  # the tokenizer re-spelled earlier text: nothing safe to add yet
            return ""
        out, self.sent = text[len(self.sent):], text
        return out
