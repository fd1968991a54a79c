"""EpisodeRunner: many multi-turn episodes on one engine at once, the turns of different episodes interleaved.

Each episode alternates a model turn (one engine request) and its environment's answer (a call on EnvCalls). While an
episode waits for its environment the engine keeps generating for the others, and an answer puts the episode's next
turn into the engine at once. Every model turn is submitted with `keep_kv` and the next one `continues` it
(rollout.engine.core.kept_kv), so a turn prefills only what is new since the last one: the previous turn's last token
(sampled, never run through the model) and the environment's tokens. Per episode: prompt + appended tokens + one token
per continued turn; never the conversation again.

The calling thread steps the engine (`stepping_in_caller`) and handles every event itself: finished model turns
(routed to `on_output`) and settled environment calls. No episode state changes on another thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass, field

from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.engine.core.sequence_group import sequence_ids
from rollout.manager import ManagerError
from rollout.rl.agents.chat_turns import ChatTurns
from rollout.rl.agents.env_calls import EnvCalls, EnvTimeout
from rollout.rl.agents.environment import EnvResponse, EpisodeInfo, ModelTurn
from rollout.rl.agents.episode import Episode, TurnSpan
from rollout.rl.calls import EngineCalls
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed
from rollout.validation import check_prompt

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """An episode being played; only the runner's thread touches it."""

    info: EpisodeInfo
    seed: int
    token_ids: list[int]
    model_mask: list[int]
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    kept_logmass: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    running: str | None = None  # the engine sequence of the model turn in flight
    kept: str | None = None  # the finished sequence whose KV the next turn continues
    env_call: concurrent.futures.Future | None = None
    env_started: float = 0.0
    env_deadline: float | None = None  # when the runner gives up on env_call if it never settles
    finish_reason: str | None = None
    error: str | None = None
    seconds: float = 0.0

    def to_episode(self) -> Episode:
        return Episode(self.info.prompt_index, self.info.sample_index, self.info.prompt_ids, self.token_ids,
                       self.model_mask, self.logprobs, self.policy_logprobs, self.kept_logmass, self.weight_versions,
                       self.turns, self.rewards, self.finish_reason or "error", self.error, self.seconds)


