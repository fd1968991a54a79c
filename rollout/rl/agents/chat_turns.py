"""ChatTurns: the token ids that chat messages add after a model turn, rendered on their own.

Rendering the whole conversation again each turn would re-tokenize the model's own tokens from decoded text, which
can change them (the trainer would then score a sequence the model never saw), and costs O(conversation) per turn.
Instead the new messages are rendered after a fixed stand-in conversation, and only the tokens past that stand-in are
kept: the messages' own tokens, framed as the template frames them, followed by the generation prompt of the next
assistant turn. This needs a template that renders earlier messages the same whatever follows (prefix-preserving),
which is checked.

The model's turn ended on its end-of-turn token (EOS); whatever the template writes after that token (a newline, say)
belongs to the appended tokens, because the model never generated it.
"""

from __future__ import annotations

from typing import Any

_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ChatTurns:
    """Renders environment messages (tool results, user turns) into the token ids to append."""

    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("an environment that answers with messages needs a tokenizer with a chat template: "
                             "RolloutGenerator(model, tokenizer=...); or answer with token_ids or text")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._prefix = self._stand_in_prefix()

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 **self.kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _stand_in_prefix(self) -> list[int]:
        """The stand-in conversation's ids up to the assistant's end-of-turn token (EOS), where a model turn ends."""
        prefix = self._ids(_STAND_IN, generation_prompt=False)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, t in enumerate(prefix) if t == eos]
        return prefix[:ends[-1] + 1] if ends else prefix

    def render(self, messages: list[dict]) -> list[int]:
        """Ids of `messages` appended after a model turn, ending with the next assistant turn's generation prompt.

        Raises ValueError if the template renders the earlier conversation differently once messages follow.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"messages must be a list of chat messages ({{'role': ..., 'content': ...}}), got "
                             f"{messages!r:.200}")
        full = self._ids(_STAND_IN + messages, generation_prompt=True)
        if full[:len(self._prefix)] != self._prefix:
            raise ValueError("the chat template renders earlier messages differently once more messages follow "
                             "(it is not prefix-preserving), so a turn cannot be rendered on its own; answer with "
                             "token_ids instead, or use a prefix-preserving template")
        return full[len(self._prefix):]
