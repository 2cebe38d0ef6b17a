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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from engine.structured.grammar import GrammarError, GrammarSpec, spec_for_constraint
from recipe.errors import Protocol, RecipeError

_EXTENSION_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
    "ebnf": "ebnf",
}
_STRUCTURED_OUTPUTS_KEYS = {
    "json": "json",
    "regex": "regex",
    "grammar": "ebnf",
    "choice": "choice",
    "json_object": "json_object",
}
# vLLM options that change how a grammar is built; accepted only at their neutral value.
_STRUCTURED_OUTPUTS_NEUTRAL = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False),
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
    require_tool_call: Messages tool_choice `any` (the package renders it as `auto`).
    """

    extension: OutputConstraint | None = None
    param: str | None = None
    parallel_tool_calls: bool = True
    require_tool_call: bool = False


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
    if constraint is not None and constraint.kind == "tool_call" and options.require_tool_call:
        return OutputConstraint("tool_call_required", constraint.schema)
    return constraint


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
        )
    except GrammarError as exc:
        raise RecipeError(400, str(exc), protocol, options.param) from exc


# ---------------------------------------------------------------- body fields


def pop_chat_extensions(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Take the Chat grammar extensions and `parallel_tool_calls` out of `body`.

    Raises:
        RecipeError: 400 for a malformed extension, or more than one.
    """
    options = ConstraintOptions(parallel_tool_calls=_pop_parallel(body, protocol))
    found: list[tuple[str, OutputConstraint]] = []
    backend = body.pop("guided_decoding_backend", None)
    if backend not in (None, "xgrammar"):
        raise RecipeError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
            protocol,
            "guided_decoding_backend",
        )
    for field, kind in _EXTENSION_FIELDS.items():
        value = body.pop(field, None)
        if value is not None:
            found.append((field, _extension(kind, value, field, protocol)))
    structured = body.pop("structured_outputs", None)
    if structured is not None:
        found.append(("structured_outputs", _structured_outputs(structured, protocol)))
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise RecipeError(400, f"only one grammar may be given, got {names}", protocol)
    if found:
        options.param, options.extension = found[0]
    return options


def pop_responses_options(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Take `parallel_tool_calls` out of a Responses body."""
    return ConstraintOptions(parallel_tool_calls=_pop_parallel(body, protocol))


def messages_options(body: dict[str, Any], protocol: Protocol) -> ConstraintOptions:
    """Read Messages `tool_choice` (`any`, `disable_parallel_tool_use`) and
    `output_config.format`, which the package does not enforce.

    Raises:
        RecipeError: 400 for a malformed `output_config.format`.
    """
    options = ConstraintOptions()
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
