"""Structured output and constrained tool calls over a live server, through the official SDKs.

The `default` model has random weights, so nothing but the grammar makes its answers valid:
every JSON answer must parse and validate with `jsonschema` (formats checked), every regex answer
must match fully, every EBNF answer must parse, every required tool call must carry arguments
valid for its tool. Schemas are bounded (enums, ranges, maxLength, maxItems) so that a random
model finishes them within the token budget. Requests run concurrently so the engine batches
constrained rows together.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

MODEL = "DeepSeek-V4.1-Flash"
MAX_TOKENS = 400
NO_THINKING = {"thinking": {"type": "disabled"}}
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "contact": {"anyOf": [{"type": "string", "format": "uuid"}, {"type": "null"}]},
        "birthday": {"type": "string", "format": "date"},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["NO", "FR", "IT"]},
            },
            "required": ["zip", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "contact", "birthday", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"enum": ["A1", "B2", "C3"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
        "placed": {"type": "string", "format": "date"},
    },
    "required": ["id", "lines", "express", "placed"],
    "additionalProperties": False,
}
EVENT = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "kind": {"const": "meeting"},
                "room": {"type": "string", "format": "ipv4"},
            },
            "required": ["kind", "room"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "kind": {"const": "holiday"},
                "days": {"type": "integer", "minimum": 1, "maximum": 30},
            },
            "required": ["kind", "days"],
            "additionalProperties": False,
        },
    ]
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER_JSON = [{"role": "user", "content": "Answer in JSON."}]


@dataclass
class Answer:
    """What one request produced, whatever the protocol."""

    text: str = ""
    tool_calls: list[tuple[str, Any]] = field(default_factory=list)  # (name, parsed arguments)
    finish: str | None = None


# ---------------------------------------------------------------- one request per protocol


def _chat(oai: openai.OpenAI, stream: bool, **kwargs) -> Answer:
    kwargs = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.8, **kwargs}
    kwargs.setdefault("messages", USER_JSON)
    kwargs["extra_body"] = {**NO_THINKING, **kwargs.get("extra_body", {})}
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []
        ]
        return Answer(choice.message.content or "", calls, choice.finish_reason)
    answer = Answer()
    arguments: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            answer.text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                if call.function and call.function.arguments:
                    arguments.setdefault(call.index, []).append(call.function.arguments)
            answer.finish = choice.finish_reason or answer.finish
    answer.tool_calls = [(names[i], json.loads("".join(arguments.get(i, [])))) for i in names]
    return answer


def _responses(oai: openai.OpenAI, stream: bool, **kwargs) -> Answer:
    kwargs = {
        "model": MODEL,
        "max_output_tokens": MAX_TOKENS,
        "reasoning": {"effort": "none"},
        "input": "Answer in JSON.",
        **kwargs,
    }
    if stream:
        events = list(oai.responses.create(**kwargs, stream=True))
        done = [e for e in events if e.type == "response.completed"]
        assert len(done) == 1
        response = done[0].response
    else:
        response = oai.responses.create(**kwargs)
    calls = [
        (item.name, json.loads(item.arguments))
        for item in response.output
        if item.type == "function_call"
    ]
    return Answer(response.output_text, calls, response.status)


def _messages(claude: anthropic.Anthropic, stream: bool, **kwargs) -> Answer:
    kwargs = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "messages": USER_JSON,
        "thinking": {"type": "disabled"},
        **kwargs,
    }
    if stream:
        with claude.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    text = "".join(block.text for block in message.content if block.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    return Answer(text, calls, message.stop_reason)


def _run_concurrently(jobs: dict[str, Callable[[], Answer]]) -> dict[str, Answer]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def _validate_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


# ---------------------------------------------------------------- tests


@pytest.mark.slow  # 13 concurrent constrained requests, ~13 s
def test_json_schema_answers_validate_in_every_api(oai, claude) -> None:
    def chat_format(schema):
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}

    def text_format(schema):
        return {"format": {"type": "json_schema", "name": "answer", "schema": schema}}

    def output_config(schema):
        return {"format": {"type": "json_schema", "schema": schema}}

    jobs = {}
    for stream in (False, True):
        for name, schema in (("person", PERSON), ("order", ORDER), ("event", EVENT)):
            jobs[f"chat-{name}-{stream}"] = (
                lambda s=stream, sc=schema: _chat(oai, s, response_format=chat_format(sc)),
                schema,
            )
        jobs[f"responses-{stream}"] = (
            lambda s=stream: _responses(oai, s, text=text_format(ORDER)),
            ORDER,
        )
        jobs[f"messages-{stream}"] = (
            lambda s=stream: _messages(claude, s, output_config=output_config(EVENT)),
            EVENT,
        )
    jobs["chat-json-object"] = (
        lambda: _chat(oai, False, response_format={"type": "json_object"}, max_tokens=60),
        {"type": "object"},
    )
    answers = _run_concurrently({name: job for name, (job, _) in jobs.items()})
    for name, (_, schema) in jobs.items():
        answer = answers[name]
        if name == "chat-json-object" and answer.finish == "length":
            continue  # any object may be longer than its budget; the prefix must still be JSON
        assert answer.finish in ("stop", "completed", "end_turn"), (name, answer)
        _validate_json(answer.text, schema)


def test_regex_choice_and_ebnf_answers_match(oai) -> None:
    arithmetic = """
        root ::= expr
        expr ::= term (("+" | "-") term){0,2}
        term ::= factor ("*" factor){0,2}
        factor ::= [1-9] [0-9]{0,2} | "(" expr ")"
    """
    regex = r"(yes|no), [0-9]{2} (cats|dogs)"
    jobs = {
        "format-regex": lambda: _chat(
            oai, False, response_format={"type": "regex", "regex": regex}
        ),
        "structured-regex": lambda: _chat(
            oai, True, extra_body={"structured_outputs": {"regex": regex}}
        ),
        "choice": lambda: _chat(oai, False, extra_body={"guided_choice": ["alpha", "beta gamma"]}),
        "grammar": lambda: _chat(
            oai, False, extra_body={"structured_outputs": {"grammar": arithmetic}}
        ),
        "ebnf": lambda: _chat(oai, True, extra_body={"ebnf": arithmetic}),
    }
    answers = _run_concurrently(jobs)
    for name in ("format-regex", "structured-regex"):
        assert re.fullmatch(regex, answers[name].text), answers[name]
    assert answers["choice"].text in ("alpha", "beta gamma")
    for name in ("grammar", "ebnf"):
        text = answers[name].text
        tree = ast.parse(text, mode="eval")  # the EBNF language is a subset of Python's
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
        assert not re.search(r"\s", text)


def _check_calls(answer: Answer, names: set[str]) -> None:
    assert answer.tool_calls, answer
    for name, arguments in answer.tool_calls:
        assert name in names
        jsonschema.validate(arguments, TOOL_SCHEMAS[name])
    assert "DSML" not in answer.text


@pytest.mark.slow  # 12 concurrent tool calls, ~24 s
def test_required_and_named_tool_calls_validate_in_every_api(oai, claude) -> None:
    chat_tools = [
        {"type": "function", "function": {"name": n, "parameters": s}}
        for n, s in TOOL_SCHEMAS.items()
    ]
    responses_tools = [
        {"type": "function", "name": n, "parameters": s} for n, s in TOOL_SCHEMAS.items()
    ]
    messages_tools = [{"name": n, "input_schema": s} for n, s in TOOL_SCHEMAS.items()]
    weather_only = {"get_weather"}
    jobs: dict[str, tuple[Callable[[], Answer], set[str]]] = {}
    for stream in (False, True):
        jobs[f"chat-required-{stream}"] = (
            lambda s=stream: _chat(oai, s, tools=chat_tools, tool_choice="required"),
            set(TOOL_SCHEMAS),
        )
        jobs[f"chat-named-{stream}"] = (
            lambda s=stream: _chat(
                oai,
                s,
                tools=chat_tools,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False,
            ),
            weather_only,
        )
        jobs[f"responses-required-{stream}"] = (
            lambda s=stream: _responses(oai, s, tools=responses_tools, tool_choice="required"),
            set(TOOL_SCHEMAS),
        )
        jobs[f"responses-named-{stream}"] = (
            lambda s=stream: _responses(
                oai,
                s,
                tools=responses_tools,
                tool_choice={"type": "function", "name": "get_weather"},
                parallel_tool_calls=False,
            ),
            weather_only,
        )
        jobs[f"messages-any-{stream}"] = (
            lambda s=stream: _messages(
                claude, s, tools=messages_tools, tool_choice={"type": "any"}
            ),
            set(TOOL_SCHEMAS),
        )
        jobs[f"messages-named-{stream}"] = (
            lambda s=stream: _messages(
                claude,
                s,
                tools=messages_tools,
                tool_choice={
                    "type": "tool",
                    "name": "get_weather",
                    "disable_parallel_tool_use": True,
                },
            ),
            weather_only,
        )
    answers = _run_concurrently({name: job for name, (job, _) in jobs.items()})
    for name, (_, names) in jobs.items():
        answer = answers[name]
        _check_calls(answer, names)
        assert answer.finish in ("tool_calls", "completed", "tool_use"), (name, answer)
        if "named" in name:
            assert len(answer.tool_calls) == 1, (name, answer)


@pytest.mark.slow  # ~6 s
def test_auto_and_none_never_leak_tool_markup_into_text(oai, claude) -> None:
    chat_tools = [
        {"type": "function", "function": {"name": n, "parameters": s}}
        for n, s in TOOL_SCHEMAS.items()
    ]
    messages_tools = [{"name": n, "input_schema": s} for n, s in TOOL_SCHEMAS.items()]
    jobs = {}
    for i in range(3):
        jobs[f"chat-auto-{i}"] = lambda i=i: _chat(
            oai, i % 2 == 1, tools=chat_tools, max_tokens=40, seed=i, temperature=1.0
        )
        jobs[f"chat-none-{i}"] = lambda i=i: _chat(
            oai, False, tools=chat_tools, tool_choice="none", max_tokens=40, seed=i
        )
    jobs["messages-auto"] = lambda: _messages(claude, True, tools=messages_tools, max_tokens=40)
    for name, answer in _run_concurrently(jobs).items():
        assert "DSML" not in answer.text, (name, answer)
        for tool, arguments in answer.tool_calls:
            assert "none" not in name
            jsonschema.validate(arguments, TOOL_SCHEMAS[tool])


def test_thinking_mode_constrains_the_answer_after_reasoning(oai) -> None:
    # A +100 bias on `</think>` ends the random model's reasoning at once; the JSON grammar
    # then takes over (inside the answer the bias cannot reach the masked `</think>`).
    answer = _chat(
        oai,
        False,
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": EVENT}},
        logit_bias={"128822": 100},
        extra_body={"thinking": {"type": "enabled"}},
    )
    _validate_json(answer.text, EVENT)


def test_invalid_and_pathological_grammars_are_400_while_others_flow(
    oai, claude, default_server
) -> None:
    url, app, _ = default_server
    with pytest.raises(openai.BadRequestError, match="invalid regular expression"):
        _chat(oai, False, response_format={"type": "regex", "regex": "(unclosed"})
    with pytest.raises(anthropic.BadRequestError, match="Unsupported type"):
        _messages(
            claude,
            False,
            output_config={"format": {"type": "json_schema", "schema": {"type": "x"}}},
        )
    timeout = app.state.server.config.grammar_compile_timeout_s
    # Short to send, seconds to compile: counted repetitions inside a JSON-schema pattern.
    pathological_schema = {"type": "string", "pattern": "^([a-z]{1,60}-){1,60}$"}
    results: dict[str, Any] = {}

    def pathological() -> None:
        start = time.monotonic()
        response = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": USER_JSON,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "d", "schema": pathological_schema},
                },
                **NO_THINKING,
            },
            timeout=60,
        )
        results["pathological"] = (response, time.monotonic() - start)

    thread = threading.Thread(target=pathological)
    thread.start()
    time.sleep(0.2)
    # Meanwhile an unconstrained stream and a constrained request are served.
    started = time.monotonic()
    chunks = oai.chat.completions.create(
        model=MODEL, messages=USER_JSON, max_tokens=8, stream=True, extra_body=NO_THINKING
    )
    first_token_s = None
    for chunk in chunks:
        if first_token_s is None and chunk.choices and chunk.choices[0].delta.content:
            first_token_s = time.monotonic() - started
    small = _chat(oai, False, response_format={"type": "regex", "regex": "[ab]{4}"})
    thread.join()
    response, elapsed = results["pathological"]
    assert response.status_code == 400
    assert "exceeded" in response.json()["error"]["message"]
    assert elapsed < timeout + 1.5
    assert first_token_s is not None and first_token_s < timeout
    assert re.fullmatch("[ab]{4}", small.text)


# ---------------------------------------------------------------- issue 12: items 1, 4, 5, 6

THINK_END = "128822"
PLACEHOLDER = "128706"  # <｜place▁holder▁no▁706｜>
THINKING = {"thinking": {"type": "enabled"}}


@pytest.mark.slow  # ~20 s
def test_forced_tool_choice_in_thinking_mode_calls_after_the_reasoning(oai) -> None:
    # Was a 400 ("Thinking mode does not support this tool_choice"). A +100 bias on `</think>`
    # ends the random model's reasoning at once; the grammar then forces the calls block.
    chat_tools = [
        {"type": "function", "function": {"name": n, "parameters": s}}
        for n, s in TOOL_SCHEMAS.items()
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    jobs: dict[str, tuple[Callable[[], Answer], set[str]]] = {}
    for stream in (False, True):
        for seed in range(2):
            common = {"tools": chat_tools, "logit_bias": {THINK_END: 100}, "seed": seed}
            jobs[f"required-{stream}-{seed}"] = (
                lambda s=stream, c=common: _chat(
                    oai, s, tool_choice="required", extra_body=THINKING, **c
                ),
                set(TOOL_SCHEMAS),
            )
            jobs[f"named-{stream}-{seed}"] = (
                lambda s=stream, c=common: _chat(
                    oai, s, tool_choice=named, parallel_tool_calls=False, extra_body=THINKING, **c
                ),
                {"get_weather"},
            )
    answers = _run_concurrently({name: job for name, (job, _) in jobs.items()})
    for name, (_, names) in jobs.items():
        answer = answers[name]
        _check_calls(answer, names)
        assert answer.text == "", (name, answer)
        assert answer.finish == "tool_calls", (name, answer)
        if name.startswith("named"):
            assert len(answer.tool_calls) == 1, (name, answer)


@pytest.mark.slow  # ~15 s
def test_forced_tool_choice_in_thinking_mode_calls_in_responses_and_messages(oai, claude) -> None:
    # Responses `required` / named and Messages `tool` were a 400; Messages `any` was accepted
    # but not enforced after the reasoning. The bias (a `logit_bias` extension here) ends the
    # reasoning; the grammar forces the call.
    responses_tools = [
        {"type": "function", "name": n, "parameters": s} for n, s in TOOL_SCHEMAS.items()
    ]
    messages_tools = [{"name": n, "input_schema": s} for n, s in TOOL_SCHEMAS.items()]
    bias = {"logit_bias": {THINK_END: 100}}
    thinking = {"reasoning": {"effort": "high"}, "extra_body": bias}
    named = {"type": "function", "name": "get_weather"}
    jobs: dict[str, tuple[Callable[[], Answer], set[str]]] = {}
    for stream in (False, True):
        jobs[f"responses-required-{stream}"] = (
            lambda s=stream: _responses(
                oai, s, tools=responses_tools, tool_choice="required", **thinking
            ),
            set(TOOL_SCHEMAS),
        )
        jobs[f"responses-named-{stream}"] = (
            lambda s=stream: _responses(
                oai,
                s,
                tools=responses_tools,
                tool_choice=named,
                parallel_tool_calls=False,
                **thinking,
            ),
            {"get_weather"},
        )
        jobs[f"messages-any-{stream}"] = (
            lambda s=stream: _messages(
                claude,
                s,
                tools=messages_tools,
                tool_choice={"type": "any"},
                thinking={"type": "enabled"},
                extra_body=bias,
            ),
            set(TOOL_SCHEMAS),
        )
        jobs[f"messages-named-{stream}"] = (
            lambda s=stream: _messages(
                claude,
                s,
                tools=messages_tools,
                tool_choice={
                    "type": "tool",
                    "name": "get_weather",
                    "disable_parallel_tool_use": True,
                },
                thinking={"type": "enabled"},
                extra_body=bias,
            ),
            {"get_weather"},
        )
    answers = _run_concurrently({name: job for name, (job, _) in jobs.items()})
    for name, (_, names) in jobs.items():
        answer = answers[name]
        _check_calls(answer, names)
        assert answer.text == "", (name, answer)
        assert answer.finish in ("completed", "tool_use"), (name, answer)
        if "named" in name:
            assert len(answer.tool_calls) == 1, (name, answer)


CITY_LIMITED = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.slow  # ~12 s
def test_strict_tool_string_limit_holds_in_responses_streaming(oai) -> None:
    # The package's strict mode dropped `maxLength` from the grammar: a 400-token city.
    tools = [{"type": "function", "name": "find", "strict": True, "parameters": CITY_LIMITED}]
    jobs = {
        f"{i}": lambda: _responses(oai, True, tools=tools, tool_choice="required") for i in range(3)
    }
    for name, answer in _run_concurrently(jobs).items():
        assert answer.finish == "completed", (name, answer)
        assert answer.tool_calls, (name, answer)  # parallel calls allowed: check each
        for tool, arguments in answer.tool_calls:
            assert tool == "find"
            assert len(arguments["city"]) <= 10, arguments
            jsonschema.validate(arguments, CITY_LIMITED)


@pytest.mark.slow  # ~7 s
def test_special_tokens_never_appear_inside_constrained_output(oai) -> None:
    # A +100 bias makes the placeholder token the model's first choice everywhere; xgrammar
    # alone took its spelling for string content (`{"note": "<｜place▁holder▁no▁706｜>..."}`).
    note = {
        "type": "object",
        "properties": {"note": {"type": "string", "maxLength": 40}},
        "required": ["note"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": note}}
    # (a raw-text DSML string parameter keeps its length limit only in a strict tool, and
    # it costs xgrammar seconds at 40)
    short = {**note, "properties": {"note": {"type": "string", "maxLength": 12}}}
    tools = [
        {"type": "function", "function": {"name": "save", "strict": True, "parameters": short}}
    ]
    bias = {PLACEHOLDER: 100}
    jobs = {
        "format": lambda: _chat(oai, False, response_format=fmt, logit_bias=bias),
        "format-stream": lambda: _chat(oai, True, response_format=fmt, logit_bias=bias),
        "tool": lambda: _chat(oai, False, tools=tools, tool_choice="required", logit_bias=bias),
        "regex": lambda: _chat(
            oai, False, response_format={"type": "regex", "regex": ".{1,20}"}, logit_bias=bias
        ),
    }
    for name, job in jobs.items():  # one at a time: the 2-s compile timeout of the fixture
        answer = job()
        arguments = [args for _, args in answer.tool_calls]
        for value in [answer.text, *(a["note"] for a in arguments)]:
            assert "place▁holder" not in value and "｜" not in value, (name, answer)
        if name.startswith("format"):
            _validate_json(answer.text, note)


def test_unenforced_schema_keywords_are_400_naming_them(oai, claude) -> None:
    unique = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        _chat(
            oai,
            False,
            response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": unique}},
        )
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"not": {}}}}}]
    with pytest.raises(anthropic.BadRequestError, match="'not'"):
        _messages(claude, False, tools=tools)
    with pytest.raises(openai.BadRequestError, match="format 'iri'"):
        _responses(
            oai,
            False,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "i",
                    "schema": {"type": "string", "format": "iri"},
                }
            },
        )


def test_keywords_dropped_in_combination_are_400_naming_keyword_and_path(oai, claude) -> None:
    # xgrammar compiled each of these with one keyword silently dropped.
    zip_code = {"type": "string", "pattern": "^[0-9]+$", "maxLength": 5}
    schema = {"type": "object", "properties": {"zip": zip_code}, "required": ["zip"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "z", "strict": True, "schema": schema}}
    with pytest.raises(openai.BadRequestError) as chat:
        _chat(oai, False, response_format=fmt)
    assert chat.value.body["type"] == "invalid_request_error"
    assert "'maxLength' together with 'pattern' (at /properties/zip)" in chat.value.message
    email = {"type": "string", "format": "email", "minLength": 8}
    text = {
        "format": {"type": "json_schema", "name": "e", "schema": {"type": "array", "items": email}}
    }
    with pytest.raises(
        openai.BadRequestError, match=r"'minLength' together with 'format' \(at /items\)"
    ):
        _responses(oai, True, text=text)
    price = {"type": "number", "multipleOf": 0.25}
    tools = [{"name": "quote", "input_schema": {"type": "object", "properties": {"p": price}}}]
    with pytest.raises(anthropic.BadRequestError) as messages:
        _messages(claude, False, tools=tools, tool_choice={"type": "any"})
    assert messages.value.body["error"]["type"] == "invalid_request_error"
    assert "'multipleOf' (at /properties/p)" in messages.value.message


@pytest.mark.slow  # ~7 s
def test_strict_schemas_with_untyped_enum_or_const_compile(oai) -> None:
    # Was a 400 "one of `type`, `anyOf`, `$ref` field is required" (the package's strict mode).
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "kind": {"const": "trip"},
        },
        "required": ["tags", "kind"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": schema}}
    text = {"format": {"type": "json_schema", "name": "t", "strict": True, "schema": schema}}
    tools = [
        {"type": "function", "function": {"name": "tag", "strict": True, "parameters": schema}}
    ]
    jobs = {
        "chat": lambda: _chat(oai, False, response_format=fmt),
        "responses": lambda: _responses(oai, True, text=text),
        "tool": lambda: _chat(
            oai, True, tools=tools, tool_choice="required", parallel_tool_calls=False
        ),
    }
    answers = _run_concurrently(jobs)
    _validate_json(answers["chat"].text, schema)
    _validate_json(answers["responses"].text, schema)
    [(_, arguments)] = answers["tool"].tool_calls
    jsonschema.validate(arguments, schema)


class Reading(pydantic.BaseModel):
    unit: Literal["c", "f"]
    value: int = pydantic.Field(ge=-50, le=50)
    place: str = pydantic.Field(max_length=12)


def test_parse_with_a_pydantic_model_fits_a_small_budget(oai) -> None:
    # Free whitespace (`{"unit"\n\n\n\t  \n \n :`) and the dropped maxLength made every one of
    # these run out of tokens (LengthFinishReasonError).
    def parse(seed: int) -> Answer:
        completion = oai.chat.completions.parse(
            model=MODEL,
            messages=USER_JSON,
            response_format=Reading,
            max_tokens=60,
            seed=seed,
            extra_body=NO_THINKING,
        )
        assert isinstance(completion.choices[0].message.parsed, Reading)
        return Answer(completion.choices[0].message.content or "")

    answers = _run_concurrently({f"{seed}": lambda s=seed: parse(s) for seed in range(4)})
    for answer in answers.values():
        assert not re.search(r"\s\s", answer.text), answer.text


def test_json_whitespace_any_allows_runs_again(oai) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    bias = {str(token): 30 for token in (201, 271)}  # "\n", "\n\n": whitespace is likelier
    compact = _chat(oai, False, response_format=fmt, logit_bias=bias, max_tokens=60)
    free = _chat(
        oai,
        False,
        response_format=fmt,
        logit_bias=bias,
        max_tokens=60,
        extra_body={"json_whitespace": "any"},
    )
    assert not re.search(r"\s\s", compact.text), compact.text
    _validate_json(compact.text, schema)
    assert re.search(r"\s\s", free.text), free.text
