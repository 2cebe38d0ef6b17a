"""Output constraints of a request -> the `GrammarSpec` the engine enforces (`issues` #5).

Sources, by protocol:

    Chat        response_format json_object / json_schema / regex (the package), tools with
                tool_choice auto / required / named (the package), parallel_tool_calls, and the
                grammar extensions below
    Responses   text.format json_object / json_schema, tools, tool_choice, parallel_tool_calls
    Messages    tools with tool_choice auto / any / tool (+ disable_parallel_tool_use) and
                output_config.format json_schema (both handled here: the package drops them)

Chat grammar extensions (one per request; not combinable with a JSON/regex response_format or
with tools that may be called):

    structured_outputs: {"json": schema | "...", "regex": "...", "grammar": "<EBNF>",
                         "choice": ["a", "b"], "json_object": true}      (vLLM)
    guided_json / guided_regex / guided_grammar / guided_choice          (vLLM, older)
    ebnf: "<EBNF>"                                                       (SGLang)

EBNF is xgrammar's dialect (GBNF-like, a `root` rule). Tool calls with tool_choice `none` (or no
tools) get no grammar; the DSML marker token is banned instead, so no tool markup can appear.

Also handled here, before the package sees the body:

    strict schemas     Chat / Responses tools and json_schema formats with `strict: true` are
                       normalised here (`strict_schema`), not by the package, whose strict mode
                       silently drops keywords (`maxLength`, `minItems`, `const`...) and refuses
                       `enum` without `type`; every keyword left is enforced or refused (400)
    json_whitespace    "compact" (default: at most one whitespace character between JSON
                       tokens) or "any" (runs up to 16), for JSON answers and tool arguments;
                       also Chat `structured_outputs.disable_any_whitespace` (vLLM)
    forced tool_choice in thinking mode (Chat/Responses `required` / named, Messages `tool`),
                       which the package refuses: `relaxed_tool_choice` gives the body to
                       convert instead (tool_choice auto, only the named tool) and the grammar
                       requires the call after the reasoning (Messages `any` likewise)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as dr

from engine.structured.formats import with_inferred_types
from engine.structured.grammar import (
    JSON_COMPACT_WHITESPACE,
    JSON_MAX_WHITESPACE,
    GrammarError,
    GrammarSpec,
    spec_for_constraint,
)
from recipe.errors import Protocol, RecipeError

_EXTENSION_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
    "ebnf": "ebnf",
}
_JSON_WHITESPACE = {"compact": JSON_COMPACT_WHITESPACE, "any": JSON_MAX_WHITESPACE}
_STRUCTURED_OUTPUTS_KEYS = {
    "json": "json",
    "regex": "regex",
    "grammar": "ebnf",
    "choice": "choice",
    "json_object": "json_object",
}
# vLLM options that change how a grammar is built; accepted only at their neutral value
# (`disable_any_whitespace` is read as a whitespace choice in `pop_chat_extensions`).
_STRUCTURED_OUTPUTS_NEUTRAL = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False, True),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


@dataclass(frozen=True)
class OutputConstraint:
    """What constrained decoding enforces (`recipe.md` §5.4): kind `json` | `regex` | `ebnf` |
    `tool_call` | `tool_call_required`, and the schema ("" = any JSON object) / pattern /
    grammar / tool list (compact JSON array of Chat-style tools)."""

    kind: str
    schema: str


@dataclass
class ConstraintOptions:
    """What the per-protocol preprocessing found about constraints in the body.

    extension: a Chat grammar extension or Messages output_config.format (`param` names the
    field for errors); parallel_tool_calls: False allows one tool call at most;
    require_tool_call: Messages tool_choice `any` (the package renders it as `auto`), or a
    forced choice converted as `auto` in thinking mode (`relaxed_tool_choice`);
    json_whitespace: longest whitespace run between JSON tokens; strict_tools: names of the
    tools marked `strict: true` (normalised here; the grammar keeps all their bounds).
    """

    extension: OutputConstraint | None = None
    param: str | None = None
    parallel_tool_calls: bool = True
    require_tool_call: bool = False
    json_whitespace: int = JSON_COMPACT_WHITESPACE
    strict_tools: set[str] = field(default_factory=set)


def effective_constraint(
    native: dr.OutputConstraint | None, options: ConstraintOptions, protocol: Protocol
) -> OutputConstraint | None:
    """The one constraint of a request: the package's, an extension's, or None.

    Raises:
        RecipeError: 400 when an extension is combined with a package constraint.
    """
    constraint = None if native is None else OutputConstraint(native.kind, native.schema)
    if options.extension is not None:
        if constraint is not None:
            raise RecipeError(
                400,
                f"'{options.param}' cannot be combined with a json/regex response format or "
                "with tools that may be called",
                protocol,
                options.param,
            )
        return options.extension
    if constraint is not None and constraint.kind.startswith("tool_call") and options.strict_tools:
        constraint = OutputConstraint(constraint.kind, _marked_strict(constraint.schema, options))
    if constraint is not None and constraint.kind == "tool_call" and options.require_tool_call:
        return OutputConstraint("tool_call_required", constraint.schema)
    return constraint


def _marked_strict(tools_json: str, options: ConstraintOptions) -> str:
    """The package's tool list with `"strict": true` back on the tools normalised here."""
    tools = json.loads(tools_json)
    for tool in tools:
        function = tool.get("function", {})
        if function.get("name") in options.strict_tools:
            function["strict"] = True
    return _compact(tools)


