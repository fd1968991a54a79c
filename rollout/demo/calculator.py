"""A calculator tool for the addition task: the tiny policy learns to call it and copy its answer.

The embedded policy (``rollout/assets/tiny-policy``) knows two-digit addition but samples the units digit badly. This
module gives it a chat format with tool calls (special tokens for the roles and call markers, plus two tokens that
spell the JSON around the expression) and a short supervised warm-up on the format: the user asks ``"37+45="``, the
assistant answers with a call, the tool answers ``82``, the assistant repeats it::

    <user>37+45=<eos><assistant><call>{"name": "calculator", "arguments": {"expression": "37+45"}}</call><eos>
    <tool>82<eos><assistant>82<eos>

The chat template renders exactly that, is prefix-preserving (TRL's tool loop and `rollout.rl.agents.chat_turns` need
it), and `RESPONSE_TEMPLATE` lets ``tokenizer.parse_response`` find the tool calls. A briefly warmed-up policy calls
the tool but copies the expression and the result unreliably, so the reward (a correct final answer) has room to rise
under GRPO with the tool: see ``examples/agent_tool_grpo.py``.
"""

from __future__ import annotations

import json
import logging
import random
import re
from typing import Any

import torch

from rollout.demo import task

logger = logging.getLogger(__name__)

ROLE_TOKENS = ["<user>", "<assistant>", "<tool>", "<call>", "</call>"]
CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'  # one token: the JSON before the expression
CALL_CLOSE = '"}}'  # one token: the JSON after it

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "<assistant>{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] -%}"
    "<call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}</call>"
    "{%- endfor -%}<eos>"
    "{%- else -%}<{{ m.role }}>{{ m.content }}<eos>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- endif -%}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {"open": "<call>", "close_pattern": "</call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": "<eos>", "content": "text"},
    },
}

_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*$")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of two integers.

    Args:
        expression: two integers joined by +, - or *, for example "37+45".
    """
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError(f"cannot evaluate {expression!r}: expected two integers joined by +, - or *")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


# ------------------------------------------------------------------------------------------------ policy
def tool_tokenizer(tokenizer):
    """The tiny policy's tokenizer with the tool-calling chat format added (in place; returned for chaining)."""
    tokenizer.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tokenizer.add_tokens([CALL_OPEN, CALL_CLOSE])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def tool_policy(model, tokenizer):
    """The policy with embeddings for the new tokens (the tokenizer must come from `tool_tokenizer`)."""
    model.resize_token_embeddings(len(tokenizer))
    model.config.vocab_size = len(tokenizer)
    return model


def prompt_messages(problem: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem}]


def worked_example(tokenizer, problem: str, answer: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one episode done right: the call, the tool's answer (masked), the answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": problem.rstrip("=")}}}
    messages = [*prompt_messages(problem), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": answer}, {"role": "assistant", "content": answer}]
    ids = _chat_ids(tokenizer, messages, generation_prompt=False)
    mask, role = [], None
    assistant, tool, user = (tokenizer.convert_tokens_to_ids(t) for t in ("<assistant>", "<tool>", "<user>"))
    for t in ids:  # the model's tokens: everything an <assistant> marker opens, up to the next role marker
        role = "model" if t == assistant else "other" if t in (tool, user) else role
        mask.append(int(role == "model" and t != assistant))
    return ids, mask


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=True)
    return list(out["input_ids"])


def warm_up(model, tokenizer, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Supervised steps on worked examples (loss on the model's tokens only); returns the loss per step.

    A few dozen steps teach the format only partly, which is the point: the RL that follows has to finish the job.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id
    model.train()
    losses = []
    for _ in range(steps):
        rows = [worked_example(tokenizer, r["prompt"], r["answer"])
                for r in task.make_prompts(batch_size, seed=rng.getrandbits(32))]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
        mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows], dtype=torch.bool)
        attention = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    logger.info("warm-up: %d steps, loss %.3f -> %.3f", steps, losses[0] if losses else 0, losses[-1] if losses else 0)
    return losses


# ------------------------------------------------------------------------------------------------ rewards
def final_answer(completion: Any) -> str:
    """The content of the last assistant message of a conversational completion (or the text itself)."""
    if isinstance(completion, list):
        contents = [m.get("content") or "" for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return contents[-1] if contents else ""
    return task.parse_answer(completion)


def reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: 1.0 where the final answer is the right sum, else 0.0."""
    return [1.0 if final_answer(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)]


def tool_calls_in(completion: Any) -> int:
    """How many tool calls a conversational completion made."""
    if not isinstance(completion, list):
        return 0
    return sum(len(m.get("tool_calls") or []) for m in completion if isinstance(m, dict))


def make_dataset(n: int, seed: int = 0):
    """A ``datasets.Dataset`` of conversational prompts and their answers."""
    from datasets import Dataset

    rows = task.make_prompts(n, seed)
    return Dataset.from_dict({"prompt": [prompt_messages(r["prompt"]) for r in rows],
                              "answer": [r["answer"] for r in rows]})


class CalculatorEnv:
    """An Environment for `RolloutGenerator.run_episodes`: a turn with a calculator call gets the tool's answer (as a
    tool message, rendered on its own); a turn without one is the final answer, rewarded 1.0 if it is the right sum.

    `answers[j]` is the answer to prompt j. The model's text is only read (for the call); what is appended is the
    tool message's tokens, never a re-encoding of the model's text.
    """

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers

    def step(self, turn):
        from rollout.rl.agents import EnvResponse

        text = turn.text
        expression = parse_call(text)
        if expression is not None:
            try:
                result = calculator(expression)
            except ValueError:
                result = ""
            return EnvResponse(messages=[{"role": "tool", "name": "calculator", "content": result}],
                               info={"expression": expression})
        answer = text.split(self.tokenizer.eos_token)[0].strip()
        return EnvResponse(reward=float(answer == self.answers[turn.info.prompt_index]), done=True)


def parse_call(text: str) -> str | None:
    """The expression of a ``<call>...</call>`` in decoded model text, or None if there is no well-formed call."""
    match = re.search(r"<call>(.*?)</call>", text)
    if match is None:
        return None
    try:
        call = json.loads(match[1])
        return str(call["arguments"]["expression"]) if call["name"] == "calculator" else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None
