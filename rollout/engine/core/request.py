"""A request's state machine (`Request`) and what callers get back (`RequestOutput`, `RequestStatus`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from rollout.engine.sample.resolve import ResolvedSampling

GROUP_SEPARATOR = "#"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """Ids of the sequences a request produces: the request id for n <= 1, else `{id}#{i}` for i < n."""
    return [request_id] if n <= 1 else [f"{request_id}{GROUP_SEPARATOR}{i}" for i in range(n)]


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

    `logprobs` are under the distribution actually sampled from (after logits processors, temperature and
    truncation, renormalised), `policy_logprobs` are fp32 log_softmax(logits / temperature) of the raw logits over the
    full vocabulary (what a trainer recomputes) and `kept_logmass` is the log of the policy mass that masks and
    truncation kept; logprobs = policy_logprobs - kept_logmass unless a processor changes values (repetition penalty,
    logit bias: see rollout/engine/sample/logits_processors.py).

    Only when asked for (None otherwise). `SamplingParams(logprobs=k)`: per generated token `raw_logprobs` (the
    model's own fp32 log_softmax(logits) at temperature 1, before any processor: what OpenAI-style APIs report) and
    the k most likely tokens {token id: logprob} under the distribution `logprobs` describes (`top_logprobs`; tokens
    it cannot sample are left out, so a greedy token's is {token: 0.0}), under the policy (`policy_top_logprobs`) and
    under the raw distribution (`raw_top_logprobs`). `SamplingParams(prompt_logprobs=k)`: `prompt_logprobs[i]` is
    log_softmax(logits / prompt_logprobs_temperature) of prompt token i given tokens [0, i) (None at position 0 and
    before `prompt_logprobs_start`), and `prompt_top_logprobs[i]` its k alternatives (k > 0 only).
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
    raw_logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    policy_top_logprobs: list[dict[int, float]] | None = None
    raw_top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    def is_finished(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def failure(cls, request_id: str, prompt_ids: list[int], error: str, kind: ErrorKind) -> RequestOutput:
        """The output of a sequence that failed before the engine ran any of it."""
        return cls(request_id=request_id, prompt_ids=prompt_ids, status=RequestStatus.FAILED, finish_reason="error",
                   error=error, error_kind=kind)

    @classmethod
    def group_failure(cls, request_id: str, n: int, prompt_ids: list[int], error: str, kind: ErrorKind,
                      name_sequence: bool = True) -> list[RequestOutput]:
        """The outputs of a request whose n sequences all failed before the engine ran any of them: the one place
        such outputs are built. `name_sequence`: each error starts with its sequence's id."""
        return [cls.failure(rid, list(prompt_ids), f"request {rid!r}: {error}" if name_sequence else error, kind)
                for rid in sequence_ids(request_id, n)]


class Request:
    """Engine-side state of one sequence.

    The KV cache holds `num_computed` tokens of `tokens` (prompt + generated). Each step the scheduler gives a request
    some of the `num_pending` tokens still to compute; when a step covers all of them, a new token is sampled. The same
    rule covers prefill, chunked prefill, decode and recompute after preemption.
    """

    __slots__ = (
        "block_hashes",
        "block_tables",
        "created_time",
        "error",
        "error_kind",
        "finish_reason",
        "finished_time",
        "grammar",
        "host_blocks",
        "kept_logmass",
        "kv_version",
        "logprobs",
        "num_computed",
        "num_hashed_blocks",
        "num_prefix_hit_tokens",
        "num_reclaimed",
        "policy_logprobs",
        "policy_top_logprobs",
        "prompt_ids",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "raw_logprobs",
        "raw_top_logprobs",
        "request_id",
        "sampling",
        "status",
        "streaming",
        "tokens",
        "top_logprobs",
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
        # one block table per KV group (kv_groups.py), all of one length while the request holds its KV; [] while
        # it holds none
        self.block_tables: list[list[int]] = []
        self.num_computed = 0
        self.num_hashed_blocks = 0  # leading blocks of each table registered in the prefix cache
        # per group: leading blocks of its table given back because no future query's sliding window reaches them:
        # their ids stay in the table as placeholders (attention never reads them), the pool owns them again
        self.num_reclaimed: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of the full blocks of `tokens` (computed lazily)
        # preempted into the swap space: per group, the host blocks holding what followed its placeholders, while it
        # waits (num_computed stays; the blocks come back when it resumes); [] when nothing is swapped out
        self.host_blocks: list[list[int]] = []
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
        # Structured output: this sequence's own matcher, advanced by the scheduler with every accepted token.
        self.grammar = sampling.constraint.new_state() if sampling.constraint is not None else None
        # Asked-for extras (rollout/engine/sample/top_logprobs.py, prompt_logprobs.py): one entry per generated token,
        # and prompt logprobs filled position by position (their length is the next prompt token still without one).
        self.raw_logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.policy_top_logprobs: list[dict[int, float]] = []
        self.raw_top_logprobs: list[dict[int, float]] = []
        first = min(max(1, sampling.prompt_logprobs_start), len(self.prompt_ids))
        self.prompt_logprobs: list[float | None] = [None] * first if sampling.prompt_logprobs is not None else []
        self.prompt_top_logprobs: list[dict[int, float] | None] = [None] * first if sampling.prompt_logprobs else []

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def generated_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token still lacks the logprob this request asked for."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def max_cached_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache: a prefix hit skips computing them, so it must stop
        before the first position whose logits a prompt logprob still needs."""
        return len(self.prompt_logprobs) - 1 if self.needs_prompt_logprobs else len(self.tokens)

    def take_prompt_logprobs(self, source: Request) -> None:
        """Adopt the prompt logprobs `source` computed for the same prompt (a group member forking off its prefill)."""
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = list(source.prompt_logprobs)
            self.prompt_top_logprobs = list(source.prompt_top_logprobs)

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
            **self._asked_extras(),
        )

    def _asked_extras(self) -> dict:
        """The optional RequestOutput fields this request asked for."""
        extras: dict = {}
        if self.sampling.logprobs is not None:
            extras.update(raw_logprobs=list(self.raw_logprobs), top_logprobs=list(self.top_logprobs),
                          policy_top_logprobs=list(self.policy_top_logprobs),
                          raw_top_logprobs=list(self.raw_top_logprobs))
        if self.sampling.prompt_logprobs is not None:
            extras["prompt_logprobs"] = list(self.prompt_logprobs)
            if self.sampling.prompt_logprobs:
                extras["prompt_top_logprobs"] = list(self.prompt_top_logprobs)
        return extras

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={len(self.tokens)}, "
                f"computed={self.num_computed}, blocks={sum(map(len, self.block_tables))}, "
                f"swapped={sum(map(len, self.host_blocks))})")
