"""API-key check (`--api-key`), done before the body is read.

OpenAI routes take `Authorization: Bearer <key>`; Messages routes (`/v1/messages*`) take
`x-api-key: <key>`, or the Bearer header as the Anthropic SDK sends with `auth_token`.
`/`, `/health` and `/metrics` are always open. A missing or wrong key is a 401 in the route's own
envelope, with a `WWW-Authenticate: Bearer` challenge.
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from recipe.errors import Protocol
from server.errors import APIError, ErrorKind, error_response, protocol_of

OPEN_PATHS = frozenset({"/", "/health", "/metrics"})
WWW_AUTHENTICATE = 'Bearer realm="deepinfer-server"'  # RFC 9110 §11.6.1: every 401 names one


def presented_key(headers: dict[str, str], protocol: Protocol) -> str | None:
    """The key a request carries for `protocol` (headers lower-cased), or None."""
    if protocol.is_anthropic and headers.get("x-api-key"):
        return headers["x-api-key"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ApiKeyMiddleware:
    """Pure ASGI middleware: answers 401 itself, so streaming responses pass untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        protocol = protocol_of(scope["path"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = presented_key(headers, protocol)
        if key is not None and secrets.compare_digest(key.encode(), self._api_key):
            await self.app(scope, receive, send)
            return
        header = "x-api-key" if protocol.is_anthropic else "Authorization: Bearer"
        message = "missing API key" if key is None else "invalid API key"
        error = APIError(
            ErrorKind.AUTHENTICATION,
            f"{message} (send it as {header})",
            headers={"www-authenticate": WWW_AUTHENTICATE},
        )
        await error_response(scope["path"], error)(scope, receive, send)
