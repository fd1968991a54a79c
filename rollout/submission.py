"""Submission: one `add_request` waiting in the manager's inbox, and how `add_request`'s keyword overrides apply."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.engine.core.request import ErrorKind, RequestOutput
from rollout.engine.engine import LLMEngine
from rollout.engine.sample.resolve import ResolvedSampling
from rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class Submission:
    """One `add_request` waiting in the inbox for the loop to hand it to the engine."""

    request_id: str
    prompt: list[int]
    params: SamplingParams | ResolvedSampling
    streaming: bool = False
    keep_kv: bool = False
    continues: str | None = None

    def failures(self, error: str, kind: ErrorKind, name_sequence: bool = True) -> list[RequestOutput]:
        return RequestOutput.group_failure(self.request_id, self.params.n, self.prompt, error, kind, name_sequence)

    def enter(self, engine: LLMEngine) -> list[RequestOutput]:
        """Hand this request to the engine; the failure outputs of its sequences if the engine refuses it (an id
        still live inside the engine, a continuation of nothing), so it fails alone."""
        try:
            engine.add_request(self.prompt, self.request_id, self.params, streaming=self.streaming,
                               keep_kv=self.keep_kv, continues=self.continues)
        except ValueError as err:
            return self.failures(str(err), ErrorKind.INVALID_REQUEST)
        return []


def with_overrides(params: SamplingParams | ResolvedSampling | None, **overrides) -> SamplingParams | ResolvedSampling:
    """`params` with `add_request`'s keyword overrides applied; settings already resolved take none."""
    if not isinstance(params, ResolvedSampling):
        return (params or SamplingParams()).with_overrides(**overrides)
    given = sorted(name for name, value in overrides.items() if value is not None)
    if given:
        raise TypeError(f"sampling_params is already resolved (ResolvedSampling); pass {given} in it instead")
    return params


class _Event:
    """An inbox entry that is not a request: nothing of it fails when the manager stops."""

    def failures(self, error: str, kind: ErrorKind, name_sequence: bool = True) -> list[RequestOutput]:
        return []


@dataclass(frozen=True)
class Cancellation(_Event):
    """A `cancel_request` under tensor parallelism: it travels with the submissions, so every rank's engine cancels
    at the same step boundary."""

    request_id: str

    def enter(self, engine: LLMEngine) -> list[RequestOutput]:
        return engine.cancel(self.request_id)


@dataclass(frozen=True)
class KVRelease(_Event):
    """A `release_kv` under tensor parallelism (see Cancellation)."""

    sequence_id: str

    def enter(self, engine: LLMEngine) -> list[RequestOutput]:
        engine.release_kept(self.sequence_id)
        return []
