"""What a request's logits processors are, checked once at submission: logit bias, allowed ids, bad words and the
request's own processors, as CPU tensors (RequestProcessors). Plain request data, so resolving a request's settings
needs nothing of the sampler; logits_processors.py applies them to a step's rows.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessor

from rollout.validation import InvalidRequestError

if TYPE_CHECKING:
    from rollout.sampling_params import SamplingParams

MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token in practice, +100 forces it
_NEG_INF = float("-inf")
PAD_ID = -1  # never a token id: pads bad-word prefixes and sequence tails


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid sampling parameters: {param} {message}.", param)


@dataclass(frozen=True, eq=False)
class RequestProcessors:
    """One request's processors, checked and turned into (CPU) tensors once, at submission."""

    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    banned_ids: torch.Tensor | None = None  # one-token bad words: always masked
    bad_prefixes: torch.Tensor | None = None  # [words, longest prefix] of multi-token bad words, PAD_ID on the left
    bad_targets: torch.Tensor | None = None  # each such word's last token: masked right after its prefix
    custom: tuple = ()  # the request's own processors, in order

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id must index the model's logits; InvalidRequestError naming the field otherwise."""
        for param, ids in (("logit_bias", self.bias_ids), ("allowed_token_ids", self.allowed_ids),
                           ("bad_words_ids", self.banned_ids), ("bad_words_ids", self.bad_prefixes),
                           ("bad_words_ids", self.bad_targets)):
            if ids is not None and ids.numel() and int(ids.max()) >= vocab_size:
                raise _invalid(param, f"has token id {int(ids.max())}, outside the model's vocabulary "
                                      f"[0, {vocab_size})")


# ------------------------------------------------------------------------------------------------- building


def request_processors(params: SamplingParams) -> RequestProcessors | None:
    """The processors `params` asks for, validated and ready for the sampler; None when it asks for none."""
    parts: dict = {}
    if params.logit_bias:
        parts["bias_ids"], parts["bias_values"] = _logit_bias(params.logit_bias)
    if params.allowed_token_ids is not None:
        allowed = _token_ids(params.allowed_token_ids, "allowed_token_ids")
        if not allowed:
            raise _invalid("allowed_token_ids", "is empty, so no token could ever be sampled; pass at least one id "
                                                "(or None for no restriction)")
        parts["allowed_ids"] = torch.tensor(sorted(set(allowed)))
    if params.bad_words_ids:
        parts.update(_bad_words(params.bad_words_ids))
    if params.logits_processors:
        parts["custom"] = _custom_processors(params.logits_processors)
    return RequestProcessors(**parts) if parts else None


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _token_ids(values, param: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _invalid(param, f"must be a list of token ids, got {type(values).__name__}")
    bad = next((v for v in values if not _is_token_id(v)), None)
    if bad is not None:
        raise _invalid(param, f"must hold non-negative integer token ids, got {bad!r}")
    return [int(v) for v in values]


def _logit_bias(bias) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenAI's logit_bias: {token id (an int, or its decimal string as JSON sends it): bias in [-100, 100]}."""
    if not isinstance(bias, Mapping):
        raise _invalid("logit_bias", f"must map token ids to biases, got {type(bias).__name__}")
    merged: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_token_id(token):
            raise _invalid("logit_bias", f"keys must be token ids, got {key!r}")
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or abs(value) > MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                                         f"{value!r} for token {key}")
        merged[int(token)] = float(value)
    ids = sorted(merged)
    return torch.tensor(ids, dtype=torch.long), torch.tensor([merged[i] for i in ids], dtype=torch.float32)


def _bad_words(words) -> dict[str, torch.Tensor]:
    """One-token words become a static mask; longer ones a padded prefix table matched against each row's tail."""
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
        raise _invalid("bad_words_ids", f"must be a list of token-id lists, got {type(words).__name__}")
    parsed = [_token_ids(w, "bad_words_ids") for w in words]
    if any(not w for w in parsed):
        raise _invalid("bad_words_ids", "must not contain an empty token sequence")
    single = sorted({w[0] for w in parsed if len(w) == 1})
    multi = sorted({tuple(w) for w in parsed if len(w) > 1})
    parts: dict[str, torch.Tensor] = {}
    if single:
        parts["banned_ids"] = torch.tensor(single, dtype=torch.long)
    if multi:
        longest = max(len(w) - 1 for w in multi)
        parts["bad_prefixes"] = torch.tensor([[PAD_ID] * (longest - len(w) + 1) + list(w[:-1]) for w in multi])
        parts["bad_targets"] = torch.tensor([w[-1] for w in multi])
    return parts


def _custom_processors(processors) -> tuple:
    if callable(processors) or isinstance(processors, (str, bytes)) or not isinstance(processors, Sequence):
        raise _invalid("logits_processors", f"must be a list of processors, got {type(processors).__name__} (wrap a "
                                            "single processor in a list)")
    for i, proc in enumerate(processors):
        if not callable(proc):
            raise _invalid("logits_processors", f"item {i} is a {type(proc).__name__}, not a callable "
                                                "(generated_ids, logits_row) -> logits_row or a transformers "
                                                "LogitsProcessor")
    return tuple(processors)


def processor_name(proc) -> str:
    """How errors name a processor: its class for objects, its qualified name for functions."""
    if isinstance(proc, LogitsProcessor) or not hasattr(proc, "__qualname__"):
        return type(proc).__name__
    return proc.__qualname__
