"""OpenAIServing: one completion or chat request from body to response (translate, submit, wait or stream, render).

Translation lives in `jobs`, rendering in `rendering`, and the engine side in `backend`; this module only runs the
sequence and decides how a failed sequence fails the HTTP request (by its `error_kind`, see `errors`). Translation
tokenizes and renders the chat template, so it runs on a worker thread: a long prompt never stalls the event loop
(and with it /health, /metrics and every stream).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from rollout.server.backend import ServerBackend
from rollout.server.jobs import Job, JobBuilder
from rollout.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from rollout.server.rendering import ResponseRenderer
from rollout.server.settings import ServerSettings

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body: BaseModel, status_code: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


class OpenAIServing:
    """The OpenAI surface of one served model: `/v1/completions`, `/v1/chat/completions` and `/v1/models`."""

    def __init__(self, backend: ServerBackend, tokenizer, model_name: str, model_aliases: Sequence[str] = (),
                 settings: ServerSettings | None = None) -> None:
        self.backend = backend
        self.model_name = model_name
        self.jobs = JobBuilder(backend, tokenizer, model_name, model_aliases, settings)
        self.renderer = ResponseRenderer(tokenizer, model_name, lambda: backend.weight_version)

    async def completions(self, body: CompletionRequest, disconnected: Callable[[], Awaitable[bool]]) -> Response:
        job = await run_in_threadpool(self.jobs.completion_job, body)
        return await self._generate(job, body.stream, _include_usage(body), disconnected)

    async def chat(self, body: ChatCompletionRequest, disconnected: Callable[[], Awaitable[bool]]) -> Response:
        job = await run_in_threadpool(self.jobs.chat_job, body)
        return await self._generate(job, body.stream, _include_usage(body), disconnected)

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=int(self.backend.started), root=self.model_name,
                                         max_model_len=self.backend.max_positions)])

    async def _generate(self, job: Job, stream: bool, include_usage: bool,
                        disconnected: Callable[[], Awaitable[bool]]) -> Response:
        response_id, created = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        routed = self.backend.submit(response_id, job.submissions(), streaming=stream)
        if stream:
            events = self.renderer.stream(job, routed, response_id, created, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
        outputs = await routed.succeeded(response_id, disconnected)
        return json_response(self.renderer.response(job, outputs, response_id, created))


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
