"""The three APIs over a real uvicorn server on the `default` model, through the official SDKs.

The model has random weights: these tests check protocol behaviour (shapes, usage, streaming,
parameters, cancellation), never the meaning of the text.
"""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from recipe.errors import Protocol

MODEL = "DeepSeek-V4.1-Flash"


def _prompt_tokens(app, protocol: Protocol, body: dict) -> int:
    return app.state.server.recipe.prepare(protocol, body).num_prompt_tokens


def _wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> None:
    scheduler = engine.core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.num_running or scheduler.num_waiting:
        assert time.monotonic() < deadline, "requests kept running"
        time.sleep(0.02)
    scheduler.check_integrity()
    assert scheduler.kv_manager.usage() == 0.0


USER = [{"role": "user", "content": "Say hello."}]


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_chat_non_streaming_usage_and_max_tokens(oai, default_server) -> None:
    _, app, _ = default_server
    body = {"model": MODEL, "messages": USER, "max_tokens": 5}
    out = oai.chat.completions.create(**body, extra_body={"thinking": {"type": "disabled"}})
    assert out.object == "chat.completion" and len(out.choices) == 1
    assert out.usage.completion_tokens <= 5
    expected = _prompt_tokens(app, Protocol.CHAT, {**body, "thinking": {"type": "disabled"}})
    assert out.usage.prompt_tokens == expected
    assert out.choices[0].finish_reason in ("length", "stop")
    url = default_server[0]
    assert _metric(url, "deepinfer:request_queue_time_seconds_count") >= 1
    assert _metric(url, "deepinfer:time_to_first_token_seconds_count") >= 1
    assert _metric(url, "deepinfer:prompt_tokens_total") >= expected


def test_chat_streaming_with_usage_n_logprobs_and_seed(oai, default_server) -> None:
    kwargs = dict(
        model=MODEL,
        messages=USER,
        max_tokens=6,
        n=2,
        seed=11,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking": {"type": "disabled"}},
    )
    chunks = list(oai.chat.completions.create(**kwargs))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert any(c.choices and c.choices[0].logprobs for c in chunks)
    again = list(oai.chat.completions.create(**kwargs))

    def text(stream, index):
        return "".join(
            c.choices[0].delta.content or ""
            for c in stream
            if c.choices and c.choices[0].index == index
        )

    assert text(chunks, 0) == text(again, 0) and text(chunks, 1) == text(again, 1)
    _wait_idle(default_server[2])


def test_chat_thinking_and_multi_turn_tool_results(oai) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    out = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8)
    assert out.usage.prompt_tokens > 20
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_chat_stop_sequence_is_accepted(oai) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=8,
        stop=["\n\n", "END"],
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert out.choices[0].finish_reason in ("length", "stop")


def test_responses_non_streaming_and_streaming(oai, default_server) -> None:
    out = oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6)
    assert out.object == "response" and out.usage.output_tokens <= 6
    expected = _prompt_tokens(
        default_server[1],
        Protocol.RESPONSES,
        {"model": MODEL, "input": "Say hello.", "max_output_tokens": 6},
    )
    assert out.usage.input_tokens == expected
    events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")  # max tokens hit


def test_messages_non_streaming_and_streaming(claude, default_server) -> None:
    body = {"model": MODEL, "max_tokens": 6, "messages": USER}
    out = claude.messages.create(**body, thinking={"type": "disabled"})
    assert out.type == "message" and out.usage.output_tokens <= 6
    expected = _prompt_tokens(
        default_server[1], Protocol.MESSAGES, {**body, "thinking": {"type": "disabled"}}
    )
    assert out.usage.input_tokens == expected
    with claude.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    count = claude.messages.count_tokens(model=MODEL, messages=USER)
    assert count.input_tokens > 0


def test_cancelling_a_stream_frees_the_request(oai, default_server) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=2000,
        stream=True,
        extra_body={"thinking": {"type": "disabled"}, "ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _wait_idle(default_server[2])


def test_errors_use_each_protocols_envelope(oai, claude) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=10**7)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=5)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.BadRequestError) as bad_msg:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert bad_msg.value.body["type"] == "error"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model=MODEL,
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                    ],
                }
            ],
        )
