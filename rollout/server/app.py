"""OpenAI-compatible HTTP server on the continuous-batching manager, plus the RL control endpoints.

OpenAI surface: `/v1/completions`, `/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/health`,
`/metrics` (Prometheus text). Extensions, so one server can be an RL rollout worker:

- `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to every choice (the stop token included, as the
  engine produced it; the text has stop tokens and stop strings removed, like OpenAI).
- `logprobs` (completions: an int; chat: `logprobs: true`) returns the sampled token's logprob under the distribution
  actually sampled from (after temperature and top-k/top-p/min-p; greedy is a point mass, so 0), and a `rollout`
  field per choice with the full RL contract: `token_ids`, `logprobs`, `policy_logprobs` (fp32 log_softmax of
  logits / T over the whole vocabulary), `kept_logmass` and `weight_versions`. The engine does not compute top-k
  alternatives, so `top_logprobs` only ever lists the sampled token; echoed prompt tokens have no logprob (null).
- Weights: `POST /update_weights` {"path": dir} loads a safetensors checkpoint from the server's disk; a chunked
  upload (`/update_weights/begin`, `/update_weights/chunk?update_id=` with a safetensors body,
  `/update_weights/commit?update_id=`, `/update_weights/abort?update_id=`) streams tensors of any size of model.
  Every chunk is validated on arrival; commit applies all of them atomically at a step boundary or nothing (400 with
  the reason), then bumps the weight version. `GET /weight_version`, `POST /reset_prefix_cache`, `POST /pause`,
  `POST /resume` (while paused, requests queue and weight updates still apply).

A sequence that fails fails its HTTP request by its `error_kind`: 400 for an invalid request or one that cannot fit
the KV cache, 500 when the model's forward raised, 503 when the server is shutting down (streams end with an error
event instead). These endpoints load files from the server's disk and replace its weights: bind to localhost (the
default) or put the server behind something that authenticates.

Layout: this module wires routes and error handlers; `serving` runs one OpenAI request (`jobs` translates it,
`rendering` builds the response, `protocol` holds the bodies, `errors` the error shape); `backend` owns the engine
and routes its outputs (`routing`); `weight_updates` and `metrics` serve the RL and Prometheus endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.config import ContinuousBatchingConfig
from rollout.manager import ManagerError
from rollout.rl.weights import WeightUpdateError
from rollout.server.backend import BackendClosed, ServerBackend
from rollout.server.errors import OpenAIError, error_body, error_type
from rollout.server.metrics import CONTENT_TYPE, ServerMetrics
from rollout.server.protocol import ChatCompletionRequest, CompletionRequest, UpdateFromPathRequest
from rollout.server.serving import OpenAIServing, json_response

logger = logging.getLogger(__name__)


def create_app(model, tokenizer, model_name: str, continuous_batching_config: ContinuousBatchingConfig | None = None,
               model_aliases: Sequence[str] = ()) -> FastAPI:
    """A FastAPI app serving `model` through one continuous-batching manager (started now, stopped at shutdown).

    `app.state.backend` is the ServerBackend (its `.manager` and `.engine` are there for inspection) and
    `app.state.server` the OpenAIServing; generate through HTTP.
    """
    backend = ServerBackend(model, tokenizer, continuous_batching_config)
    serving = OpenAIServing(backend, tokenizer, model_name, model_aliases)
    metrics = ServerMetrics(backend, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        backend.close()

    app = FastAPI(title="rollout", lifespan=lifespan)
    app.state.backend = backend
    app.state.server = serving
    _add_error_handlers(app)

    # ----------------------------------------------------------- OpenAI API
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request.is_disconnected)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 {"status": "ok"} while forwards succeed; 503 "degraded"/"unhealthy" with the reason otherwise (the
        rule is ServerBackend.health's). The 503 body also has an OpenAI-style `error`, so clients show the reason."""
        state = backend.health()
        body = {**state, "paused": backend.paused, "weight_version": backend.weight_version}
        if state["status"] == "ok":
            return JSONResponse(body, status_code=200)
        body.update(error_body(state["reason"], error_type(503), code=f"engine_{state['status']}"))
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE)

    # --------------------------------------------------------------- RL API
    @app.get("/weight_version")
    async def weight_version() -> dict:
        return {"weight_version": backend.weight_version}

    @app.post("/update_weights")
    async def update_weights(body: UpdateFromPathRequest) -> dict:
        return {"weight_version": await backend.weights.from_path(body.path, body.on_update)}

    @app.post("/update_weights/begin")
    async def update_begin() -> dict:
        return {"update_id": backend.weights.begin()}

    @app.post("/update_weights/chunk")
    async def update_chunk(request: Request, update_id: str | None = None) -> dict:
        body = await request.body()
        return {"update_id": update_id, "num_tensors": await backend.weights.add_chunk(update_id, body)}

    @app.post("/update_weights/commit")
    async def update_commit(update_id: str | None = None, on_update: str = "keep",
                            num_tensors: int | None = None) -> dict:
        return {"weight_version": await backend.weights.commit(update_id, on_update, num_tensors)}

    @app.post("/update_weights/abort")
    async def update_abort(update_id: str | None = None) -> dict:
        backend.weights.abort(update_id)
        return {"aborted": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"dropped_blocks": await backend.reset_prefix_cache()}

    @app.post("/pause")
    async def pause() -> dict:
        return {"paused": await backend.pause()}

    @app.post("/resume")
    async def resume() -> dict:
        return {"paused": await backend.resume()}

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body: request problems 400, server-side failures 5xx."""

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
            message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                                f"{e.get('msg')}" for e in errors) or "invalid request"
        return JSONResponse(error_body(message, param=".".join(loc) or None, code=first.get("type")),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), error_type(err.status_code)), status_code=err.status_code)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(_request: Request, err: WeightUpdateError) -> JSONResponse:
        logger.warning("weight update rejected: %s", err)
        return JSONResponse(error_body(str(err), code="weight_update_rejected"), status_code=400)

    @app.exception_handler(BackendClosed)
    @app.exception_handler(ManagerError)
    async def _unavailable(_request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(str(err), error_type(503)), status_code=503)


__all__ = ["create_app"]
