"""Request bodies: size limit, media type and JSON nesting, checked before anything parses them.

`RequestBodyMiddleware` reads the whole body of every POST before the route sees it:

* over `max_request_bytes` -> 413 (`Content-Length` checked before a byte is read; a chunked
  body is counted as it arrives and refused once over), with `Connection: close`, since the
  rest of the upload is never read;
* a `Content-Type` other than JSON -> 415. JSON is `application/json` or `application/*+json`
  (any parameters). Lenient where clients need it: no `Content-Type` at all, and
  `application/x-www-form-urlencoded` (what `curl -d` sends unless told otherwise), are read as
  JSON too; a body that is not JSON is then a 400 like any other;
* nested deeper than `MAX_JSON_DEPTH` arrays/objects -> 400, counted without recursion (string
  contents skipped), so no recursive step later (`json.loads`, `copy.deepcopy`, the recipe's
  conversion) can hit a `RecursionError`;
* a client that leaves mid-upload is logged at INFO and gets no answer.

Errors use the route's envelope. The route then reads the buffered body as usual; later
`receive()` calls go to the client (disconnect detection keeps working).
"""

from __future__ import annotations

import asyncio
import logging
import re

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, ErrorKind, error_response
from server.request_id import current_request_id

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
"""Arrays/objects nested in each other at most this deep. The package's conversion parses with
serde_json, whose recursion limit is 128; 64 leaves room for everything a request carries
(tool schemas included) and keeps every recursive step far from its limit."""

_OFF_LOOP_BYTES = 256 * 1024  # a depth scan of a larger body runs in a worker thread
_LENIENT_TYPES = frozenset({"", "application/x-www-form-urlencoded"})
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NON_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def is_nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether arrays/objects in `raw` nest more than `limit` deep (brackets inside strings do
    not count). No recursion; works on any bytes (malformed JSON is refused by the parser)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", raw).translate(None, _NON_BRACKETS)
    if len(brackets) <= limit:
        return False
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32) * 2 - 1  # +1 / -1
    return int(np.cumsum(steps).max()) > limit


def is_json_media_type(content_type: str) -> bool:
    """Whether a `Content-Type` header value is read as JSON (see the module docstring)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in _LENIENT_TYPES or media == "application/json":
        return True
    return media.startswith("application/") and media.endswith("+json")


class _Refused(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


class _ClientGone(Exception):
    pass


class RequestBodyMiddleware:
    """Pure ASGI middleware applying the checks of the module docstring to every POST."""

    def __init__(self, app: ASGIApp, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except _Refused as refused:
            await error_response(scope["path"], refused.error)(scope, receive, send)
            return
        except _ClientGone:
            logger.info(
                "client disconnected during the upload of %s [%s]",
                scope["path"],
                current_request_id(),
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        content_type = headers.get("content-type", "")
        if not is_json_media_type(content_type):
            raise _Refused(
                APIError(
                    ErrorKind.UNSUPPORTED_MEDIA_TYPE,
                    f"Content-Type {content_type!r} is not supported; send application/json",
                )
            )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise _Refused(self._too_large())
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise _Refused(self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) > _OFF_LOOP_BYTES:
            too_deep = await asyncio.to_thread(is_nested_deeper_than, body, MAX_JSON_DEPTH)
        else:
            too_deep = is_nested_deeper_than(body, MAX_JSON_DEPTH)
        if too_deep:
            raise _Refused(
                APIError(
                    ErrorKind.INVALID_REQUEST,
                    f"request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
                )
            )
        return body

    def _too_large(self) -> APIError:
        return APIError(
            ErrorKind.REQUEST_TOO_LARGE,
            f"request body is larger than the limit of {self.max_request_bytes} bytes",
            headers={"connection": "close"},
        )
