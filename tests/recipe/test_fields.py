"""The field tables (`recipe/fields.py`): unknown fields are a 400 in the vendor's words, every
IMPLEMENTED field changes what the request does, METADATA fields change nothing, UNSUPPORTED
fields are a 400 except at their neutral values."""

from __future__ import annotations

from typing import Any

import pytest

from recipe import Protocol, Recipe, RecipeError
from recipe.fields import FIELDS, FieldClass

JSON_MSG = [{"role": "user", "content": "Answer in json"}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
]
RESPONSES_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
MESSAGES_TOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
BASES: dict[Protocol, dict[str, Any]] = {
    Protocol.CHAT: {"model": "default", "messages": JSON_MSG},
    Protocol.RESPONSES: {"model": "default", "input": "Answer in json"},
    Protocol.MESSAGES: {"model": "default", "messages": JSON_MSG, "max_tokens": 64},
}
JSON_FORMAT = {"type": "json_schema", "schema": {"type": "object"}}
CHAT_OFF = {"thinking": {"type": "disabled"}}
RESPONSES_OFF = {"reasoning": {"effort": "none"}}
MESSAGES_ON = {"thinking": {"type": "enabled"}}

# For every IMPLEMENTED field: (value, extra base fields) such that the request does something
# else with the field set to value than without it, or than with the base's own value of it (or
# answers 400, for fields accepted only at the value that asks for nothing).
EFFECTS: dict[Protocol, dict[str, tuple[Any, dict[str, Any]]]] = {
    Protocol.CHAT: {
        "model": ("other", {}),
        "messages": ([{"role": "user", "content": "other"}], {}),
        "stream": (True, {}),
        "stream_options": ({"include_usage": True}, {"stream": True}),
        "max_tokens": (7, {}),
        "max_completion_tokens": (9, {}),
        "temperature": (0.5, CHAT_OFF),
        "top_p": (0.97, {}),
        "seed": (5, {}),
        "stop": ("x", {}),
        "n": (2, {}),
        "presence_penalty": (1.0, {}),
        "frequency_penalty": (1.0, {}),
        "logprobs": (True, {}),
        "top_logprobs": (3, {"logprobs": True}),
        "reasoning_effort": ("low", {}),
        "response_format": ({"type": "json_object"}, {}),
        "tools": (CHAT_TOOLS, {}),
        "tool_choice": ("none", {"tools": CHAT_TOOLS}),
        "parallel_tool_calls": (False, {"tools": CHAT_TOOLS}),
        "prompt_cache_key": ("key", {}),
        "store": (True, {}),
        "service_tier": ("flex", {}),
        "cache_salt": ("salt", {}),
        "traffic_class": ("agent", {}),
        "logit_bias": ({"5": 1}, {}),
        "thinking": ({"type": "disabled"}, {}),
        "top_k": (5, {}),
        "min_p": (0.1, {}),
        "repetition_penalty": (1.2, {}),
        "ignore_eos": (True, {}),
        "min_tokens": (3, {}),
        "chat_template_kwargs": ({"thinking": False}, {}),
        "structured_outputs": ({"regex": "a+"}, {}),
        "guided_json": ({"type": "object"}, {}),
        "guided_regex": ("a+", {}),
        "guided_grammar": ('root ::= "a"', {}),
        "guided_choice": (["a", "b"], {}),
        "guided_decoding_backend": ("outlines", {}),
        "ebnf": ('root ::= "a"', {}),
        "json_whitespace": ("any", {"response_format": {"type": "json_object"}}),
    },
    Protocol.RESPONSES: {
        "model": ("other", {}),
        "input": ("other", {}),
        "instructions": ("be terse", {}),
        "stream": (True, {}),
        "stream_options": ({"include_obfuscation": True}, {"stream": True}),
        "max_output_tokens": (7, {}),
        "temperature": (0.5, RESPONSES_OFF),
        "top_p": (0.97, {}),
        "top_logprobs": (3, {}),
        "reasoning": ({"effort": "low"}, {}),
        "text": ({"format": {"type": "json_object"}}, {}),
        "tools": (RESPONSES_TOOLS, {}),
        "tool_choice": ("none", {"tools": RESPONSES_TOOLS}),
        "parallel_tool_calls": (False, {"tools": RESPONSES_TOOLS}),
        "include": (["reasoning.encrypted_content"], {}),
        "prompt_cache_key": ("key", {}),
        "store": (True, {}),
        "background": (True, {}),
        "previous_response_id": ("resp_1", {}),
        "truncation": ("auto", {}),
        "metadata": ({"k": "v"}, {}),
        "cache_salt": ("salt", {}),
        "traffic_class": ("agent", {}),
        "logit_bias": ({"5": 1}, {}),
        "thinking": ({"type": "disabled"}, {}),
        "top_k": (5, {}),
        "min_p": (0.1, {}),
        "repetition_penalty": (1.2, {}),
        "ignore_eos": (True, {}),
        "min_tokens": (3, {}),
        "seed": (3, {}),
        "stop": ("x", {}),
        "json_whitespace": ("any", {"text": {"format": {"type": "json_object"}}}),
    },
    Protocol.MESSAGES: {
        "model": ("other", {}),
        "messages": ([{"role": "user", "content": "other"}], {}),
        "system": ("be terse", {}),
        "max_tokens": (7, {}),
        "stream": (True, {}),
        "temperature": (0.5, {"thinking": {"type": "disabled"}}),
        "top_p": (0.5, MESSAGES_ON),
        "top_k": (5, {}),
        "stop_sequences": (["x"], {}),
        "tools": (MESSAGES_TOOLS, {}),
        "tool_choice": ({"type": "any"}, {"tools": MESSAGES_TOOLS}),
        "thinking": ({"type": "enabled"}, {"thinking": {"type": "disabled"}}),
        "output_config": ({"effort": "low"}, MESSAGES_ON),
        "context_management": ({"edits": [{"type": "clear_tool_uses_20250919"}]}, {}),
        "cache_salt": ("salt", {}),
        "traffic_class": ("agent", {}),
        "logit_bias": ({"5": 1}, {}),
        "json_whitespace": ("any", {"output_config": {"format": JSON_FORMAT}}),
    },
}

