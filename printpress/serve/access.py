"""Who may ask, and how much: the API key (`require_key`, a dependency of every API router), the Host allow-list of
a server without a key (`HostCheck`), and the request-body limit (`BodyLimit`); both middlewares answer before any
route or parsing runs.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from printpress.serve.errors import ApiError
from printpress.serve.state import state

DEFAULT_MAX_BODY_BYTES = 1 << 20


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413, before any parsing.

    The body is read here (up to the limit) and replayed to the app, so a client cannot make the app buffer
    more than the limit whatever Content-Length says.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = ApiError(413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await too_big.response()(scope, receive, send)
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        return await self.app(scope, replay, send)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class HostCheck:
    """ASGI middleware for a server without an API key: answer only requests whose `Host` names an allowed host.

    Loopback is reachable only from this machine, but a web page open in its browser can point a name of its own
    at 127.0.0.1 (DNS rebinding) and then read the API's answers as same-origin. Those requests carry the page's
    name in `Host`, so refusing names the server was not told it has stops them (as Jupyter guards its server).
    `"*"` in `allowed` turns the check off.
    """

    def __init__(self, app, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_name(name) for name in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = host_name(dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1"))
        if host in self.allowed:
            return await self.app(scope, receive, send)
        names = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.allowed))
        refused = ApiError(403, f"this server has no API key, so it answers only requests addressed to {names} "
                                "(a guard against DNS rebinding); start it with --allowed-hosts to add a name, or "
                                "with an API key", "permission_error", code="host_not_allowed")
        return await refused.response()(scope, receive, send)


def host_name(host: str) -> str:
    """The host of a `Host` header or a host name, without port, brackets or trailing dot, in lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


_bearer = HTTPBearer(auto_error=False, description="Required when the server was started with an API key.")


def require_key(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 unless the request carries `Authorization: Bearer <key>` (when a key is set). Compared in constant time."""
    key = state(request).api_key
    if key is None:
        return
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", "authentication_error",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), key.encode()):
        raise ApiError(401, "incorrect API key", "authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
