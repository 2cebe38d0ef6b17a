"""Every top-level request field of each protocol, classified (`recipe.md` §5.1, §10).

The package accepts any unknown field and drops it; the project's rule is that no field is
accepted and ignored. `take_fields` runs first on every body and answers 400 for:

* a field not in the protocol's table: in the vendor's words, OpenAI
  `Unrecognized request argument supplied: X` (nested: `Unknown parameter: 'X.k'.`),
  Anthropic `X: Extra inputs are not permitted`;
* an UNSUPPORTED field (an official field this server does not implement):
  `'X' is not supported by this server: <why>`, unless its value is one of the rule's
  neutral values (values asking for what the server does anyway, e.g. `modalities: ["text"]`).

IMPLEMENTED fields are honoured by the package or by our layer (`recipe/convert.py`,
`recipe/constraints.py`, or here: the vLLM sampling extensions below, Chat
`prompt_cache_key`, Responses `seed`); METADATA fields are checked by nothing but need nothing
from a server like this one (each rule says why). A JSON `null` is always treated as absent.
Nested objects the package reads without checking their keys (`stream_options`, `reasoning`,
`text`, `output_config`, Anthropic `metadata`) are checked the same way, one level down.

Sampling extensions (vLLM's, on Chat and Responses): `top_k` (-1 or 0 = off), `min_p`,
`repetition_penalty`, `ignore_eos` (not with a grammar or tools that may be called: the
grammar ends at EOS), `min_tokens`; Responses also takes `seed` (as Chat does; OpenAI's
Responses has none) so seeded requests reproduce.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from recipe.errors import Protocol, RecipeError

if TYPE_CHECKING:
    from recipe.convert import PreparedRequest


class FieldClass(enum.Enum):
    IMPLEMENTED = "implemented"
    METADATA = "accepted as metadata"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class FieldRule:
    """How a field is handled. why: what honours it (IMPLEMENTED), why nothing has to
    (METADATA), or why it is refused (UNSUPPORTED, quoted in the 400); neutral: UNSUPPORTED
    values that are accepted (they ask for what the server does anyway); keys: the rules of an
    object value's keys (None = not checked here: the package or our layer checks them)."""

    kind: FieldClass
    why: str
    neutral: tuple[Any, ...] = ()
    keys: Mapping[str, FieldRule] | None = None


def _impl(why: str, keys: Mapping[str, FieldRule] | None = None) -> FieldRule:
    return FieldRule(FieldClass.IMPLEMENTED, why, keys=keys)


def _meta(why: str) -> FieldRule:
    return FieldRule(FieldClass.METADATA, why)


def _unsupported(why: str, *neutral: Any) -> FieldRule:
    return FieldRule(FieldClass.UNSUPPORTED, why, neutral)


_PACKAGE = "the package (deepseek-recipe) renders or samples with it"
_OURS = "recipe/convert.py"
_CONSTRAINTS = "recipe/constraints.py (a grammar)"
_SAMPLING = "recipe/fields.py (the sampling parameters)"
_NO_STORE = "this server stores nothing"
_OBFUSCATION = _unsupported("stream events carry no obfuscation padding", False)
_VERBOSITY = _unsupported("the model has no verbosity control", "medium")
_CACHE_RETENTION = _unsupported(
    "cached prefixes live in the prefix cache until evicted (LRU); no retention policy",
    "in_memory",
)
_CACHE_OPTIONS = _unsupported("the prefix cache is automatic (no breakpoints or TTL)", {})
_MODERATION = _unsupported("no moderation is run")

# vLLM extensions both OpenAI protocols take.
_OPENAI_EXTENSIONS: dict[str, FieldRule] = {
    "cache_salt": _impl(f"{_OURS}: prefix-cache isolation"),
    "traffic_class": _impl(f"{_OURS}: the KV cache directories' TTL class"),
    "logit_bias": _impl(f"{_OURS}: checked against the vocabulary"),
    "thinking": _impl(f"{_PACKAGE} (Chat) / {_OURS} (Responses)"),
    "top_k": _impl(_SAMPLING),
    "min_p": _impl(_SAMPLING),
    "repetition_penalty": _impl(_SAMPLING),
    "ignore_eos": _impl(_SAMPLING),
    "min_tokens": _impl(_SAMPLING),
}
_JSON_WHITESPACE = _impl(f"{_CONSTRAINTS}: whitespace allowed between JSON tokens")

