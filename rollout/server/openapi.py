"""The OpenAPI document as the server really behaves: its error responses, its keys, its content types.

FastAPI documents a 422 for every route with parameters; this server answers 400 (OpenAI's shape), so the 422s are
replaced, and every operation lists the errors the guard, the body limits and the handlers can give it, each with
the `ErrorResponse` schema. Schema-conformance tools (schemathesis) then check responses against what is documented.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from rollout.server.protocol import ErrorResponse
from rollout.server.security import Access, RoutePolicy
from rollout.server.settings import ServerSettings

_ERRORS = {
    400: "Invalid request (bad field, bad Host header); `error.param` names the field",
    401: "Missing or wrong key",
    403: "Key not allowed on this route, cross-origin request, or control routes disabled",
    408: "The request body stalled",
    413: "The request body is too large",
    415: "Wrong Content-Type for this POST",
    429: "Too many weight uploads open",
    500: "A model forward failed",
    503: "Shutting down, generation loop gone, or generation paused for too long",
}
_GENERATION = ("/v1/completions", "/v1/chat/completions")


def install_openapi(app: FastAPI, policy: RoutePolicy, settings: ServerSettings) -> None:
    """Make `app.openapi()` return the corrected document (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _correct(schema, policy, settings)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _correct(schema: dict[str, Any], policy: RoutePolicy, settings: ServerSettings) -> None:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["ErrorResponse"] = error
    keyed = settings.api_key is not None or settings.admin_key is not None
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, methods in schema.get("paths", {}).items():
        access = policy.access(path)
        for method, operation in methods.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(path, method, access):
                responses.setdefault(str(status), _error_response(status))
            if keyed and access is not Access.PUBLIC:
                operation["security"] = [{"bearer": []}]


def _statuses(path: str, method: str, access: Access) -> list[int]:
    """The error statuses an operation can answer with."""
    statuses = [400, 403, 503]
    if access is not Access.PUBLIC:
        statuses.append(401)
    if method == "post":
        statuses += [408, 413, 415]
    if path.endswith("/begin"):
        statuses.append(429)
    if path in _GENERATION:
        statuses.append(500)
    return statuses


def _error_response(status: int) -> dict[str, Any]:
    return {"description": _ERRORS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


__all__ = ["install_openapi"]
