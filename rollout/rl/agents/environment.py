"""The environment interface of multi-turn episodes: what it is shown after each model turn, and what it answers.

An environment answers every model turn with the tokens to append (a tool result, an observation), a reward and
whether the episode is over. It answers in tokens, in text, or in chat messages; text is tokenized and messages are
rendered on their own (only the new turn), so the conversation is never re-encoded and the model's tokens are never
re-tokenized (re-tokenizing decoded text can change tokens, and the trainer would then score a sequence the model
never saw).

One environment object serves every episode of a call; each call names its episode, so a stateful environment keys
its state by `episode`, or is wrapped in `per_episode(factory)` to get a fresh instance per episode. Any method may be
`async def`; `reset` and `close` are optional.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EpisodeInfo:
    """Which episode a call is about: its index in the batch (prompt-major) and where it comes from."""

    episode: int
    prompt_index: int
    sample_index: int  # index within the prompt's group of n episodes
    prompt_ids: list[int]


@dataclass(frozen=True)
class ModelTurn:
    """One model turn, as the environment sees it."""

    info: EpisodeInfo
    turn: int  # 0 for the model's first turn
    token_ids: list[int]  # what the model generated this turn (its stop token included when it stopped on one)
    text: str | None  # those tokens decoded as they are, special tokens included (tool-call markers often are)
    finish_reason: str  # the turn's: "stop" or "length"
    conversation_ids: list[int]  # every token of the episode so far, this turn included

    @property
    def episode(self) -> int:
        return self.info.episode


@dataclass
class EnvResponse:
    """The environment's answer to a model turn. Give at most one of `token_ids`, `text` and `messages` (none: the
    model goes on right after its own turn); with `done=True` nothing is appended (no model turn would see it)."""

    token_ids: list[int] | None = None  # appended as they are
    text: str | None = None  # tokenized alone, without special tokens
    messages: list[dict] | None = None  # rendered with the chat template after the model's turn, generation prompt on
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # kept with the turn, for logging


@runtime_checkable
class Environment(Protocol):
    """`step` answers a model turn; `reset(info)` (optional) runs once per episode before its first `step`, and
    `close(info)` (optional) once when the episode ends, whatever the reason."""

    def step(self, turn: ModelTurn) -> EnvResponse: ...


class per_episode:  # lower case: used like a function, env=per_episode(MyEnv)
    """An Environment that gives each episode its own instance of `factory()` (made at reset, dropped at close)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self._instances: dict[int, Any] = {}

    def _instance(self, episode: int):
        if episode not in self._instances:
            self._instances[episode] = self.factory()
        return self._instances[episode]

    def reset(self, info: EpisodeInfo):
        reset = getattr(self._instance(info.episode), "reset", None)
        return reset(info) if reset is not None else None

    def step(self, turn: ModelTurn):
        return self._instance(turn.episode).step(turn)

    def close(self, info: EpisodeInfo):
        instance = self._instances.pop(info.episode, None)
        close = getattr(instance, "close", None)
        return close(info) if close is not None else None