CHAT_FIELDS: Mapping[str, FieldRule] = MappingProxyType(
    {
        "model": _impl(_OURS),
        "messages": _impl(f"{_PACKAGE}; `developer` -> system in {_OURS}"),
        "stream": _impl(_PACKAGE),
        "stream_options": _impl(
            f"{_PACKAGE} (needs stream: true)",
            keys={
                "include_usage": _impl(f"{_OURS}: a final usage chunk"),
                "include_obfuscation": _OBFUSCATION,
            },
        ),
        "max_tokens": _impl(_PACKAGE),
        "max_completion_tokens": _impl(f"{_OURS}: wins over max_tokens"),
        "temperature": _impl(_PACKAGE),
        "top_p": _impl(_PACKAGE),
        "seed": _impl(_PACKAGE),
        "stop": _impl(_PACKAGE),
        "n": _impl(f"{_OURS}: n engine choices"),
        "presence_penalty": _impl(_OURS),
        "frequency_penalty": _impl(_OURS),
        "logprobs": _impl(_PACKAGE),
        "top_logprobs": _impl(_PACKAGE),
        "reasoning_effort": _impl(_PACKAGE),
        "response_format": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "tools": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "tool_choice": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "parallel_tool_calls": _impl(_CONSTRAINTS),
        "prompt_cache_key": _impl(f"{_SAMPLING}: the data-parallel affinity key"),
        "store": _impl(f"{_OURS}: false only ({_NO_STORE})"),
        "service_tier": _impl(f"{_OURS}: auto / default only (one tier)"),
        "metadata": _meta(f"tags for stored completions; {_NO_STORE} (store: true is a 400)"),
        "user": _meta("an end-user id for the provider's abuse monitoring; none runs here"),
        "safety_identifier": _meta("an end-user id for abuse monitoring; none runs here"),
        "audio": _unsupported("audio output is not supported (text only)"),
        "modalities": _unsupported("the only output modality is text", ["text"]),
        "functions": _unsupported("the deprecated functions API is not supported; use tools"),
        "function_call": _unsupported("the deprecated functions API is not supported; use tools"),
        "prediction": _unsupported("predicted outputs are not implemented"),
        "verbosity": _VERBOSITY,
        "web_search_options": _unsupported(
            "there is no web search (the model has no server tools)"
        ),
        "prompt_cache_retention": _CACHE_RETENTION,
        "prompt_cache_options": _CACHE_OPTIONS,
        "moderation": _MODERATION,
        # Extensions (vLLM, SGLang).
        **_OPENAI_EXTENSIONS,
        "json_whitespace": _JSON_WHITESPACE,
        "chat_template_kwargs": _impl(f"{_OURS}: thinking / enable_thinking / reasoning_effort"),
        "structured_outputs": _impl(_CONSTRAINTS),
        "guided_json": _impl(_CONSTRAINTS),
        "guided_regex": _impl(_CONSTRAINTS),
        "guided_grammar": _impl(_CONSTRAINTS),
        "guided_choice": _impl(_CONSTRAINTS),
        "guided_decoding_backend": _impl(f"{_CONSTRAINTS}: xgrammar only"),
        "ebnf": _impl(_CONSTRAINTS),
    }
)

