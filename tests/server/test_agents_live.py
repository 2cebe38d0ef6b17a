"""Coding agents' request shapes through the live `default` server (issue 14).

The bodies replay the fields Codex CLI 0.171 (Responses) and Claude Code 2.1 (Messages) send,
with synthetic texts and tools. The model has random weights: the tests check protocol
behaviour (statuses, items, sealed reasoning, echoes, usage), never the meaning of the text.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine.structured import DSML_MARKER
from recipe.errors import Protocol

MODEL = "DeepSeek-V4.1-Flash"
CODEX_HEADERS = {
    "accept": "text/event-stream",
    "accept-encoding": "zstd,gzip",
    "originator": "codex_exec",
    "session-id": "thread-1",
}
CODEX_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a shell command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "string", "description": "The command."},
                "yield_time_ms": {"type": "number"},
            },
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {
        "type": "namespace",
        "name": "agents_v1",
        "description": "Sub agents.",
        "tools": [
            {
                "type": "function",
                "name": "wait_agent",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"targets": {"type": "array", "items": {"type": "string"}}},
                    "required": ["targets"],
                    "additionalProperties": False,
                },
            }
        ],
    },
    {
        "type": "function",
        "name": "get_goal",
        "description": "The current goal.",
        "strict": False,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
    {"type": "web_search", "external_web_access": False},
]
DEVELOPER = {
    "type": "message",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a test agent. Be brief."}],
}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}


def codex_body(input_items: list[dict], **overrides: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "stream": True,
        "input": input_items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "turn-1", "session_id": "thread-1"},
        "max_output_tokens": 6,
    }
    return {**body, **overrides}


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def _done_items(events: list[tuple[str, dict]]) -> list[dict]:
    return [data["item"] for name, data in events if name == "response.output_item.done"]


def test_root_answers_head_and_get(default_server) -> None:
    url = default_server[0]
    assert httpx.head(url + "/").status_code == 200
    about = httpx.get(url + "/").json()
    assert about["name"] == "deepinfer-server" and about["version"]
    assert about["models"] == [MODEL] and "POST /v1/messages" in about["routes"]


def test_the_tool_call_guard_is_ready_before_the_first_request(default_server) -> None:
    # Computing it reads the whole vocabulary (~0.5 s holding the interpreter lock): done at
    # start, not on the event loop under the first tool-constrained request.
    app = default_server[1]
    assert DSML_MARKER in app.state.server.grammar_compiler.prepared_markers


def test_codex_two_turns_with_sealed_reasoning_and_a_function_call(default_server, oai) -> None:
    url, app, _ = default_server
    recipe = app.state.server.recipe
    # Turn 1, streamed the way Codex asks for it (zstd accepted, plain SSE comes back).
    with httpx.stream(
        "POST",
        url + "/v1/responses",
        json=codex_body([DEVELOPER, USER]),
        headers=CODEX_HEADERS,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers.get("content-encoding") is None
        events = sse_events(response)
    final = events[-1][1]["response"]
    assert events[-1][0] in ("response.completed", "response.incomplete")
    assert final["prompt_cache_key"] == "thread-1" and final["reasoning"]["summary"] == "auto"
    assert events[0][1]["response"]["prompt_cache_key"] == "thread-1"
    reasoning = [item for item in _done_items(events) if item["type"] == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0]["summary"] == []
    sealed = reasoning[0]["encrypted_content"]
    thought = "".join(part["text"] for part in reasoning[0]["content"])
    assert isinstance(sealed, str) and thought and thought not in sealed
    assert final["output"][0]["encrypted_content"]  # the completed response carries it too
    # Turn 2: Codex sends the reasoning back without its text, then the call and its output.
    returned = {"type": "reasoning", "id": reasoning[0]["id"], "summary": [], "content": None}
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "exec_command",
        "arguments": '{"cmd": "ls"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\n"}
    turn_two = [DEVELOPER, USER, {**returned, "encrypted_content": sealed}, call, output]
    body = codex_body(turn_two, stream=False)
    spec = recipe.prepare(Protocol.RESPONSES, body).grammar
    assert app.state.server.grammar_compiler.cached(spec) is not None  # same tools: cache hit
    extra = {k: body[k] for k in ("client_metadata", "prompt_cache_key", "store", "include")}
    out = oai.responses.create(
        model=MODEL,
        input=turn_two,
        tools=CODEX_TOOLS,
        reasoning={"summary": "auto"},
        parallel_tool_calls=True,
        max_output_tokens=6,
        extra_body=extra,
    )
    assert out.prompt_cache_key == "thread-1"
    plain = {**returned, "content": [{"type": "reasoning_text", "text": thought}]}
    restored = recipe.prepare(Protocol.RESPONSES, codex_body([*turn_two[:2], plain, call, output]))
    dropped = recipe.prepare(
        Protocol.RESPONSES, codex_body([*turn_two[:2], returned, call, output])
    )
    assert out.usage.input_tokens == restored.num_prompt_tokens > dropped.num_prompt_tokens
    # A token this server did not seal is refused in OpenAI's envelope.
    forged = [DEVELOPER, USER, {**returned, "encrypted_content": sealed[:-6] + "AAAAAA"}]
    response = httpx.post(url + "/v1/responses", json=codex_body(forged, stream=False), timeout=60)
    assert response.status_code == 400
    assert "could not be verified" in response.json()["error"]["message"]


def test_codex_function_call_items_feed_the_next_turn(default_server) -> None:
    url = default_server[0]
    # Without thinking a named tool_choice makes the random model call the tool (grammar).
    first = httpx.post(
        url + "/v1/responses",
        json=codex_body(
            [DEVELOPER, USER],
            stream=False,
            tool_choice={"type": "function", "name": "get_goal"},
            reasoning={"effort": "none", "summary": "auto"},
            max_output_tokens=30,
        ),
        headers={"accept-encoding": "zstd,gzip"},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    calls = [item for item in first.json()["output"] if item["type"] == "function_call"]
    # (what the random model writes inside a non-strict call's arguments varies; the named
    # choice fixes the call itself, which is what the next turn feeds back)
    assert [c["name"] for c in calls] == ["get_goal"]
    results = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "ok"} for c in calls
    ]
    with httpx.stream(
        "POST",
        url + "/v1/responses",
        json=codex_body([DEVELOPER, USER, *first.json()["output"], *results]),
        headers=CODEX_HEADERS,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1][0] in ("response.completed", "response.incomplete")


def claude_code_request(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 6,
        "system": [
            {"type": "text", "text": "x-test-header: cc_version=0"},
            {
                "type": "text",
                "text": "You are a test agent.",
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>Be brief.</reminder>"},
                    {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": "# Environment\ncwd: /tmp",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a command.",
                "input_schema": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "maxLength": 100000},
                        "timeout": {"type": "number"},
                    },
                    "required": ["command"],
                    "additionalProperties": False,
                },
            },
            {
                "name": "ListAgents",
                "description": "List agents.",
                "input_schema": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "type": "object",
                    "properties": {"q": {"type": "string", "maxLength": 256}},
                    "additionalProperties": False,
                },
            },
        ],
        "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "stream": stream,
    }


CLAUDE_CODE_HEADERS = {
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
    "context-management-2025-06-27",
    "anthropic-version": "2023-06-01",
    "x-app": "cli",
    "accept-encoding": "gzip, deflate, br, zstd",
}


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_request_shape(default_server, stream: bool) -> None:
    url, app, _ = default_server
    body = claude_code_request(stream)
    with httpx.stream(
        "POST", url + "/v1/messages?beta=true", json=body, headers=CLAUDE_CODE_HEADERS, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        if stream:
            events = sse_events(response)
            usages = [events[0][1]["message"]["usage"], events[-2][1]["usage"]]
            assert events[-1][0] == "message_stop"
        else:
            usages = [json.loads(response.read())["usage"]]
    prompt_tokens = app.state.server.recipe.prepare(Protocol.MESSAGES, body).num_prompt_tokens
    # Anthropic's accounting: input_tokens are the uncached ones; the prefix cache's hits are
    # cache_read_input_tokens (the same shape sent again hits, as agents resend their history);
    # blocks are cached without a write charge, so cache_creation_input_tokens is 0.
    first = usages[0]
    assert first["input_tokens"] + first["cache_read_input_tokens"] == prompt_tokens
    for usage in usages:
        assert usage["cache_creation_input_tokens"] == 0
        assert usage["cache_read_input_tokens"] == first["cache_read_input_tokens"]


def test_claude_code_shape_through_the_anthropic_sdk(claude) -> None:
    body = claude_code_request(stream=False)
    del body["stream"]
    context = body.pop("context_management")
    out = claude.beta.messages.create(
        **body,
        betas=["claude-code-20250219", "context-management-2025-06-27"],
        extra_body={"context_management": context},
    )
    assert out.type == "message" and out.usage.cache_creation_input_tokens == 0
    prompt_tokens = claude.messages.count_tokens(
        model=body["model"], messages=body["messages"], system=body["system"], tools=body["tools"]
    ).input_tokens
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == prompt_tokens
