"""Request errors in each protocol's own envelope (`recipe.md` §8, §10): the one `Protocol`
enum of the project and the one table of error types per protocol (the server's errors use it
too).

What the two vendors send (their API error documentation)::

    status  OpenAI type (code)                        Anthropic type
    400     invalid_request_error                     invalid_request_error
    401     authentication_error (invalid_api_key)    authentication_error
    403     permission_error                          permission_error
    404     not_found_error                           not_found_error
    413     invalid_request_error                     request_too_large
    429     requests (rate_limit_exceeded)            rate_limit_error
    500     server_error                              api_error
    503     server_error (service_unavailable)        -
    529     -                                         overloaded_error

OpenAI's 429 for a request-rate limit is `{"type": "requests", "code": "rate_limit_exceeded"}`
("tokens" for a token-rate limit); Anthropic's 429 is a per-account rate limit and 529 the API
overloaded for everyone, which is what a full admission queue here is.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class Protocol(enum.StrEnum):
    """The API a request speaks; its errors use OpenAI's envelope except on Messages."""

    CHAT = "chat.completions"
    RESPONSES = "responses"
    MESSAGES = "messages"

    @property
    def is_anthropic(self) -> bool:
        """Whether errors use Anthropic's envelope (`{"type": "error", "error": {...}}`)."""
        return self is Protocol.MESSAGES


_OPENAI_TYPES: Mapping[int, str] = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "requests",
        500: "server_error",
        503: "server_error",
    }
)
_ANTHROPIC_TYPES: Mapping[int, str] = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        529: "overloaded_error",
    }
)
# OpenAI's `code` when the raiser names none.
_OPENAI_CODES: Mapping[int, str] = MappingProxyType(
    {401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}
)
ERROR_TYPES: Mapping[Protocol, Mapping[int, str]] = MappingProxyType(
    {
        Protocol.CHAT: _OPENAI_TYPES,
        Protocol.RESPONSES: _OPENAI_TYPES,
        Protocol.MESSAGES: _ANTHROPIC_TYPES,
    }
)


def error_type(protocol: Protocol, status_code: int) -> str:
    """The protocol's error `type` for `status_code`; a status the table lacks is the protocol's
    generic client error below 500 and its generic server error from 500 up."""
    types = ERROR_TYPES[protocol]
    if status_code in types:
        return types[status_code]
    return types[400] if status_code < 500 else types[500]


def error_body(
    protocol: Protocol,
    status_code: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI `{"error": {message, type, param, code}}` or Anthropic
    `{"type": "error", "error": {type, message}}` (Anthropic has no `param` / `code`)."""
    kind = error_type(protocol, status_code)
    if protocol.is_anthropic:
        return {"type": "error", "error": {"type": kind, "message": message}}
    if code is None:
        code = _OPENAI_CODES.get(status_code)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RecipeError(Exception):
    """A request the recipe refuses (or a stream it cannot finish), with its HTTP status.

    `error_type` is the protocol's own type name for `status_code` (`ERROR_TYPES`); `body()` is
    the protocol's error envelope.
    """

    def __init__(
        self, status_code: int, message: str, protocol: Protocol, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.protocol = protocol
        self.param = param

    @property
    def error_type(self) -> str:
        return error_type(self.protocol, self.status_code)

    def body(self) -> dict[str, Any]:
        """The protocol's error envelope for this error."""
        return error_body(self.protocol, self.status_code, self.message, self.param)
