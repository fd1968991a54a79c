"""OpenAI-compatible HTTP server on the continuous-batching manager, plus the RL control endpoints.

OpenAI surface: `/v1/completions`, `/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/health`,
`/metrics` (Prometheus text). Extensions, so one server can be an RL rollout worker:

- `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to every choice (the stop token included, as the
  engine produced it; the text has stop tokens and stop strings removed, like OpenAI).
- `logprobs` (completions: an int; chat: `logprobs: true` and `top_logprobs`) reports, as vLLM does by default, the
  model's own fp32 log_softmax(logits) of each token (temperature 1, before any logits processor, so a greedy token
  gets its real logprob) and the k most likely tokens; with `echo` the prompt's tokens come first (the first one
  null), computed in the same prefill, and `max_tokens: 0` with `echo` returns only those. The RL contract is in a
  `rollout` field per choice: `token_ids`, `logprobs` (under the distribution actually sampled from: after
  temperature and top-k/top-p/min-p, and 0 for greedy, a point mass), `policy_logprobs` (fp32 log_softmax of
  logits / T over the whole vocabulary), `kept_logmass` and `weight_versions`.
- `POST /score_completions` {"prompts", "completions"}: per-token logprobs of given completions under the served
  weights, by teacher forcing through the engine (see `scoring`).
- Weights: `POST /update_weights` {"path": dir} loads a safetensors checkpoint from under the server's weights
  directories; a chunked upload (`/update_weights/begin` {}, `/update_weights/chunk?update_id=` with a safetensors
  body, `/update_weights/commit` {"update_id"}, `/update_weights/abort` {"update_id"}) streams tensors of any size of
  model. Every chunk is validated on arrival and any failure fails the whole upload; commit applies all of them
  atomically at a step boundary or nothing (400 with the reason), then bumps the weight version.
  `GET /weight_version`, `POST /reset_prefix_cache`, `POST /pause`, `POST /resume` (while paused, requests queue and
  weight updates still apply; requests parked longer than the pause timeout get a 503).

A sequence that fails fails its HTTP request by its `error_kind`: 400 for an invalid request or one that cannot fit
the KV cache, 500 when the model's forward raised, 503 when the server is shutting down (streams end with an error
event instead). Access (keys, Host, Origin, content types) is `security`'s, body bounds `limits`', the other bounds
`settings`' (see the README's Security section).

Layout: this module wires routes, middleware and error handlers; `serving` runs one OpenAI request (`jobs`
translates it, `rendering` builds the response, `protocol` holds the bodies, `errors` the error shape); `backend`
owns the engine and routes its outputs (`routing`); `weight_updates` and `metrics` serve the RL and Prometheus
endpoints; `openapi` makes the document match what the server answers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from rollout.config import ContinuousBatchingConfig
from rollout.manager import ManagerError
from rollout.rl.weights import WeightUpdateError
from rollout.server.backend import BackendClosed, ServerBackend
from rollout.server.errors import OpenAIError, error_body, error_response, error_type
from rollout.server.limits import BodyLimits
from rollout.server.metrics import CONTENT_TYPE, ServerMetrics
from rollout.server.openapi import install_openapi
from rollout.server.protocol import (
    AbortRequest,
    AbortResponse,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkResponse,
    CommitRequest,
    CompletionRequest,
    CompletionResponse,
    EmptyRequest,
    ErrorInfo,
    HealthResponse,
    ModelList,
    PauseResponse,
    ResetPrefixCacheResponse,
    UpdateFromPathRequest,
    UpdateStartedResponse,
    WeightVersionResponse,
)
from rollout.server.scoring import SCORE_PATH, ScoreRequest, ScoreResponse, ScoreServing
from rollout.server.security import CONTROL_TAG, Guard, RoutePolicy
from rollout.server.serving import OpenAIServing, json_response
from rollout.server.settings import ServerSettings
from rollout.server.weight_updates import CHUNK_PATH

logger = logging.getLogger(__name__)

_STREAMED = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                   "description": "The response, or with `stream: true` its server-sent events"}}
_CONTROL = {"tags": [CONTROL_TAG]}


def create_app(model, tokenizer, model_name: str, continuous_batching_config: ContinuousBatchingConfig | None = None,
               model_aliases: Sequence[str] = (), settings: ServerSettings | None = None) -> FastAPI:
    """A FastAPI app serving `model` through one continuous-batching manager (started now, stopped at shutdown).

    `settings` (default: no keys, loopback, the default bounds) decides access and per-request bounds.
    `app.state.backend` is the ServerBackend (its `.manager` and `.engine` are there for inspection) and
    `app.state.server` the OpenAIServing; generate through HTTP.
    """
    settings = settings or ServerSettings()
    backend = ServerBackend(model, tokenizer, continuous_batching_config, settings)
    serving = OpenAIServing(backend, tokenizer, model_name, model_aliases, settings)
    scoring = ScoreServing(backend, serving.jobs)
    metrics = ServerMetrics(backend, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        backend.close()

    app = FastAPI(title="rollout", lifespan=lifespan, separate_input_output_schemas=False)
    app.state.backend = backend
    app.state.server = serving
    app.state.settings = settings
    _add_error_handlers(app)

    # ----------------------------------------------------------- OpenAI API
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_STREAMED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request.is_disconnected)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_STREAMED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request.is_disconnected)

    @app.post(SCORE_PATH, response_model=ScoreResponse)
    async def score_completions(body: ScoreRequest, request: Request) -> Response:
        """Per-token logprobs of given completions under the served weights (see rollout/server/scoring.py)."""
        return await scoring.score(body, request.is_disconnected)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Response:
        return json_response(serving.models())

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> Response:
        """200 {"status": "ok"} while forwards succeed; 503 "degraded"/"unhealthy" with the reason otherwise (the
        rule is ServerBackend.health's). The 503 body also has an OpenAI-style `error`, so clients show the reason."""
        state = backend.health()
        healthy = state["status"] == "ok"
        error = None if healthy else ErrorInfo(**error_body(state["reason"], error_type(503),
                                                            code=f"engine_{state['status']}")["error"])
        body = HealthResponse(**state, paused=backend.paused, weight_version=backend.weight_version, error=error)
        return json_response(body, status_code=200 if healthy else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    # --------------------------------------------------------------- RL API
    @app.get("/weight_version")
    async def weight_version() -> WeightVersionResponse:
        return WeightVersionResponse(weight_version=backend.weight_version)

    @app.post("/update_weights", **_CONTROL)
    async def update_weights(body: UpdateFromPathRequest) -> WeightVersionResponse:
        return WeightVersionResponse(weight_version=await backend.weights.from_path(body.path, body.on_update))

    @app.post("/update_weights/begin", **_CONTROL)
    async def update_begin(_body: EmptyRequest) -> UpdateStartedResponse:
        return UpdateStartedResponse(update_id=backend.weights.begin())

    @app.post(CHUNK_PATH, **_CONTROL, openapi_extra={"requestBody": {"required": True, "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def update_chunk(request: Request, update_id: str) -> ChunkResponse:
        """Body: one safetensors file (`Content-Type: application/octet-stream`)."""
        return ChunkResponse(update_id=update_id, num_tensors=await backend.weights.add_chunk(update_id, request))

    @app.post("/update_weights/commit", **_CONTROL)
    async def update_commit(body: CommitRequest) -> WeightVersionResponse:
        version = await backend.weights.commit(body.update_id, body.on_update, body.num_tensors)
        return WeightVersionResponse(weight_version=version)

    @app.post("/update_weights/abort", **_CONTROL)
    async def update_abort(body: AbortRequest) -> AbortResponse:
        backend.weights.abort(body.update_id)
        return AbortResponse(aborted=True)

    @app.post("/reset_prefix_cache", **_CONTROL)
    async def reset_prefix_cache(_body: EmptyRequest) -> ResetPrefixCacheResponse:
        return ResetPrefixCacheResponse(dropped_blocks=await backend.reset_prefix_cache())

    @app.post("/pause", **_CONTROL)
    async def pause(_body: EmptyRequest) -> PauseResponse:
        return PauseResponse(paused=await backend.pause())

    @app.post("/resume", **_CONTROL)
    async def resume(_body: EmptyRequest) -> PauseResponse:
        return PauseResponse(paused=await backend.resume())

    public = {"/health", app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    policy = RoutePolicy.of_routes(app.routes, public=[p for p in public if p], binary=[CHUNK_PATH])
    install_openapi(app, policy, settings)
    # Outermost last: CORS answers allowed preflights, the guard refuses before any body is read, then body bounds.
    app.add_middleware(BodyLimits, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       exempt=[CHUNK_PATH])
    app.add_middleware(Guard, settings=settings, policy=policy)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body: request problems 4xx, server-side failures 5xx."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            loc = []  # the location is a character offset, not a field
        else:
            message = "; ".join(f"{_field_path(e.get('loc', ()))}: {e.get('msg')}"
                                for e in errors[:_MAX_REPORTED]) or "invalid request"
            if len(errors) > _MAX_REPORTED:
                message += f"; and {len(errors) - _MAX_REPORTED} more errors"
        # `param` is the top-level field; the message has the full path (which for a union also names the type).
        return error_response(400, message, param=loc[0] if loc else None, code=first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), headers=err.headers)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(_request: Request, err: WeightUpdateError) -> JSONResponse:
        logger.warning("weight update rejected: %s", err)
        return error_response(400, str(err), code="weight_update_rejected")

    @app.exception_handler(BackendClosed)
    @app.exception_handler(ManagerError)
    async def _unavailable(_request: Request, err: Exception) -> JSONResponse:
        return error_response(503, str(err))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(err).__name__}")


_MAX_REPORTED = 5  # validation errors named in one message
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _field_path(loc) -> str:
    """`messages.0.content` from pydantic's location, without the union members it tried ("str",
    "function-after[...]", "list[ContentPart]"): the client named fields, not our types."""
    parts = [str(p) for p in loc if p != "body" and (isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))]
    return ".".join(parts) or "body"


__all__ = ["create_app"]
