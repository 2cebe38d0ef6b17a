"""What the OpenAPI document (`/openapi.json`) says about the protocol routes.

The protocol routes read raw JSON and validate it through the recipe (`recipe.convert`), so
FastAPI cannot derive their request schemas; these JSON schemas are published instead, with
the error responses every route may give. They describe the fields this server understands;
validation stays the recipe's (a body the schema allows may still be refused with a 400, e.g.
a prompt over the context length), and nothing here changes how a body is parsed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

_STRING_OR_PARTS: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                "required": ["type", "text"],
            },
        },
    ]
}
_STOP = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        {"type": "null"},
    ]
}
_FUNCTION_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
                "strict": {"type": "boolean"},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
_NUMBER_OR_NULL = {"type": ["number", "null"]}
_INT32 = 2**31 - 1
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 1, "maximum": _INT32}

CHAT_REQUEST: dict[str, Any] = {
    "title": "ChatCompletionRequest",
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": _STRING_OR_PARTS,
                    "name": {"type": "string"},
                    "reasoning_content": {"type": ["string", "null"]},
                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                    "tool_call_id": {"type": "string"},
                    "prefix": {"type": "boolean"},
                },
            },
        },
        "max_tokens": _INT_OR_NULL,
        "max_completion_tokens": _INT_OR_NULL,
        "temperature": _NUMBER_OR_NULL,
        "top_p": _NUMBER_OR_NULL,
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 16},
        "stop": _STOP,
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "seed": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**63 - 1},
        "presence_penalty": _NUMBER_OR_NULL,
        "frequency_penalty": _NUMBER_OR_NULL,
        "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
        "tools": {"type": "array", "items": _FUNCTION_TOOL},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
            "required": ["type"],
        },
        "reasoning_effort": {"type": ["string", "null"]},
        "thinking": {
            "type": "object",
            "properties": {"type": {"enum": ["enabled", "disabled"]}},
        },
    },
}

RESPONSES_REQUEST: dict[str, Any] = {
    "title": "ResponsesRequest",
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"type": "string"},
                            "role": {"enum": ["system", "developer", "user", "assistant"]},
                            "content": _STRING_OR_PARTS,
                        },
                    },
                },
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": _INT_OR_NULL,
        "temperature": _NUMBER_OR_NULL,
        "top_p": _NUMBER_OR_NULL,
        "stop": _STOP,
        "stream": {"type": ["boolean", "null"]},
        "store": {"const": False},
        "reasoning": {
            "type": ["object", "null"],
            "properties": {"effort": {"type": ["string", "null"]}},
        },
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "text": {"type": "object"},
    },
}

MESSAGES_REQUEST: dict[str, Any] = {
    "title": "MessagesRequest",
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": _INT32},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": _STRING_OR_PARTS,
                },
            },
        },
        "system": _STRING_OR_PARTS,
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number"},
        "top_k": {"type": "integer", "minimum": 0, "maximum": _INT32},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "stream": {"type": "boolean"},
        "thinking": {
            "type": "object",
            "properties": {
                "type": {"enum": ["enabled", "disabled"]},
                "budget_tokens": {"type": "integer", "minimum": 0, "maximum": _INT32},
            },
            "required": ["type"],
        },
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
                "required": ["name", "input_schema"],
            },
        },
        "tool_choice": {
            "type": "object",
            "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}},
            "required": ["type"],
        },
        "metadata": {"type": "object"},
    },
}

COUNT_TOKENS_REQUEST: dict[str, Any] = {
    **MESSAGES_REQUEST,
    "title": "CountTokensRequest",
    "required": ["model", "messages"],
}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """The OpenAI error envelope (Chat Completions, Responses, the other OpenAI routes)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The Anthropic error envelope (Messages, count_tokens)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_ERROR_STATUSES = {
    "400": "Invalid request: malformed JSON, a field the request gets wrong or that is not "
    "supported, a prompt over the context length, nesting deeper than 64 levels",
    "401": "Missing or invalid API key (only with --api-key)",
    "404": "Unknown model",
    "413": "Request body larger than --max-request-bytes",
    "415": "Content-Type is not JSON",
}


def error_responses(anthropic: bool, *, generation: bool = True) -> dict[int | str, Any]:
    """The documented error responses of a route, in its protocol's envelope (published once,
    under `components/schemas`, and referenced by every route's responses)."""
    model = AnthropicError if anthropic else OpenAIError
    statuses = dict(_ERROR_STATUSES)
    if generation:
        if anthropic:
            statuses["529"] = "Overloaded: at capacity, or shutting down"
        else:
            statuses["429"] = "At capacity (--max-queued-requests); retry later"
            statuses["503"] = "Shutting down, or the engine is not running"
    return {status: {"description": text, "model": model} for status, text in statuses.items()}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` publishing `schema` as the route's required JSON request body."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }
