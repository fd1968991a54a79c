"""POST /score_completions: per-token logprobs of given completions under the served weights (an RL extension).

The HTTP face of `RolloutGenerator.score` (see rollout.rl.scoring): each (prompt, completion) pair runs as one
prefill-only request through the same engine, batched with generation and sharing its prefix cache, so a remote
trainer gets reference- or old-policy logprobs from the rollout server. `logprobs[t]` is fp32
log_softmax(logits / temperature) of completion token t given the prompt and the completion before it.

Body: `prompts` (texts or token-id lists) and `completions` (one per prompt: token ids, or text tokenized without
special tokens), optional `temperature` (default 1) and `top_logprobs` (0..20: alternatives per position, keyed by
token id). Bounds: at most `max_choices` pairs, each within the model's context and the KV cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from rollout.rl.scoring import completion_logprobs, score_params
from rollout.server.backend import ServerBackend
from rollout.server.errors import OpenAIError
from rollout.server.jobs import JobBuilder
from rollout.server.protocol import MAX_LOGPROBS, Finite, Text, Usage
from rollout.server.rendering import json_float, json_floats
from rollout.validation import MIN_TEMPERATURE, InvalidRequestError, check_fits, check_prompt

SCORE_PATH = "/score_completions"
TokenIds = Annotated[list[int], Field(min_length=1)]


class ScoreRequest(BaseModel):
    """The body of POST /score_completions: strict types, and unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    prompts: Annotated[list[Text | TokenIds], Field(min_length=1)]
    completions: list[Text | list[int]]
    temperature: Annotated[Finite, Field(ge=MIN_TEMPERATURE)] = 1.0
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0


class ScoredCompletion(BaseModel):
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]] | None = None  # token id (a JSON key) -> logprob, if asked


class ScoreResponse(BaseModel):
    id: str
    object: Literal["score"] = "score"
    created: int
    model: str
    weight_version: int
    data: list[ScoredCompletion]
    usage: Usage


class ScoreServing:
    """Translates, submits and renders score requests for one served model."""

    def __init__(self, backend: ServerBackend, jobs: JobBuilder) -> None:
        self.backend = backend
        self.jobs = jobs

    def pairs(self, body: ScoreRequest) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, completion ids) per pair, each checked as the engine will check it; OpenAIError (400)
        naming the pair otherwise. Tokenizes, so it runs off the event loop."""
        self.jobs.check_model(body.model)
        if len(body.completions) != len(body.prompts):
            raise OpenAIError(f"Got {len(body.prompts)} prompts and {len(body.completions)} completions; pass one "
                              "completion per prompt.", param="completions")
        self.jobs.check_choices(len(body.prompts), 1)
        backend, tokenizer = self.backend, self.jobs.tokenizer
        out = []
        for j, (prompt, completion) in enumerate(zip(body.prompts, body.completions)):
            param = "prompts"
            try:
                ids = self.jobs.completion_prompts(prompt)[0].ids if isinstance(prompt, str) else list(prompt)
                check_prompt(ids, backend.vocab_size, backend.max_positions)
                param = "completions"
                if isinstance(completion, str):
                    completion = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
                check_prompt(ids + completion, backend.vocab_size, backend.max_positions, prefill_only=True)
                check_fits(len(ids) + len(completion), 0, backend.max_positions, backend.kv_capacity_tokens)
            except InvalidRequestError as err:
                raise OpenAIError(f"Pair {j}: {err}", param=param, code=err.code) from err
            except OpenAIError as err:
                raise OpenAIError(f"Pair {j}: {err.message}", param=param, code=err.code) from err
            out.append((ids, list(completion)))
        return out

    async def score(self, body: ScoreRequest, disconnected: Callable[[], Awaitable[bool]]) -> Response:
        pairs = await run_in_threadpool(self.pairs, body)
        response_id, created = f"score-{uuid.uuid4().hex}", int(time.time())
        asked = [j for j, (_, completion) in enumerate(pairs) if completion]  # an empty completion needs no forward
        submissions = [(pairs[j][0] + pairs[j][1], score_params(len(pairs[j][0]), body.temperature,
                                                                body.top_logprobs)) for j in asked]
        outputs = []
        if submissions:
            outputs = await self.backend.submit(response_id, submissions, streaming=False).succeeded(response_id,
                                                                                                     disconnected)
        by_pair = dict(zip(asked, outputs))
        data = []
        for j, (prompt_ids, completion_ids) in enumerate(pairs):
            logprobs, top = completion_logprobs(by_pair[j], len(prompt_ids)) if j in by_pair else ([], [])
            data.append(ScoredCompletion(
                index=j, prompt_token_ids=prompt_ids, token_ids=completion_ids, logprobs=json_floats(logprobs),
                top_logprobs=[{str(t): json_float(v) for t, v in d.items()} for d in top or []]
                if body.top_logprobs else None))
        prompt_tokens = sum(len(p) for p, _ in pairs)
        completion_tokens = sum(len(c) for _, c in pairs)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        body_out = ScoreResponse(id=response_id, created=created, model=self.jobs.model_name,
                                 weight_version=self.backend.weight_version, data=data, usage=usage)
        return Response(body_out.model_dump_json(), media_type="application/json")


__all__ = ["SCORE_PATH", "ScoreRequest", "ScoreResponse", "ScoreServing", "ScoredCompletion"]
