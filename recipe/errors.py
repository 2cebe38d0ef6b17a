"""Request errors in each protocol's own envelope (`recipe.md` §8, §10)."""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Any


class Protocol(enum.StrEnum):
    CHAT = "chat.completions"
    RESPONSES = "responses"
    MESSAGES = "messages"


_OPENAI_TYPES: MappingProxyType[int, str] = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_exceeded",
        500: "server_error",
    }
)
_ANTHROPIC_TYPES: MappingProxyType[int, str] = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        529: "overloaded_error",
    }
)


class RecipeError(Exception):
    """A request the recipe refuses (or a stream it cannot finish), with its HTTP status.

    `error_type` is the protocol's own type name for `status_code` (OpenAI's
    `invalid_request_error` / `server_error`…, Anthropic's `invalid_request_error` /
    `api_error`…); `body()` is the protocol's error envelope.
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
        types = _ANTHROPIC_TYPES if self.protocol is Protocol.MESSAGES else _OPENAI_TYPES
        fallback = "api_error" if self.protocol is Protocol.MESSAGES else "server_error"
        return types.get(
            self.status_code, "invalid_request_error" if self.status_code < 500 else fallback
        )

    def body(self) -> dict[str, Any]:
        """OpenAI `{"error": {message, type, param, code}}` or Anthropic
        `{"type": "error", "error": {type, message}}`."""
        if self.protocol is Protocol.MESSAGES:
            return {"type": "error", "error": {"type": self.error_type, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.error_type,
            }
        }
