"""ServerSettings: what one deployment decides about who may call the server and how much one request may ask for.

Everything a client can make the server hold (sequences, bytes, upload sessions, time parked behind a pause) has a
bound here, so one request can never starve the others. `rollout serve` fills it from its options (`cli`); the
defaults suit a server on 127.0.0.1 without keys.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MiB = 1024**2


def is_loopback(host: str) -> bool:
    """True for a bind address or Host name that only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """Access control and per-request bounds of one server (see the README's Security section).

    Keys: `api_key` guards the OpenAI routes and /metrics, `admin_key` the RL control routes (weight updates, pause,
    resume, prefix-cache reset). Without an admin key the control routes are served only on a loopback `host`.
    Without an API key, the Host header must name this server (`allowed_hosts`, loopback names always), which stops
    DNS-rebinding pages.
    """

    api_key: str | None = None
    admin_key: str | None = None
    host: str = "127.0.0.1"  # the bind address (decides whether control routes may run without an admin key)
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides the loopback ones; "*" accepts any
    cors_origins: tuple[str, ...] = ()  # origins whose pages may call the server (CORS); none by default
    weights_dirs: tuple[str, ...] = ()  # roots /update_weights {path} may load from; none: path loads are refused
    max_n: int = 128  # samples per prompt (OpenAI's cap)
    max_choices: int = 1024  # sequences per request: prompts x n
    max_body_bytes: int = 16 * MiB  # a JSON request body
    body_timeout_s: float = 30.0  # longest wait for the next piece of a request body
    max_upload_bytes: int | None = None  # bytes of one chunked weight upload; None: the model's size in float64
    max_uploads: int = 2  # chunked weight uploads open at once
    upload_ttl_s: float = 600.0  # an upload idle this long is dropped
    pause_timeout_s: float = 300.0  # a request parked this long behind POST /pause is answered 503

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (pass None for no key)")
        if self.admin_key is not None and not self.admin_key:
            raise ValueError("admin_key must not be empty (pass None for no key)")
        if self.api_key is not None and self.api_key == self.admin_key:
            raise ValueError("api_key and admin_key must differ: every API client could otherwise replace the "
                             "weights")
        for name in ("max_n", "max_choices", "max_body_bytes", "max_uploads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("body_timeout_s", "upload_ttl_s", "pause_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def control_open_without_key(self) -> bool:
        """Whether the RL control routes may run without an admin key: only when bound to loopback."""
        return is_loopback(self.host)

    def host_allowed(self, name: str) -> bool:
        """Whether a request's Host name (port removed) names this server."""
        if "*" in self.allowed_hosts:
            return True
        name = name.strip("[]").lower()
        bind = () if self.host in ("0.0.0.0", "::", "") else (self.host,)  # a wildcard bind names no host
        named = {h.strip("[]").lower() for h in (*self.allowed_hosts, *bind)}
        return is_loopback(name) or name in named


__all__ = ["MiB", "ServerSettings", "is_loopback"]
