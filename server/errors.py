"""Errors in each protocol's own envelope, chosen by route.

OpenAI routes (everything but `/v1/messages*`)::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Anthropic routes (`/v1/messages`, `/v1/messages/count_tokens`)::

    {"type": "error", "error": {"type": ..., "message": ...}}

Routes raise `APIError(ErrorKind.X, message)`; the status comes from `ErrorKind` and the
protocol of the route, the `type` string from that protocol's table (`recipe.errors`, the one
`Protocol` enum and status→type table of the project). Client mistakes never become a 5xx:
malformed JSON and validation errors are 400, unknown routes 404, and anything unexpected is a
500 whose body says nothing about the exception.
"""

from __future__ import annotations

import enum
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineClosedError
from engine.client import EngineFailedError
from recipe.errors import Protocol
from recipe.errors import error_body as protocol_error_body

logger = logging.getLogger(__name__)

ANTHROPIC_ROUTE_PREFIX = "/v1/messages"
RESPONSES_ROUTE_PREFIX = "/v1/responses"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def protocol_of(path: str) -> Protocol:
    """The protocol whose envelope an error on `path` uses: Messages for `/v1/messages*`,
    Responses for `/v1/responses*`, Chat Completions (OpenAI's envelope) for every other route."""
    if _under(path, ANTHROPIC_ROUTE_PREFIX):
        return Protocol.MESSAGES
    if _under(path, RESPONSES_ROUTE_PREFIX):
        return Protocol.RESPONSES
    return Protocol.CHAT


class ErrorKind(enum.Enum):
    """What went wrong, independent of protocol; the value is its HTTP status on OpenAI routes
    (`status()` gives Anthropic's, whose overload is a 529). The `type` string comes from the
    protocol's table in `recipe.errors`."""

    INVALID_REQUEST = 400
    AUTHENTICATION = 401
    PERMISSION = 403
    NOT_FOUND = 404
    METHOD_NOT_ALLOWED = 405
    REQUEST_TOO_LARGE = 413
    UNSUPPORTED_MEDIA_TYPE = 415
    OVERLOADED = 429  # admission queue full
    INTERNAL = 500
    UNAVAILABLE = 503  # engine not running / shutting down

    def status(self, protocol: Protocol) -> int:
        """The HTTP status of this kind of error on a route of `protocol`."""
        if protocol.is_anthropic and self in (ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE):
            return 529
        return self.value


class APIError(Exception):
    """An error a route reports to the client in its protocol's envelope.

    param: the offending request field (OpenAI `param`), e.g. `"messages[2].content"`.
    code: OpenAI's machine-readable `code` (default from the kind, e.g. `rate_limit_exceeded`).
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class ClientDisconnectedError(Exception):
    """The client went away before the response was ready (answered with an unread 499)."""


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request the client abandoned


def error_body(
    protocol: Protocol, kind: ErrorKind, message: str, param: str | None, code: str | None
) -> dict:
    """The protocol's error envelope for an error of `kind` (`recipe.errors.error_body`)."""
    return protocol_error_body(protocol, kind.status(protocol), message, param, code)


def error_response(path: str, error: APIError) -> JSONResponse:
    """The JSON response for `error` on a request to `path`."""
    protocol = protocol_of(path)
    body = error_body(protocol, error.kind, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.kind.status(protocol), headers=error.headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the first offending field for a FastAPI validation error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    parts: list[str] = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    first_loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    return "; ".join(parts), ".".join(first_loc) or None


# ---- handlers -----------------------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(request.url.path, exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc)
    return error_response(
        request.url.path, APIError(ErrorKind.INVALID_REQUEST, message, param=param)
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        kind = ErrorKind(exc.status_code)
    except ValueError:
        kind = ErrorKind.INTERNAL if exc.status_code >= 500 else ErrorKind.INVALID_REQUEST
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if kind is ErrorKind.NOT_FOUND and message == "Not Found":
        message = f"no route {request.method} {request.url.path}"
    headers = dict(exc.headers) if exc.headers else None
    return error_response(request.url.path, APIError(kind, message, headers=headers))


async def _engine_closed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(
        request.url.path, APIError(ErrorKind.UNAVAILABLE, "the server is shutting down")
    )


async def _engine_failed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, APIError(ErrorKind.UNAVAILABLE, str(exc)))


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on `app`. Exceptions no handler takes are answered by
    `server.request_id.RequestIdMiddleware` (one log line, a 500, the connection kept)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineClosedError, _engine_closed)
    app.add_exception_handler(EngineFailedError, _engine_failed)
    app.add_exception_handler(ClientDisconnectedError, _client_disconnected)