METADATA_VALUES: dict[str, Any] = {
    "metadata": {"user_id": "u-1"},
    "user": "u-1",
    "safety_identifier": "u-1",
    "client_metadata": {"turn_id": "t-1"},
    "max_tool_calls": 2,
    "cache_control": {"type": "ephemeral"},
}


def snapshot(prepared) -> dict[str, Any]:
    """What a request does: prompt, sampling, parsing, grammar, echo and routing keys."""
    parsing = prepared.parsing_options
    echo = prepared.echo
    return {
        "prompt": prepared.prompt_token_ids,
        "sampling": prepared.sampling_params,
        "parsing": (
            parsing.parse_tool_calls,
            parsing.starts_in_tool_calls,
            parsing.parse_json_output,
            str(parsing.thinking_initial_stage),
            list(parsing.stop_sequences),
        ),
        "stream": (prepared.stream, prepared.include_usage),
        "grammar": prepared.grammar,
        "constraint": prepared.output_constraint,
        "echo": None
        if echo is None
        else {k: repr(getattr(echo, k)) for k in dir(echo) if not k.startswith("_")},
        "keys": (prepared.cache_salt, prepared.prompt_cache_key, prepared.reasoning_sealer),
        "traffic_class": prepared.traffic_class,
    }


def classified(kind: FieldClass) -> list[tuple[Protocol, str]]:
    return [
        (protocol, name)
        for protocol, table in FIELDS.items()
        for name, rule in table.items()
        if rule.kind is kind
    ]


def _implemented_params() -> list:
    return [
        pytest.param(protocol, name, id=f"{protocol.value}-{name}")
        for protocol, name in classified(FieldClass.IMPLEMENTED)
    ]


@pytest.mark.parametrize(("protocol", "name"), _implemented_params())
def test_implemented_field_changes_the_request(recipe: Recipe, protocol, name) -> None:
    value, extra = EFFECTS[protocol][name]
    base = {**BASES[protocol], **extra}
    before = snapshot(recipe.prepare(protocol, base))
    try:
        after = snapshot(recipe.prepare(protocol, {**base, name: value}))
    except RecipeError as exc:  # a value asking for what the server does not do
        assert exc.status_code == 400
        return
    assert after != before, f"{name}={value!r} changed nothing"


def test_every_effect_probe_names_an_implemented_field() -> None:
    for protocol, effects in EFFECTS.items():
        for name in effects:
            assert FIELDS[protocol][name].kind is FieldClass.IMPLEMENTED, (protocol, name)


@pytest.mark.parametrize(("protocol", "name"), classified(FieldClass.METADATA))
def test_metadata_field_changes_nothing(recipe: Recipe, protocol, name) -> None:
    base = BASES[protocol]
    before = snapshot(recipe.prepare(protocol, base))
    after = snapshot(recipe.prepare(protocol, {**base, name: METADATA_VALUES[name]}))
    if name == "user":  # Responses echoes it; nothing else reads it
        before["echo"] = after["echo"] = None
    assert after == before


@pytest.mark.parametrize(("protocol", "name"), classified(FieldClass.UNSUPPORTED))
def test_unsupported_field_is_a_400_except_at_neutral_values(
    recipe: Recipe, protocol, name
) -> None:
    rule = FIELDS[protocol][name]
    body = BASES[protocol]
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(protocol, {**body, name: "something-else"})
    assert caught.value.status_code == 400
    assert caught.value.message.startswith(f"'{name}' is not supported by this server: ")
    assert caught.value.param == name
    for value in (None, *rule.neutral):
        recipe.prepare(protocol, {**body, name: value})