def grammar_spec(
    constraint: OutputConstraint | None,
    conversation: dr.Conversation,
    parsing: dr.ParsingOptions,
    options: ConstraintOptions,
    protocol: Protocol,
) -> GrammarSpec | None:
    """The grammar enforcing `constraint` for output parsed with `parsing`.

    The grammar starts inside reasoning when the output does (`thinking_initial_stage` is a
    reasoning stage) and after the prefilled calls block when the prompt ends in one.

    Raises:
        RecipeError: 400 naming the problem (e.g. a tool list xgrammar rejects, or an answer
            format for the continuation of a partial answer).
    """
    if constraint is None:
        return None
    stage = parsing.thinking_initial_stage
    messages = conversation.messages
    is_prefix = bool(messages) and messages[-1].role == "assistant" and messages[-1].prefix
    continues_content = is_prefix and stage != dr.ThinkingInitialStage.ReasoningContinuation
    if continues_content and constraint.kind in ("json", "regex", "ebnf"):
        raise RecipeError(
            400,
            "a JSON, regex or grammar constraint cannot continue a partial assistant answer "
            "(prefix continuation): the whole answer must follow it",
            protocol,
            options.param,
        )
    thinking = stage is not None and not continues_content
    try:
        return spec_for_constraint(
            constraint.kind,
            constraint.schema,
            thinking=thinking,
            parallel_tool_calls=options.parallel_tool_calls,
            starts_in_tool_calls=parsing.starts_in_tool_calls,
            json_whitespace=options.json_whitespace,
        )
    except GrammarError as exc:
        raise RecipeError(400, str(exc), protocol, options.param) from exc


# ---------------------------------------------------------------- body fields


