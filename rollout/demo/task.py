"""A tiny synthetic verifiable task: two-digit addition.

The policy sees a prompt such as ``"37+45="`` and must answer ``"82"`` followed by its end-of-sequence token.
Prompts are 6 characters (6 tokens with the character-level tokenizer shipped in ``rollout/assets/tiny-policy``),
answers 2-3 digits plus EOS.

``reward`` follows TRL's reward-function signature: TRL calls ``reward(prompts=..., completions=...,
completion_ids=..., answer=[...], ...)``, passing every dataset column as a keyword argument; completions are plain
strings when the prompts are plain strings (a list of chat messages is also accepted).
"""

from __future__ import annotations

import random
from typing import Any

#: Operands are drawn uniformly from this inclusive range.
LOW, HIGH = 10, 99

#: The end-of-answer marker.  TRL decodes completions with ``skip_special_tokens=True``, so it usually never appears in
#: the completion text; when it does (decoding that keeps special tokens), everything from it on is ignored.
EOS = "<eos>"

#: Seed of the 500 held-out evaluation prompts; ``examples/train_tiny_policy.py`` never trains on them.
EVAL_SEED = 1234
EVAL_SIZE = 500


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` random problems ``{"prompt": "37+45=", "answer": "82"}``, reproducible from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        out.append({"prompt": format_prompt(a, b), "answer": str(a + b)})
    return out


def eval_prompts() -> list[dict[str, str]]:
    """The fixed held-out evaluation set (``EVAL_SIZE`` prompts from ``EVAL_SEED``)."""
    return make_prompts(EVAL_SIZE, EVAL_SEED)


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": "..."}]
        return "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in completion)
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion)


def parse_answer(completion: Any) -> str:
    """The answer part of a completion: the text before the end-of-answer marker, whitespace stripped."""
    text = _completion_text(completion)
    cut = text.find(EOS)
    if cut >= 0:
        text = text[:cut]
    return text.strip()


def is_correct(completion: Any, answer: str) -> bool:
    return parse_answer(completion) == str(answer).strip()


def reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 where the completion is exactly the right sum, else 0.0."""
    return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def accuracy(completions: list[Any], answer: list[str]) -> float:
    """Mean of :func:`reward` (0.0 for an empty batch)."""
    rewards = reward(completions, answer)
    return sum(rewards) / len(rewards) if rewards else 0.0


def make_dataset(n: int, seed: int = 0):
    """A ``datasets.Dataset`` with columns ``prompt`` and ``answer`` (requires the ``datasets`` package)."""
    from datasets import Dataset

    rows = make_prompts(n, seed)
    return Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