UNKNOWN = [
    (Protocol.CHAT, "foo", "Unrecognized request argument supplied: foo"),
    (Protocol.RESPONSES, "foo", "Unrecognized request argument supplied: foo"),
    (Protocol.MESSAGES, "foo", "foo: Extra inputs are not permitted"),
    (Protocol.MESSAGES, "seed", "seed: Extra inputs are not permitted"),
    (Protocol.RESPONSES, "n", "Unrecognized request argument supplied: n"),
]


@pytest.mark.parametrize(("protocol", "name", "message"), UNKNOWN)
def test_unknown_field_is_a_400_in_the_vendors_words(
    recipe: Recipe, protocol, name, message
) -> None:
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(protocol, {**BASES[protocol], name: 1})
    error = caught.value
    assert (error.status_code, error.message, error.param) == (400, message, name)
    body = error.body()
    if protocol is Protocol.MESSAGES:
        assert body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"] == message


NESTED = [
    (
        Protocol.RESPONSES,
        {"stream": True, "stream_options": {"include_usage": True}},
        "Unknown parameter: 'stream_options.include_usage'.",
    ),
    (Protocol.RESPONSES, {"reasoning": {"effrt": "low"}}, "Unknown parameter: 'reasoning.effrt'."),
    (Protocol.RESPONSES, {"text": {"fmt": {}}}, "Unknown parameter: 'text.fmt'."),
    (
        Protocol.CHAT,
        {"stream": True, "stream_options": {"usage": True}},
        "Unknown parameter: 'stream_options.usage'.",
    ),
    (
        Protocol.MESSAGES,
        {"metadata": {"user": "u"}},
        "metadata.user: Extra inputs are not permitted",
    ),
    (
        Protocol.MESSAGES,
        {"output_config": {"effrt": "low"}},
        "output_config.effrt: Extra inputs are not permitted",
    ),
]


@pytest.mark.parametrize(("protocol", "fields", "message"), NESTED)
def test_unknown_key_of_a_checked_object_is_a_400(recipe: Recipe, protocol, fields, message):
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(protocol, {**BASES[protocol], **fields})
    assert (caught.value.status_code, caught.value.message) == (400, message)


def test_unsupported_nested_key_names_its_path(recipe: Recipe) -> None:
    body = {**BASES[Protocol.RESPONSES], "text": {"verbosity": "low"}}
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(Protocol.RESPONSES, body)
    assert caught.value.param == "text.verbosity"
    body["text"] = {"verbosity": "medium"}  # what the model does anyway
    recipe.prepare(Protocol.RESPONSES, body)


def test_null_fields_are_absent(recipe: Recipe) -> None:
    """SDKs send `null` for unset options; an unknown name is still unknown."""
    body = {**BASES[Protocol.CHAT], "audio": None, "verbosity": None, "user": None}
    recipe.prepare(Protocol.CHAT, body)
    with pytest.raises(RecipeError):
        recipe.prepare(Protocol.CHAT, {**body, "foo": None})


def test_sampling_extensions_reach_the_sampling_params(recipe: Recipe) -> None:
    for protocol in (Protocol.CHAT, Protocol.RESPONSES):
        body = {
            **BASES[protocol],
            "top_k": -1,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 2,
        }
        params = recipe.prepare(protocol, body).sampling_params
        assert (params.top_k, params.min_p, params.repetition_penalty) == (0, 0.05, 1.1)
        assert (params.ignore_eos, params.min_tokens) == (True, 2)
    params = recipe.prepare(Protocol.RESPONSES, {**BASES[Protocol.RESPONSES], "seed": 11})
    assert params.sampling_params.seed == 11
    chat = recipe.prepare(Protocol.CHAT, {**BASES[Protocol.CHAT], "prompt_cache_key": "s1"})
    assert chat.sampling_params.affinity_key == "s1"
    assert chat.prompt_cache_key is None  # echoed by Responses only


@pytest.mark.parametrize(
    ("protocol", "fields", "param"),
    [
        (Protocol.RESPONSES, {"seed": -1}, "seed"),
        (Protocol.RESPONSES, {"seed": "1"}, "seed"),
        (Protocol.CHAT, {"top_k": 1.5}, "top_k"),
        (Protocol.CHAT, {"ignore_eos": 1}, "ignore_eos"),
        (Protocol.CHAT, {"min_p": 2.0}, None),  # the range is SamplingParams'
        (Protocol.CHAT, {"ignore_eos": True, "response_format": {"type": "json_object"}}, None),
        (Protocol.CHAT, {"prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_bad_sampling_extension_is_a_400(recipe: Recipe, protocol, fields, param) -> None:
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(protocol, {**BASES[protocol], **fields})
    assert caught.value.status_code == 400
    if param is not None:
        assert caught.value.param == param


def test_ignore_eos_with_a_grammar_names_the_field(recipe: Recipe) -> None:
    body = {**BASES[Protocol.CHAT], "ignore_eos": True, "response_format": {"type": "json_object"}}
    with pytest.raises(RecipeError) as caught:
        recipe.prepare(Protocol.CHAT, body)
    assert caught.value.param == "ignore_eos"
