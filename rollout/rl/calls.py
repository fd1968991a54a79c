"""EngineCalls: the scaffolding every RolloutGenerator call shares (generate, run_episodes, score).

Each call turns prompts into checked token ids, mints its request ids, starts the loop, submits, measures its window
of engine work, and on failure abandons what it submitted. Written once here, so the three calls raise the same
errors for the same problem (a closed generator, a stopped manager) and report the same stats.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from rollout.engine.core.stats import EngineStats
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.manager import ContinuousBatchingManager, ManagerError
from rollout.rl.batch import Prompt
from rollout.sampling_params import SamplingParams

T = TypeVar("T")

MAX_LISTED_PROBLEMS = 5  # bad inputs named one by one in a rejection message; the rest are counted
DROPPED = ("the generator's manager is stopped and dropped the request; call generator.manager.start() or create a "
           "new RolloutGenerator")


def list_problems(problems: list[str]) -> str:
    """The first MAX_LISTED_PROBLEMS problems joined, and how many more there are."""
    more = len(problems) - MAX_LISTED_PROBLEMS
    return "; ".join(problems[:MAX_LISTED_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")


def check_every(items: Sequence[Any], check: Callable[[Any], T], label: str, failure: str, hint: str = "") -> list[T]:
    """`check(item)` for every item, before anything is submitted; one ValueError naming every failing item by index
    ("{label} {j}: why") otherwise."""
    results, problems = [], []
    for j, item in enumerate(items):
        try:
            results.append(check(item))
        except (ValueError, TypeError) as err:
            problems.append(f"{label} {j}: {err}")
    if problems:
        raise ValueError(f"{len(problems)} of {len(items)} {failure}, so nothing was submitted{hint}: "
                         f"{list_problems(problems)}")
    return results


class EngineCalls:
    """One generator's manager and tokenizer, as the calls on them need them."""

    def __init__(self, manager: ContinuousBatchingManager, tokenizer=None) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self._count = 0
        self._count_lock = threading.Lock()  # calls may begin in several threads at once (a rollout producer)

    def engine(self):
        """The live engine; ManagerError once the generator was closed."""
        engine = self.manager.engine
        if engine is None:
            raise ManagerError("this RolloutGenerator was closed; create a new one")
        return engine

    def token_ids(self, prompt: Prompt) -> list[int]:
        """Text and chat prompts tokenized (chat: template + generation prompt); id prompts passed through as given,
        for the engine's rule to check."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("text and chat prompts need a tokenizer: RolloutGenerator(model, tokenizer=...)")
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if isinstance(prompt, torch.Tensor):
            return prompt.flatten().tolist()
        if hasattr(prompt, "tolist"):  # numpy arrays and scalars: plain Python ints
            prompt = prompt.tolist()
        try:
            return list(prompt)
        except TypeError:
            raise ValueError(f"a prompt must be token ids, a string or a list of chat messages, got "
                             f"{type(prompt).__name__}") from None

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids the engine will serve; ValueError if it would refuse them (empty, outside the vocabulary, too
        long for the model)."""
        return self.engine().validate_prompt(self.token_ids(prompt))

    def check_sampling(self, params: SamplingParams, what: str) -> ResolvedSampling:
        """The engine's resolved settings; ValueError naming `what` if they are rejected (nothing was submitted)."""
        try:
            return self.engine().validate_sampling(params)
        except ValueError as err:
            raise ValueError(f"{what} rejected, nothing was submitted: {err}") from err

    def begin(self, kind: str) -> str:
        """Start a call: its request-id prefix (e.g. "rollout3"), with the loop running."""
        with self._count_lock:
            self._count += 1
            number = self._count
        if not self.manager.is_running():
            self.manager.start()
        return f"{kind}{number}"

    def submit(self, prompt_ids: list[int], request_id: str, params: SamplingParams | ResolvedSampling,
               **options) -> None:
        """add_request, or ManagerError if the manager is stopped and dropped it."""
        if self.manager.add_request(prompt_ids, request_id=request_id, sampling_params=params, **options) is None:
            raise ManagerError(DROPPED)

    def abandon(self, sequence_ids: Sequence[str]) -> None:
        """Cancel sequences nobody will collect (their call failed) and drop their results, so nothing is left
        running or holding KV blocks."""
        for rid in sequence_ids:
            with contextlib.suppress(KeyError, ManagerError):
                self.manager.cancel_request(rid)
                self.manager.get_result(rid, timeout=0)

    def window_start(self, reset_peak: bool = True) -> tuple[EngineStats, float]:
        """The stats and clock a call's window is measured from (the KV peak restarts with it)."""
        engine = self.engine()  # a closed generator fails here, before anything is read
        if reset_peak:
            engine.reset_peak()
        return self.manager.stats(), time.perf_counter()

    def window_stats(self, start: tuple[EngineStats, float]) -> dict:
        """This call's engine work since `start`: the EngineStats window, seconds and generated tokens per second."""
        before, started = start
        elapsed = time.perf_counter() - started
        stats = self.manager.stats().since(before).as_dict()
        stats.update(seconds=elapsed, tokens_per_second=stats["generated_tokens"] / max(elapsed, 1e-9))
        return stats
