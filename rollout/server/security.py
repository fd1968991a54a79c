"""Who may call what: the Host and Origin checks, JSON-only POSTs and the bearer keys, in one ASGI middleware.

`Guard` answers before any body is read, so a refused request costs nothing. The checks, in order:

1. Host: without an API key, the Host header must name this server (`ServerSettings.host_allowed`). A DNS-rebinding
   page reaches 127.0.0.1 under its own name; this is what stops it. /health and the API documentation are exempt
   (health probes often name the server by an address of its own, and neither tells or changes anything).
2. CORS: a preflight that reaches the guard (no `--cors-origin` allowed it) is refused, and so is any request whose
   Origin is neither this server nor an allowed origin.
3. Keys: `Authorization: Bearer <key>`, compared in constant time. The OpenAI routes take the API key (or the admin
   key); the RL control routes take the admin key only (403 with the API key). Without an admin key the control
   routes answer only on a loopback bind, and then take the API key if there is one.
4. Content type: every POST must say `application/json` (the weight-chunk upload: `application/octet-stream`). A web
   page can send `text/plain`, form data or no body at all without a CORS preflight, but never these.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout.server.errors import error_response
from rollout.server.settings import ServerSettings

CONTROL_TAG = "rl-control"  # the OpenAPI tag of the RL control routes: the guard gives them the admin rule
JSON = "application/json"
BINARY = "application/octet-stream"
KEY_OPTIONS = "--api-key / ROLLOUT_API_KEY"
ADMIN_KEY_OPTIONS = "--admin-key / ROLLOUT_ADMIN_KEY"


class Access(Enum):
    PUBLIC = "public"  # /health and the API's own documentation
    USER = "user"  # the OpenAI routes, /metrics, /weight_version, and any unknown path
    ADMIN = "admin"  # the RL control routes


@dataclass(frozen=True)
class RoutePolicy:
    """How the guard treats each path: its access level, which paths take POST (the others answer 405 to it, with
    no content-type check first) and which POST routes take a binary body."""

    public: frozenset[str]
    admin: frozenset[str]
    post: frozenset[str]
    binary: frozenset[str]

    @classmethod
    def of_routes(cls, routes: Iterable, public: Iterable[str], binary: Iterable[str]) -> RoutePolicy:
        """Admin paths are those of the routes tagged CONTROL_TAG."""
        routes = list(routes)
        admin = {route.path for route in routes if CONTROL_TAG in (getattr(route, "tags", None) or ())}
        post = {route.path for route in routes if "POST" in (getattr(route, "methods", None) or ())}
        return cls(frozenset(public), frozenset(admin), frozenset(post), frozenset(binary))

    def access(self, path: str) -> Access:
        if path in self.public:
            return Access.PUBLIC
        return Access.ADMIN if path in self.admin else Access.USER


class Guard:
    """The ASGI middleware applying the checks above to every HTTP request."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, policy: RoutePolicy) -> None:
        self.app = app
        self.settings = settings
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.check(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> Response | None:
        """The response refusing this request, or None to let it through."""
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        access = self.policy.access(scope["path"])
        if (self.settings.api_key is None and access is not Access.PUBLIC  # probes may name the server by its IP
                and not self.settings.host_allowed(_host_name(host))):
            return error_response(400, f"Invalid Host header {host!r}: this server answers for its loopback names "
                                  "and --allowed-host (or set an API key)", code="invalid_host")
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return error_response(403, "Cross-origin requests are not allowed by this server (start it with "
                                  "--cors-origin to allow a web origin)", code="cors_refused")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return error_response(403, f"Requests from origin {origin!r} are not allowed (start the server with "
                                  "--cors-origin to allow a web origin)", code="cors_refused")
        refusal = self._authorize(access, _bearer(headers.get("authorization")))
        if refusal is not None:
            return refusal
        if scope["method"] == "POST" and scope["path"] in self.policy.post:
            return self._check_content_type(scope["path"], headers.get("content-type"))
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        """Same-origin requests (a browser on this server's own pages) and the configured CORS origins."""
        if origin in self.settings.cors_origins:
            return True
        return origin != "null" and urlsplit(origin).netloc.lower() == host.lower()

    def _authorize(self, access: Access, token: str | None) -> Response | None:
        settings = self.settings
        if access is Access.PUBLIC:
            return None
        is_admin, is_user = _matches(token, settings.admin_key), _matches(token, settings.api_key)
        if access is Access.USER:
            return None if settings.api_key is None or is_user or is_admin else _unauthorized(KEY_OPTIONS)
        if settings.admin_key is not None:
            if is_admin:
                return None
            if is_user:
                return error_response(403, "This key may call the OpenAI routes only; the RL control routes need "
                                      "the admin key", code="permission_denied")
            return _unauthorized(ADMIN_KEY_OPTIONS)
        if not settings.control_open_without_key:
            return error_response(403, f"The RL control routes are disabled: the server listens on {settings.host} "
                                  f"without an admin key; restart it with {ADMIN_KEY_OPTIONS}",
                                  code="permission_denied")
        return None if settings.api_key is None or is_user else _unauthorized(KEY_OPTIONS)

    def _check_content_type(self, path: str, content_type: str | None) -> Response | None:
        expected = BINARY if path in self.policy.binary else JSON
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type == expected:
            return None
        return error_response(415, f"POST {path} needs Content-Type: {expected} (got {content_type or 'none'})",
                              code="unsupported_media_type")


def _host_name(host: str) -> str:
    """The name part of a Host header ("[::1]:8000" -> "::1", "localhost:8000" -> "localhost")."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, key: str | None) -> bool:
    """Constant-time comparison, so the time a refusal takes says nothing about the key."""
    return token is not None and key is not None and secrets.compare_digest(token.encode(), key.encode())


def _unauthorized(options: str) -> Response:
    return error_response(401, f"Missing or invalid key: send 'Authorization: Bearer <key>' with the key the server "
                          f"was started with ({options})", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})


__all__ = ["CONTROL_TAG", "Access", "Guard", "RoutePolicy"]
