"""A request id per HTTP request, and the last line of defence against unexpected exceptions.

Every response carries `x-request-id: req_<hex>`; log lines written while the request is handled
can name it through `current_request_id()`. An exception no handler turned into a response is
logged as ONE line (request id, route, exception type and message, where it was raised; the full
traceback only at DEBUG) and answered with a 500 in the route's envelope.

NOTE: this middleware sits inside Starlette's `ServerErrorMiddleware` and never re-raises:
an exception escaping to the server makes uvicorn log the whole traceback again and close the
keep-alive connection under the client (a deep `RecursionError` was ~3,000 lines per request).
"""

from __future__ import annotations

import contextvars
import logging
import traceback
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, ErrorKind, error_response

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def current_request_id() -> str | None:
    """The id of the request being handled in this context, or None outside a request."""
    return _request_id.get()


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def _raised_at(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def log_unexpected(exc: BaseException, what: str) -> None:
    """One ERROR line for an unexpected exception (traceback at DEBUG only)."""
    message = str(exc).splitlines()[0][:300] if str(exc) else ""
    logger.error(
        "%s [%s]: %s: %s (raised at %s)",
        what,
        current_request_id(),
        type(exc).__name__,
        message,
        _raised_at(exc),
    )
    logger.debug("traceback of the error above", exc_info=exc)


class RequestIdMiddleware:
    """Pure ASGI middleware: assigns the id, adds the header, answers unhandled errors."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        token = _request_id.set(request_id)
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            log_unexpected(exc, f"unhandled error on {scope['method']} {scope['path']}")
            if not started:
                error = APIError(ErrorKind.INTERNAL, "internal server error")
                await error_response(scope["path"], error)(scope, receive, send_with_id)
        finally:
            _request_id.reset(token)
