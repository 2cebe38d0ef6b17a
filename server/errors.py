"""Errors in each protocol's own envelope, chosen by route.

OpenAI routes (everything but `/v1/messages*`)::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Anthropic routes (`/v1/messages`, `/v1/messages/count_tokens`)::

    {"type": "error", "error": {"type": ..., "message": ...}}

Routes raise `APIError(ErrorKind.X, message)`; the status and the `type` string come from
`ErrorKind` and the protocol of the route. Client mistakes never become a 5xx: malformed JSON
and validation errors are 400, unknown routes 404, and anything unexpected is a 500 whose body
says nothing about the exception.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineClosedError

logger = logging.getLogger(__name__)

ANTHROPIC_ROUTE_PREFIX = "/v1/messages"


class Protocol(enum.Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def protocol_of(path: str) -> Protocol:
    """The protocol whose envelope an error on `path` uses."""
    if path == ANTHROPIC_ROUTE_PREFIX or path.startswith(ANTHROPIC_ROUTE_PREFIX + "/"):
        return Protocol.ANTHROPIC
    return Protocol.OPENAI


@dataclass(frozen=True)
class _Wire:
    status: int
    type: str
    code: str | None = None  # OpenAI's `code` when the route gives none


class ErrorKind(enum.Enum):
    """What went wrong, independent of protocol; `wire()` gives status and type per protocol."""

    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    PERMISSION = "permission"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    OVERLOADED = "overloaded"  # admission queue full
    UNAVAILABLE = "unavailable"  # engine not running / shutting down
    INTERNAL = "internal"

    def wire(self, protocol: Protocol) -> _Wire:
        return _WIRE[protocol][self]


_WIRE: dict[Protocol, dict[ErrorKind, _Wire]] = {
    Protocol.OPENAI: {
        ErrorKind.INVALID_REQUEST: _Wire(400, "invalid_request_error"),
        ErrorKind.AUTHENTICATION: _Wire(401, "authentication_error", "invalid_api_key"),
        ErrorKind.PERMISSION: _Wire(403, "permission_error"),
        ErrorKind.NOT_FOUND: _Wire(404, "not_found_error"),
        ErrorKind.METHOD_NOT_ALLOWED: _Wire(405, "invalid_request_error"),
        ErrorKind.REQUEST_TOO_LARGE: _Wire(413, "invalid_request_error"),
        ErrorKind.OVERLOADED: _Wire(429, "rate_limit_error", "rate_limit_exceeded"),
        ErrorKind.UNAVAILABLE: _Wire(503, "server_error", "service_unavailable"),
        ErrorKind.INTERNAL: _Wire(500, "server_error"),
    },
    Protocol.ANTHROPIC: {
        ErrorKind.INVALID_REQUEST: _Wire(400, "invalid_request_error"),
        ErrorKind.AUTHENTICATION: _Wire(401, "authentication_error"),
        ErrorKind.PERMISSION: _Wire(403, "permission_error"),
        ErrorKind.NOT_FOUND: _Wire(404, "not_found_error"),
        ErrorKind.METHOD_NOT_ALLOWED: _Wire(405, "invalid_request_error"),
        ErrorKind.REQUEST_TOO_LARGE: _Wire(413, "request_too_large"),
        ErrorKind.OVERLOADED: _Wire(529, "overloaded_error"),
        ErrorKind.UNAVAILABLE: _Wire(529, "overloaded_error"),
        ErrorKind.INTERNAL: _Wire(500, "api_error"),
    },
}

_KIND_OF_STATUS = {
    400: ErrorKind.INVALID_REQUEST,
    401: ErrorKind.AUTHENTICATION,
    403: ErrorKind.PERMISSION,
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.REQUEST_TOO_LARGE,
    429: ErrorKind.OVERLOADED,
    503: ErrorKind.UNAVAILABLE,
}


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
    wire = kind.wire(protocol)
    if protocol is Protocol.ANTHROPIC:
        return {"type": "error", "error": {"type": wire.type, "message": message}}
    return {
        "error": {
            "message": message,
            "type": wire.type,
            "param": param,
            "code": code if code is not None else wire.code,
        }
    }


def error_response(path: str, error: APIError) -> JSONResponse:
    """The JSON response for `error` on a request to `path`."""
    protocol = protocol_of(path)
    body = error_body(protocol, error.kind, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.kind.wire(protocol).status, headers=error.headers)


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
    kind = _KIND_OF_STATUS.get(exc.status_code)
    if kind is None:
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


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, APIError(ErrorKind.INTERNAL, "internal server error"))


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on `app`."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineClosedError, _engine_closed)
    app.add_exception_handler(ClientDisconnectedError, _client_disconnected)
    app.add_exception_handler(Exception, _unexpected)
