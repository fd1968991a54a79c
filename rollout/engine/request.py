"""A request's state machine (`Request`) and what callers get back (`RequestOutput`, `RequestStatus`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from rollout.sampling_params import ResolvedSampling


class RequestStatus(IntEnum):
    """Lifecycle of a request. Values >= FINISHED are terminal."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5


TERMINAL = (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)


class ErrorKind(str, Enum):
    """Why a FAILED request failed, so callers (the server's status codes) never parse messages."""

    INVALID_REQUEST = "invalid_request"  # the prompt or its settings are wrong: fix the request
    CAPACITY = "capacity"  # the request cannot fit the KV cache even alone: a bigger cache or a shorter request
    FORWARD = "forward"  # the model's forward raised: a server-side problem
    SHUTDOWN = "shutdown"  # the manager was stopped, destroyed or died before the request finished


@dataclass
class RequestOutput:
    """A snapshot of one sequence: what was asked, what came out, and the RL logprob contract per token.

    `logprobs` are under the distribution actually sampled from (after temperature and truncation, renormalised),
    `policy_logprobs` are fp32 log_softmax(logits / temperature) over the full vocabulary (what a trainer recomputes)
    and `kept_logmass` is the log of the probability mass truncation kept; logprobs = policy_logprobs - kept_logmass.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    kept_logmass: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # set when status is FAILED
    created_time: float = 0.0
    finished_time: float | None = None

    def is_finished(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def failure(cls, request_id: str, prompt_ids: list[int], error: str, kind: ErrorKind) -> RequestOutput:
        """The output of a request that failed before the engine ran any of it."""
        return cls(request_id=request_id, prompt_ids=prompt_ids, status=RequestStatus.FAILED, finish_reason="error",
                   error=error, error_kind=kind)


class Request:
    """Engine-side state of one sequence.

    The KV cache holds `num_computed` tokens of `tokens` (prompt + generated). Each step the scheduler gives a request
    some of the `num_pending` tokens still to compute; when a step covers all of them, a new token is sampled. The same
    rule covers prefill, chunked prefill, decode and recompute after preemption.
    """

    __slots__ = (
        "block_hashes",
        "block_table",
        "created_time",
        "error",
        "error_kind",
        "finish_reason",
        "finished_time",
        "kept_logmass",
        "kv_version",
        "logprobs",
        "num_computed",
        "num_hashed_blocks",
        "num_prefix_hit_tokens",
        "policy_logprobs",
        "prompt_ids",
        "request_id",
        "sampling",
        "status",
        "streaming",
        "tokens",
        "weight_versions",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: ResolvedSampling,
        streaming: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.sampling = sampling
        self.status = RequestStatus.PENDING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.block_hashes: list[int] = []  # hash chain of the full blocks of `tokens` (computed lazily)
        self.logprobs: list[float] = []
        self.policy_logprobs: list[float] = []
        self.kept_logmass: list[float] = []
        self.weight_versions: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_kind: ErrorKind | None = None
        self.created_time = time.perf_counter()
        self.finished_time: float | None = None
        self.streaming = streaming
        self.kv_version = 0  # weight version the cached KV of this request was computed under
        self.num_prefix_hit_tokens = 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def generated_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    def is_finished(self) -> bool:
        return self.status in TERMINAL

    def finish(self, status: RequestStatus, reason: str | None, error: str | None = None,
               error_kind: ErrorKind | None = None) -> None:
        self.status = status
        self.finish_reason = reason
        self.error = error
        self.error_kind = error_kind
        self.finished_time = time.perf_counter()

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            generated_tokens=self.generated_tokens,
            logprobs=list(self.logprobs),
            policy_logprobs=list(self.policy_logprobs),
            kept_logmass=list(self.kept_logmass),
            weight_versions=list(self.weight_versions),
            status=self.status,
            finish_reason=self.finish_reason,
            error=self.error,
            error_kind=self.error_kind,
            created_time=self.created_time,
            finished_time=self.finished_time,
        )

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={len(self.tokens)}, "
                f"computed={self.num_computed}, blocks={len(self.block_table)})")
