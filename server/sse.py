"""Server-sent events over `sse-starlette`, with client disconnects closing the source.

Two shapes:

* `data_stream(chunks)` — Chat Completions: `data: {...}` per chunk, then `data: [DONE]`.
* `event_stream(events)` — Responses and Messages: `event: <name>` + `data: {...}` per event.

The source is an async iterator (typically an async generator over `engine.generate(...)`).
However the stream ends — completed, client disconnected, server shutting down, an error —
the source is closed (`aclose()`), so the `finally` blocks of the route's generator run and
the engine iterator it holds aborts the request. Release admission slots and call
`metrics.on_finish` in those `finally` blocks.

Headers are sent before the first event, so an exception raised by the source mid-stream
cannot become an HTTP error any more: it is logged and sent as the protocol's error event
(`APIError` messages as they are, anything else as "internal server error"), and the stream
ends. A stream whose request is stopped by the shutdown drain (`server.drain`) ends the same
way, with a 503-kind "the server is shutting down" error event.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.types import Message, Send

from recipe.errors import Protocol
from server.drain import current_stop_event
from server.errors import APIError, ErrorKind, error_body
from server.request_id import log_unexpected

logger = logging.getLogger(__name__)

DONE = "[DONE]"
_SEP = "\n"  # OpenAI and Anthropic both frame events with "\n"; sse-starlette defaults to CRLF
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _frame(data: str, event: str | None = None) -> bytes:
    """One SSE message as sse-starlette's `ServerSentEvent(data, event=event).encode()` frames
    it with `_SEP` (a line break in `data` starts another `data:` line; one in the event name
    is dropped), without its per-message buffer."""
    if "\n" in data or "\r" in data:
        lines = "".join(f"data: {line}{_SEP}" for line in _LINE_BREAK.split(data))
    else:
        lines = f"data: {data}{_SEP}"
    if event is None:
        return f"{lines}{_SEP}".encode()
    return f"event: {_LINE_BREAK.sub('', event)}{_SEP}{lines}{_SEP}".encode()


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # `json.dumps` with these


def encode_json(payload: Any) -> str:
    """Compact JSON for one event's data; strings pass through as they are."""
    if type(payload) is dict:  # the bridge's events: first, as the check costs least
        return _JSON.encode(payload)
    if isinstance(payload, str):
        return payload
    if hasattr(payload, "model_dump_json"):  # pydantic models (e.g. protocol chunk types)
        return payload.model_dump_json(exclude_unset=True)
    return _JSON.encode(payload)


ErrorEvent = Callable[[APIError, int], tuple[str, Mapping[str, Any]]]
"""(error, sequence number the event takes) -> (event name, payload)."""


def _as_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    log_unexpected(exc, "stream failed")
    return APIError(ErrorKind.INTERNAL, "internal server error")


def anthropic_error_event(
    error: APIError, sequence_number: int = 0
) -> tuple[str, Mapping[str, Any]]:
    """Messages' in-stream error: `event: error` with the Anthropic error envelope."""
    return "error", error_body(Protocol.MESSAGES, error.kind, error.message, None, None)


def responses_error_event(error: APIError, sequence_number: int) -> tuple[str, Mapping[str, Any]]:
    """Responses' in-stream error (`ResponseErrorEvent`): type, code, message, param and the
    next `sequence_number` of the stream."""
    openai = error_body(Protocol.RESPONSES, error.kind, error.message, error.param, error.code)
    return "error", {
        "type": "error",
        "code": openai["error"]["code"] or openai["error"]["type"],
        "message": error.message,
        "param": error.param,
        "sequence_number": sequence_number,
    }


_SHUTTING_DOWN = "the server is shutting down"


def _check_not_stopped(stop: Any) -> None:
    if stop is not None and stop.is_set():
        raise APIError(ErrorKind.UNAVAILABLE, _SHUTTING_DOWN)


def _stream_error(exc: Exception, stop: Any) -> APIError:
    """The error a stream ends with. Once the drain has stopped the request, whatever its
    source raised while the engine aborted it (logged when unexpected) ends the stream as
    the stop does: "the server is shutting down"."""
    error = _as_api_error(exc)
    if stop is not None and stop.is_set() and error.kind is not ErrorKind.UNAVAILABLE:
        return APIError(ErrorKind.UNAVAILABLE, _SHUTTING_DOWN)
    return error


def _next_sequence_number(payload: Any, current: int) -> int:
    is_mapping = type(payload) is dict or isinstance(payload, Mapping)
    number = payload.get("sequence_number") if is_mapping else None
    if number is None:
        number = getattr(payload, "sequence_number", None)
    return number + 1 if isinstance(number, int) else current


async def _aclose(source: Any) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def _data_events(
    chunks: AsyncIterator[Mapping[str, Any] | str], send_done: bool
) -> AsyncIterator[bytes]:
    stop = current_stop_event()
    try:
        try:
            async for chunk in chunks:
                _check_not_stopped(stop)
                yield _frame(encode_json(chunk))
        except Exception as exc:  # headers are out: report in-stream (OpenAI/vLLM style)
            error = _stream_error(exc, stop)
            body = error_body(Protocol.CHAT, error.kind, error.message, error.param, error.code)
            yield _frame(encode_json(body))
        if send_done:
            yield _frame(DONE)
    finally:
        await _aclose(chunks)


async def _named_events(
    events: AsyncIterator[tuple[str, Mapping[str, Any] | str]], error_event: ErrorEvent
) -> AsyncIterator[bytes]:
    stop = current_stop_event()
    sequence_number = 0
    try:
        try:
            async for name, payload in events:
                _check_not_stopped(stop)
                sequence_number = _next_sequence_number(payload, sequence_number)
                yield _frame(encode_json(payload), name)
        except Exception as exc:  # headers are out: report in-stream
            name, payload = error_event(_stream_error(exc, stop), sequence_number)
            yield _frame(encode_json(payload), name)
    finally:
        await _aclose(events)


class _EventSourceResponse(EventSourceResponse):
    """sse-starlette's response without a cancel scope per message when no send timeout is
    set (none is: a stalled client is caught by the disconnect watch and the drain)."""

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        # NOTE: overrides a private hook of sse-starlette; were it renamed, messages would
        # only cost a cancel scope each again.
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def _response(body: AsyncIterator[bytes], headers: Mapping[str, str] | None):
    # NOTE: on a client disconnect sse-starlette cancels its sender without closing the body
    # iterator when the sender was suspended in `send`; the background task closes it then
    # (closing an already-closed generator is a no-op).
    return _EventSourceResponse(
        body,
        headers=dict(headers or {}),
        sep=_SEP,
        background=BackgroundTask(_aclose, body),
    )


def data_stream(
    chunks: AsyncIterator[Mapping[str, Any] | str],
    *,
    send_done: bool = True,
    headers: Mapping[str, str] | None = None,
) -> EventSourceResponse:
    """Data-only SSE (Chat Completions): each chunk as `data: <json>`, then `data: [DONE]`."""
    return _response(_data_events(chunks, send_done), headers)


def event_stream(
    events: AsyncIterator[tuple[str, Mapping[str, Any] | str]],
    *,
    error_event: ErrorEvent = anthropic_error_event,
    headers: Mapping[str, str] | None = None,
) -> EventSourceResponse:
    """Named-event SSE (Responses, Messages): each `(name, payload)` as `event:` + `data:`.

    error_event: turns a mid-stream failure into the protocol's error event (Messages by
    default; the Responses route passes `responses_error_event`).
    """
    return _response(_named_events(events, error_event), headers)