RESPONSES_FIELDS: Mapping[str, FieldRule] = MappingProxyType(
    {
        "model": _impl(_OURS),
        "input": _impl(f"{_PACKAGE}; sealed reasoning opened in {_OURS}"),
        "instructions": _impl(_PACKAGE),
        "stream": _impl(_PACKAGE),
        "stream_options": _impl("only its key below", keys={"include_obfuscation": _OBFUSCATION}),
        "max_output_tokens": _impl(_PACKAGE),
        "temperature": _impl(_PACKAGE),
        "top_p": _impl(_PACKAGE),
        "top_logprobs": _impl(_PACKAGE),
        "reasoning": _impl(
            _PACKAGE,
            keys={
                "effort": _impl(_PACKAGE),
                "summary": _impl(f"{_OURS}: checked and echoed; no summaries are generated"),
            },
        ),
        "text": _impl(
            _PACKAGE, keys={"format": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"), "verbosity": _VERBOSITY}
        ),
        "tools": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "tool_choice": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "parallel_tool_calls": _impl(_CONSTRAINTS),
        "include": _impl(f"{_OURS}: reasoning.encrypted_content only"),
        "prompt_cache_key": _impl(f"{_OURS}: echoed, the data-parallel affinity key"),
        "store": _impl(f"{_OURS}: false only ({_NO_STORE})"),
        "background": _impl(f"{_OURS}: false only ({_NO_STORE})"),
        "previous_response_id": _impl(f"{_OURS}: a 400 ({_NO_STORE})"),
        "truncation": _impl(f"{_OURS}: disabled only (over-long inputs are a 400)"),
        "metadata": _impl(f"{_OURS}: {{}} only (the echo is always {{}})"),
        "user": _meta("echoed in the response; an end-user id for abuse monitoring"),
        "safety_identifier": _meta("an end-user id for abuse monitoring; none runs here"),
        "client_metadata": _meta(f"Codex's per-turn ids; checked in {_OURS}, not stored"),
        "max_tool_calls": _meta("limits calls to built-in (hosted) tools; this server runs none"),
        "service_tier": _unsupported("this server has one service tier", "auto", "default"),
        "conversation": _unsupported(f"no server-side conversations ({_NO_STORE})"),
        "prompt": _unsupported("no stored prompt templates"),
        "context_management": _unsupported("server-side compaction is not implemented"),
        "background_options": _unsupported("no background execution"),
        "prompt_cache_retention": _CACHE_RETENTION,
        "prompt_cache_options": _CACHE_OPTIONS,
        "moderation": _MODERATION,
        # Extensions (vLLM; Chat's names).
        **_OPENAI_EXTENSIONS,
        "seed": _impl(_SAMPLING),
        "stop": _impl(f"{_OURS}: stop sequences"),
        "json_whitespace": _JSON_WHITESPACE,
    }
)

MESSAGES_FIELDS: Mapping[str, FieldRule] = MappingProxyType(
    {
        "model": _impl(_OURS),
        "messages": _impl(_PACKAGE),
        "system": _impl(_PACKAGE),
        "max_tokens": _impl(f"{_PACKAGE}; required in {_OURS}"),
        "stream": _impl(_PACKAGE),
        "temperature": _impl(_PACKAGE),
        "top_p": _impl(_PACKAGE),
        "top_k": _impl(_OURS),
        "stop_sequences": _impl(_PACKAGE),
        "tools": _impl(f"{_PACKAGE}; {_CONSTRAINTS}"),
        "tool_choice": _impl(f"{_PACKAGE}; {_CONSTRAINTS}: any, disable_parallel_tool_use"),
        "thinking": _impl(_PACKAGE),
        "output_config": _impl(
            "its keys below",
            keys={"effort": _impl(_PACKAGE), "format": _impl(_CONSTRAINTS)},
        ),
        "context_management": _impl(f"{_OURS}: clear_thinking edits only"),
        "metadata": FieldRule(
            FieldClass.METADATA,
            "user_id identifies the end user for abuse monitoring; none runs here",
            keys={"user_id": _meta("an opaque end-user id")},
        ),
        "cache_control": _meta("prefix caching is automatic: every prompt's prefix is cached"),
        "service_tier": _unsupported(
            "this server has one (standard) tier", "auto", "standard_only"
        ),
        "speed": _unsupported("there is one inference speed", "standard"),
        "container": _unsupported("no code-execution containers"),
        "inference_geo": _unsupported("inference runs where this server is deployed"),
        "mcp_servers": _unsupported("MCP connectors are not supported", []),
        "diagnostics": _unsupported("no cache diagnostics are reported"),
        "thread": _unsupported(f"no server-held threads ({_NO_STORE})"),
        "compaction": _unsupported("compaction requests are not implemented"),
        "fallbacks": _unsupported("there is one model and no fallback"),
        # Extensions (vLLM's, as on the OpenAI routes).
        "cache_salt": _OPENAI_EXTENSIONS["cache_salt"],
        "traffic_class": _OPENAI_EXTENSIONS["traffic_class"],
        "logit_bias": _OPENAI_EXTENSIONS["logit_bias"],
        "json_whitespace": _JSON_WHITESPACE,
    }
)

FIELDS: Mapping[Protocol, Mapping[str, FieldRule]] = MappingProxyType(
    {
        Protocol.CHAT: CHAT_FIELDS,
        Protocol.RESPONSES: RESPONSES_FIELDS,
        Protocol.MESSAGES: MESSAGES_FIELDS,
    }
)


# ---------------------------------------------------------------- sampling fields


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class _SamplingField:
    """A body field that sets one `SamplingParams` attribute (range checks are its own)."""

    attr: str
    is_valid: Callable[[Any], bool]
    expected: str
    convert: Callable[[Any], Any] = lambda value: value


_VLLM_SAMPLING = {
    "top_k": _SamplingField("top_k", _int, "an integer (-1 or 0: off)", lambda k: max(k, 0)),
    "min_p": _SamplingField("min_p", _number, "a number", float),
    "repetition_penalty": _SamplingField("repetition_penalty", _number, "a number", float),
    "ignore_eos": _SamplingField("ignore_eos", lambda v: isinstance(v, bool), "a boolean"),
    "min_tokens": _SamplingField("min_tokens", _int, "an integer"),
}
_SEED_LIMIT = 2**63
SAMPLING_FIELDS: Mapping[Protocol, Mapping[str, _SamplingField]] = MappingProxyType(
    {
        Protocol.CHAT: {
            **_VLLM_SAMPLING,
            "prompt_cache_key": _SamplingField(
                "affinity_key", lambda v: isinstance(v, str), "a string"
            ),
        },
        Protocol.RESPONSES: {
            **_VLLM_SAMPLING,
            "seed": _SamplingField(
                "seed", lambda v: _int(v) and 0 <= v < _SEED_LIMIT, "an integer in [0, 2^63)"
            ),
        },
        Protocol.MESSAGES: {},
    }
)


def take_fields(protocol: Protocol, body: dict[str, Any]) -> dict[str, Any]:
    """Check every field of `body` against the protocol's table, then take the fields this
    module implements out of it.

    Returns:
        `SamplingParams` attributes to set (`with_sampling_fields`).
    Raises:
        RecipeError: 400 for an unknown or unsupported field (or key of a checked object), or
            a sampling field of the wrong type.
    """
    _check(protocol, body, FIELDS[protocol], "")
    found: dict[str, Any] = {}
    for name, spec in SAMPLING_FIELDS[protocol].items():
        value = body.pop(name, None)
        if value is None:
            continue
        if not spec.is_valid(value):
            raise RecipeError(400, f"{name}: must be {spec.expected}", protocol, name)
        found[spec.attr] = spec.convert(value)
    return found


def with_sampling_fields(
    prepared: PreparedRequest, fields: dict[str, Any], protocol: Protocol
) -> PreparedRequest:
    """`prepared` with the sampling fields `take_fields` found.

    Raises:
        RecipeError: 400 for a value out of range, or `ignore_eos` with a grammar.
    """
    if not fields:
        return prepared
    if fields.get("ignore_eos") and prepared.grammar is not None:
        raise RecipeError(
            400,
            "ignore_eos cannot be combined with a JSON/regex/grammar constraint or with tools "
            "that may be called (the grammar ends the output at EOS)",
            protocol,
            "ignore_eos",
        )
    try:
        params = dataclasses.replace(prepared.sampling_params, **fields)
    except ValueError as exc:
        raise RecipeError(400, str(exc), protocol) from exc
    return dataclasses.replace(prepared, sampling_params=params)


# ---------------------------------------------------------------- checks


def _check(
    protocol: Protocol, body: dict[str, Any], rules: Mapping[str, FieldRule], at: str
) -> None:
    for name, value in body.items():
        path = f"{at}{name}"
        rule = rules.get(name)
        if rule is None:
            raise RecipeError(400, _unknown_message(protocol, path), protocol, path)
        if value is None:
            continue
        if rule.kind is FieldClass.UNSUPPORTED and value not in rule.neutral:
            accepted = ", ".join(json.dumps(v) for v in rule.neutral)
            suffix = f" (accepted: {accepted})" if accepted else ""
            raise RecipeError(
                400, f"'{path}' is not supported by this server: {rule.why}{suffix}", protocol, path
            )
        if rule.keys is not None and isinstance(value, dict):
            _check(protocol, value, rule.keys, f"{path}.")


def _unknown_message(protocol: Protocol, path: str) -> str:
    """The vendor's words for a field it does not know."""
    if protocol.is_anthropic:
        return f"{path}: Extra inputs are not permitted"
    if "." in path:
        return f"Unknown parameter: '{path}'."
    return f"Unrecognized request argument supplied: {path}"