def pop_chat_extensions(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Take the Chat grammar extensions and `parallel_tool_calls` out of `body`.

    Raises:
        RecipeError: 400 for a malformed extension, or more than one.
    """
    options = ConstraintOptions(
        parallel_tool_calls=_pop_parallel(body, protocol),
        json_whitespace=_pop_json_whitespace(body, protocol),
    )
    options.strict_tools = _normalize_chat_strict(body, protocol)
    found: list[tuple[str, OutputConstraint]] = []
    backend = body.pop("guided_decoding_backend", None)
    if backend not in (None, "xgrammar"):
        raise RecipeError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
            protocol,
            "guided_decoding_backend",
        )
    for name, kind in _EXTENSION_FIELDS.items():
        value = body.pop(name, None)
        if value is not None:
            found.append((name, _extension(kind, value, name, protocol)))
    structured = body.pop("structured_outputs", None)
    if structured is not None:
        found.append(("structured_outputs", _structured_outputs(structured, protocol)))
        if structured.get("disable_any_whitespace") is False:
            options.json_whitespace = JSON_MAX_WHITESPACE
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise RecipeError(400, f"only one grammar may be given, got {names}", protocol)
    if found:
        options.param, options.extension = found[0]
    return options


def pop_responses_options(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Take `parallel_tool_calls` and `json_whitespace` out of a Responses body and normalise
    its strict schemas (`strict_schema`).

    Raises:
        RecipeError: 400 for a malformed option or a strict schema that breaks strict rules.
    """
    options = ConstraintOptions(
        parallel_tool_calls=_pop_parallel(body, protocol),
        json_whitespace=_pop_json_whitespace(body, protocol),
    )
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        is_function = isinstance(tool, dict) and tool.get("type") == "function"
        if is_function and _normalize_strict_in(
            tool, "parameters", f"tools[{i}].parameters", protocol
        ):
            options.strict_tools.add(tool.get("name"))
    text = body.get("text")
    output_format = text.get("format") if isinstance(text, dict) else None
    if isinstance(output_format, dict) and output_format.get("type") == "json_schema":
        _normalize_strict_in(output_format, "schema", "text.format.schema", protocol)
    return options


def messages_options(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Read Messages `tool_choice` (`any`, `disable_parallel_tool_use`) and
    `output_config.format`, which the package does not enforce.

    Raises:
        RecipeError: 400 for a malformed `output_config.format`.
    """
    options = ConstraintOptions(json_whitespace=_pop_json_whitespace(body, protocol))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None and not isinstance(disable, bool):
            raise RecipeError(
                400,
                "tool_choice.disable_parallel_tool_use: must be a boolean",
                protocol,
                "tool_choice",
            )
        options.parallel_tool_calls = not disable
        options.require_tool_call = choice.get("type") == "any"
    config = body.get("output_config")
    output_format = config.get("format") if isinstance(config, dict) else None
    if output_format is not None:
        param = "output_config.format"
        if (
            not isinstance(output_format, dict)
            or output_format.get("type") != "json_schema"
            or not isinstance(output_format.get("schema"), dict)
        ):
            raise RecipeError(
                400,
                f'{param}: expected {{"type": "json_schema", "schema": {{...}}}}',
                protocol,
                param,
            )
        options.extension = OutputConstraint("json", _compact(output_format["schema"]))
        options.param = param
    return options


def relaxed_tool_choice(body: dict[str, Any], protocol: Protocol) -> dict[str, Any] | None:
    """For a body with a forced tool_choice (Chat / Responses `required` or a named function,
    Messages `tool`): a copy with tool_choice `auto` and, for a named choice, only that tool;
    None for any other body (or a named tool that is not declared: the package's error
    stands).

    The package refuses a forced choice in thinking mode. Converted this way, the prompt is what
    the package renders for the choice it allows (thinking header, the named tool only, as it
    keeps for a named choice outside thinking mode); the caller then requires the call in the
    grammar (`ConstraintOptions.require_tool_call`), so the model reasons freely and the calls
    block follows `</think>`.
    """
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if not isinstance(tools, list):
        return None
    named = _forced_tool_name(choice, protocol)
    if named is None:
        return None
    relaxed = dict(body)
    if protocol is Protocol.MESSAGES:
        relaxed["tool_choice"] = {**choice, "type": "auto"}
        relaxed["tool_choice"].pop("name", None)
    else:
        relaxed["tool_choice"] = "auto"
    if named:
        kept = [tool for tool in tools if _tool_name(tool, protocol) == named]
        if not kept:
            return None
        relaxed["tools"] = kept
    return relaxed


def _forced_tool_name(choice: Any, protocol: Protocol) -> str | None:
    """ "" for `required`, the tool's name for a named choice, None when not forced."""
    if protocol is not Protocol.MESSAGES and choice == "required":
        return ""
    if not isinstance(choice, dict):
        return None
    if protocol is Protocol.MESSAGES:
        name = choice.get("name") if choice.get("type") == "tool" else None
    elif protocol is Protocol.CHAT:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        name = name if choice.get("type") == "function" else None
    else:
        name = choice.get("name") if choice.get("type") == "function" else None
    return name if isinstance(name, str) and name else None


def _tool_name(tool: Any, protocol: Protocol) -> Any:
    if not isinstance(tool, dict):
        return None
    if protocol is Protocol.CHAT:
        function = tool.get("function")
        return function.get("name") if isinstance(function, dict) else None
    return tool.get("name")


# ---------------------------------------------------------------- strict schemas


def strict_schema(schema: Any, param: str, protocol: Protocol) -> Any:
    """`schema` normalised as strict mode requires (`recipe.md` §2.3, the package's rules): every
    object schema gets `"additionalProperties": false, "required": [all its properties]` as its
    last keys, and `enum` / `const` schemas without a `type` get one (`with_inferred_types`).
    Unlike the package, every other keyword is kept (and so enforced, or refused when compiled).

    Raises:
        RecipeError: 400 for a partial `required` or a non-false `additionalProperties`.
    """
    return _strict_object(with_inferred_types(schema), param, protocol)


def _strict_object(schema: Any, param: str, protocol: Protocol) -> Any:
    if isinstance(schema, list):
        return [_strict_object(item, param, protocol) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            result[key] = {name: _strict_object(s, param, protocol) for name, s in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems"):
            result[key] = _strict_object(value, param, protocol)
    properties = result.get("properties")
    if result.get("type") != "object" and not isinstance(properties, dict):
        return result
    names = list(properties) if isinstance(properties, dict) else []
    extra = result.pop("additionalProperties", False)
    if extra is not False:
        raise RecipeError(
            400,
            f"{param}: additionalProperties should not be true (strict mode requires false)",
            protocol,
            param,
        )
    required = result.pop("required", names)
    if not isinstance(required, list) or sorted(map(str, required)) != sorted(names):
        raise RecipeError(
            400,
            f"{param}: Required properties must match all properties in the object (strict mode)",
            protocol,
            param,
        )
    result["additionalProperties"] = False
    result["required"] = names
    return result


def _normalize_strict_in(holder: dict[str, Any], key: str, param: str, protocol: Protocol) -> bool:
    """If `holder` is marked `strict: true`, normalise `holder[key]` (`strict_schema`) and drop
    the mark so that the package renders and constrains the normalised schema as it is.
    Returns whether it did."""
    if holder.get("strict") is not True or not isinstance(holder.get(key), dict):
        return False
    holder[key] = strict_schema(holder[key], param, protocol)
    del holder["strict"]
    return True


def _normalize_chat_strict(body: dict[str, Any], protocol: Protocol) -> set[str]:
    """Normalise the strict schemas of a Chat body; returns the names of the strict tools."""
    strict_tools = set()
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            param = f"tools[{i}].function.parameters"
            if _normalize_strict_in(function, "parameters", param, protocol):
                strict_tools.add(function.get("name"))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        json_schema = response_format.get("json_schema")
        if isinstance(json_schema, dict):
            param = "response_format.json_schema.schema"
            _normalize_strict_in(json_schema, "schema", param, protocol)
    return strict_tools


def _pop_json_whitespace(body: dict[str, Any], protocol: Protocol) -> int:
    value = body.pop("json_whitespace", None)
    if value is None:
        return JSON_COMPACT_WHITESPACE
    if value not in _JSON_WHITESPACE:
        raise RecipeError(
            400,
            f'json_whitespace: expected "compact" or "any", got {json.dumps(value)}',
            protocol,
            "json_whitespace",
        )
    return _JSON_WHITESPACE[value]


def _pop_parallel(body: dict[str, Any], protocol: Protocol) -> bool:
    value = body.pop("parallel_tool_calls", None)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RecipeError(
            400, "parallel_tool_calls: must be a boolean", protocol, "parallel_tool_calls"
        )
    return value


def _structured_outputs(value: Any, protocol: Protocol) -> OutputConstraint:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise RecipeError(400, f"{param}: must be an object", protocol, param)
    for key, neutral in _STRUCTURED_OUTPUTS_NEUTRAL.items():
        if value.get(key) not in neutral:
            raise RecipeError(
                400, f"{param}.{key}: {json.dumps(value[key])} is not supported", protocol, param
            )
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS) - set(_STRUCTURED_OUTPUTS_NEUTRAL))
    if unknown:
        raise RecipeError(400, f"{param}: unknown field '{unknown[0]}'", protocol, param)
    given = [
        (key, kind)
        for key, kind in _STRUCTURED_OUTPUTS_KEYS.items()
        if value.get(key) not in (None, False)
    ]
    if len(given) != 1:
        keys = ", ".join(_STRUCTURED_OUTPUTS_KEYS)
        raise RecipeError(400, f"{param}: set exactly one of {keys}", protocol, param)
    key, kind = given[0]
    if kind == "json_object":
        if value[key] is not True:
            raise RecipeError(400, f"{param}.json_object: must be true", protocol, param)
        return OutputConstraint("json", "")
    return _extension(kind, value[key], f"{param}.{key}", protocol)


def _extension(kind: str, value: Any, param: str, protocol: Protocol) -> OutputConstraint:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise RecipeError(
                    400, f"{param}: not a valid JSON schema ({exc})", protocol, param
                ) from exc
        if not isinstance(value, dict | bool):
            raise RecipeError(400, f"{param}: a JSON schema must be an object", protocol, param)
        return OutputConstraint("json", _compact(value))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise RecipeError(
                400, f"{param}: must be a non-empty list of non-empty strings", protocol, param
            )
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return OutputConstraint("ebnf", f"root ::= {alternatives}")
    if not isinstance(value, str) or not value:
        raise RecipeError(400, f"{param}: must be a non-empty string", protocol, param)
    return OutputConstraint(kind, value)


def _compact(schema: Any) -> str:
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