class EpisodeRunner:
    """Plays one call's episodes to the end; see the module docstring."""

    def __init__(self, engine_calls: EngineCalls, env, params: SamplingParams, turn_tokens: int, max_turns: int,
                 max_length: int | None, env_calls: EnvCalls, tag: str, chat_template_kwargs: dict | None = None
                 ) -> None:
        self.engine_calls = engine_calls
        self.manager = engine_calls.manager
        self.tokenizer = engine_calls.tokenizer
        self.env = env
        self.params = params
        self.turn_tokens = turn_tokens  # max new tokens of one model turn
        self.max_turns = max_turns
        self.max_length = max_length
        self.calls = env_calls
        self.tag = tag
        self.chat_template_kwargs = chat_template_kwargs
        self.vocab_size = engine_calls.engine().vocab_size
        self._chat: ChatTurns | None = None
        self._events: collections.deque = collections.deque()
        self._by_sequence: dict[str, _Live] = {}
        self._episodes: list[_Live] = []
        self._live = 0
        self._closing: list[concurrent.futures.Future] = []  # env.close calls, awaited before `run` returns
        self._start = 0.0
        self.env_seconds = 0.0

    # --------------------------------------------------------------------- run
    def run(self, prepared: list[tuple[int, list[int], int]], base_seed: int) -> list[Episode]:
        """Play every episode: `prepared` holds (prompt index, prompt ids, group size) per prompt."""
        self._start = time.perf_counter()
        try:
            with self.manager.stepping_in_caller():
                for j, ids, size in prepared:
                    self._start_group(j, ids, size, derive_seed(base_seed, j, SeedStream.PROMPT))
                while self._live:
                    self.manager.wait_until(lambda: bool(self._events), self._next_deadline())
                    self._expire_env_calls()
                    while self._events:
                        self._handle(self._events.popleft())
        except BaseException:
            self._abandon()
            raise
        wait = None if self.calls.timeout is None else self.calls.timeout + _GRACE_S
        concurrent.futures.wait(self._closing, timeout=wait)
        return [ep.to_episode() for ep in self._episodes]

    def _start_group(self, j: int, ids: list[int], size: int, seed: int) -> None:
        """The first turn of a prompt's n episodes: one n-sample request, so the prompt is prefilled once."""
        request_id = f"{self.tag}-{j}"
        for i, sequence_id in enumerate(sequence_ids(request_id, size)):
            info = EpisodeInfo(len(self._episodes), j, i, ids)
            ep = _Live(info, derive_seed(seed, i, SeedStream.SAMPLE), list(ids), [0] * len(ids), running=sequence_id)
            self._episodes.append(ep)
            self._by_sequence[sequence_id] = ep
            self._live += 1
        self._submit(request_id, ids, self.params.with_overrides(n=size, seed=seed,
                                                                 max_new_tokens=self._turn_budget(len(ids))))

    def _submit(self, request_id: str, ids: list[int], params: SamplingParams, continues: str | None = None) -> None:
        self.engine_calls.submit(ids, request_id, params, on_output=self._on_output, keep_kv=True, continues=continues)

    def _turn_budget(self, length: int) -> int:
        return self.turn_tokens if self.max_length is None else min(self.turn_tokens, self.max_length - length)

    def _on_output(self, out: RequestOutput) -> None:
        """Routed outputs arrive on the stepping thread (or a cancelling one): queue finals for the runner."""
        if out.is_finished():
            self._events.append(("model", out))

    def _on_env_done(self, ep: _Live, future: concurrent.futures.Future) -> None:
        self._events.append(("env", ep, future))
        self.manager.notify()

    # ------------------------------------------------------------------ events
    def _handle(self, event: tuple) -> None:
        if event[0] == "model":
            self._model_turn_done(event[1])
        else:
            self._env_answered(event[1], event[2])

    def _model_turn_done(self, out: RequestOutput) -> None:
        ep = self._by_sequence.pop(out.request_id, None)
        if ep is None or ep.finish_reason is not None:
            return  # a turn cancelled after its episode ended
        ep.running = None
        turn = len(ep.turns)
        if out.status != RequestStatus.FINISHED:
            self._finish(ep, "error", f"model turn {turn} failed: {out.error or out.status.name.lower()}")
            return
        ep.kept = out.request_id
        start = len(ep.token_ids)
        ep.token_ids += out.generated_tokens
        ep.model_mask += [1] * len(out.generated_tokens)
        ep.logprobs += out.logprobs
        ep.policy_logprobs += out.policy_logprobs
        ep.kept_logmass += out.kept_logmass
        ep.weight_versions += out.weight_versions
        ep.turns.append(TurnSpan(start, len(ep.token_ids), len(ep.token_ids), out.finish_reason or ""))
        text = self.tokenizer.decode(out.generated_tokens) if self.tokenizer is not None else None
        view = ModelTurn(ep.info, turn, list(out.generated_tokens), text, out.finish_reason or "", list(ep.token_ids))
        calls = [(getattr(self.env, "reset", None) if turn == 0 else None, (ep.info,)), (self.env.step, (view,))]
        ep.env_started = time.perf_counter()
        if self.calls.timeout is not None:
            ep.env_deadline = ep.env_started + self.calls.timeout * sum(fn is not None for fn, _ in calls) + _GRACE_S
        ep.env_call = self.calls.submit(calls, lambda future, ep=ep: self._on_env_done(ep, future))

    def _env_answered(self, ep: _Live, future: concurrent.futures.Future) -> None:
        if future is not ep.env_call or ep.finish_reason is not None:
            return  # the answer of a call that timed out, or of an episode that ended meanwhile
        ep.env_call = None
        self.env_seconds += time.perf_counter() - ep.env_started
        turn = len(ep.turns) - 1
        try:
            response = future.result()
        except (Exception, concurrent.futures.CancelledError) as err:
            why = str(err) if isinstance(err, EnvTimeout) else f"raised {err!r}"
            self._finish(ep, "error", f"the environment failed on turn {turn}: {why}")
            return
        try:
            appended = self._record_answer(ep, response)
        except (TypeError, ValueError) as err:
            self._finish(ep, "error", f"the environment's answer to turn {turn} cannot be used: {err}")
            return
        if response.done:
            self._finish(ep, "done")
        elif len(ep.turns) >= self.max_turns:
            self._finish(ep, "max_turns")
        elif self.max_length is not None and len(ep.token_ids) + len(appended) >= self.max_length:
            self._finish(ep, "length")
        else:
            self._continue(ep, appended)

    def _record_answer(self, ep: _Live, response) -> list[int]:
        """Note the answer's reward and info on its turn; returns the tokens it appends ([] when done)."""
        if not isinstance(response, EnvResponse):
            raise TypeError(f"env.step must return an EnvResponse, got {type(response).__name__}")
        reward = float(response.reward)
        span = ep.turns[-1]
        span.reward, span.info = reward, dict(response.info)
        ep.rewards.append(reward)
        return [] if response.done else self._encode(response)

    def _encode(self, response: EnvResponse) -> list[int]:
        given = [name for name in ("token_ids", "text", "messages") if getattr(response, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of token_ids, text and messages, got {' and '.join(given)}")
        if response.token_ids is not None:
            ids = list(response.token_ids)
            return check_prompt(ids, self.vocab_size, None) if ids else []
        if response.text is not None:
            if self.tokenizer is None:
                raise ValueError("text answers need a tokenizer: RolloutGenerator(model, tokenizer=...); or answer "
                                 "with token_ids")
            return list(self.tokenizer(response.text, add_special_tokens=False)["input_ids"])
        if response.messages is not None:
            if self._chat is None:
                self._chat = ChatTurns(self.tokenizer, self.chat_template_kwargs)
            return self._chat.render(response.messages)
        return []

    def _continue(self, ep: _Live, appended: list[int]) -> None:
        """Append the environment's tokens and submit the next model turn, continuing the kept KV."""
        ep.token_ids += appended
        ep.model_mask += [0] * len(appended)
        ep.turns[-1].end = len(ep.token_ids)
        turn = len(ep.turns)
        request_id = f"{self.tag}-{ep.info.prompt_index}.{ep.info.sample_index}-t{turn}"
        params = self.params.with_overrides(n=1, seed=derive_seed(ep.seed, turn, SeedStream.TURN),
                                            max_new_tokens=self._turn_budget(len(ep.token_ids)))
        ep.running, continues, ep.kept = request_id, ep.kept, None
        self._by_sequence[request_id] = ep
        self._submit(request_id, list(ep.token_ids), params, continues=continues)

    def _finish(self, ep: _Live, reason: str, error: str | None = None) -> None:
        ep.finish_reason, ep.error = reason, error
        ep.seconds = time.perf_counter() - self._start
        self._live -= 1
        if ep.kept is not None:
            self.manager.release_kv(ep.kept)
            ep.kept = None
        close = getattr(self.env, "close", None)
        if close is not None:
            self._closing.append(self.calls.submit([(close, (ep.info,))],
                                                   lambda future: _log_close_error(ep.info, future)))

    # --------------------------------------------------------------- timeouts
    def _next_deadline(self) -> float | None:
        """Seconds until the first environment call in flight is given up (None: no limit, or none in flight)."""
        deadlines = [ep.env_deadline for ep in self._episodes if ep.env_call is not None and ep.env_deadline]
        return max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None

    def _expire_env_calls(self) -> None:
        """End episodes whose environment call is past its deadline without having settled. EnvCalls settles a
        timed-out call itself (EnvTimeout); this backstop covers an async method that blocks the event loop."""
        now = time.perf_counter()
        for ep in self._episodes:
            if ep.env_call is not None and ep.env_deadline is not None and now > ep.env_deadline:
                ep.env_call.cancel()
                ep.env_call = None
                self._finish(ep, "error", f"the environment did not answer turn {len(ep.turns) - 1} within "
                                          f"env_timeout={self.calls.timeout}s")

    # ----------------------------------------------------------------- failure
    def _abandon(self) -> None:
        """The call is failing: cancel turns in flight and free every kept KV, so nothing is left running."""
        for ep in self._episodes:
            if ep.finish_reason is not None:
                continue
            with contextlib.suppress(KeyError, ManagerError):
                if ep.running is not None:
                    self.manager.cancel_request(ep.running)
                if ep.kept is not None:
                    self.manager.release_kv(ep.kept)
            if ep.env_call is not None:
                ep.env_call.cancel()
            ep.finish_reason, ep.error = "error", "the call was interrupted"


def check_episode_settings(env, max_turns: int, max_length: int | None, max_positions: int | None) -> int | None:
    """The episode length cap to use (max_length, else the model's context; None: neither), or ValueError saying
    which setting is wrong."""
    if not callable(getattr(env, "step", None)):
        raise ValueError(f"env must have a step(turn) method (see rollout.rl.agents.Environment), got "
                         f"{type(env).__name__}")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1 (model turns per episode), got {max_turns!r}")
    if max_length is None:
        return max_positions
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2 (tokens per episode) or None, got {max_length!r}")
    if max_positions is not None and max_length > max_positions:
        raise ValueError(f"max_length={max_length} exceeds the model's {max_positions} positions; pass at most "
                         f"{max_positions} or None")
    return max_length


_GRACE_S = 0.5  # past the calls' own timeouts: EnvTimeout from EnvCalls normally arrives first


def _log_close_error(info: EpisodeInfo, future: concurrent.futures.Future) -> None:
    if future.cancelled():
        return
    err = future.exception()
    if err is not None:
        logger.warning("env.close failed for episode %d: %r", info.episode, err)
