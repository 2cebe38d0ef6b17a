"""Thinking switches and budgets (issue 14 item 3) through the live `default` server and the
official SDKs. Random weights: these check protocol behaviour, not answers."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from server.cli import build_parser, config_from_args

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Say hello."}]


def _block_types(message) -> list[str]:
    return [block.type for block in message.content]


def test_messages_without_thinking_do_not_think(claude) -> None:
    out = claude.messages.create(model=MODEL, max_tokens=6, messages=USER)
    assert "thinking" not in _block_types(out)
    with claude.messages.stream(model=MODEL, max_tokens=6, messages=USER) as stream:
        kinds = [e.content_block.type for e in stream if e.type == "content_block_start"]
    assert "thinking" not in kinds
    # An effort alone does not turn thinking on (Anthropic's rule).
    effort = claude.messages.create(
        model=MODEL, max_tokens=6, messages=USER, extra_body={"output_config": {"effort": "max"}}
    )
    assert "thinking" not in _block_types(effort)


def test_messages_adaptive_thinking_thinks(claude) -> None:
    out = claude.messages.create(
        model=MODEL,
        max_tokens=6,
        messages=USER,
        extra_body={"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}},
    )
    assert _block_types(out)[0] == "thinking" and out.content[0].thinking


def test_messages_omitted_thinking_has_blocks_without_text(claude) -> None:
    body = {"thinking": {"type": "adaptive", "display": "omitted"}}
    out = claude.messages.create(model=MODEL, max_tokens=6, messages=USER, extra_body=body)
    assert out.content[0].type == "thinking"
    assert out.content[0].thinking == "" and out.content[0].signature
    assert out.usage.output_tokens == 6  # the reasoning was generated, only not returned
    with claude.messages.stream(
        model=MODEL, max_tokens=6, messages=USER, extra_body=body
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    assert final.content[0].type == "thinking" and final.content[0].thinking == ""


def test_budget_tokens_ends_the_reasoning(oai, claude) -> None:
    thinking = {"type": "enabled", "budget_tokens": 3}
    chat = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=10, seed=1, extra_body={"thinking": thinking}
    )
    assert chat.usage.completion_tokens_details.reasoning_tokens == 3
    unbounded = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=10,
        seed=1,
        extra_body={"thinking": {"type": "enabled"}},
    )
    assert unbounded.usage.completion_tokens_details.reasoning_tokens > 3
    message = claude.messages.create(
        model=MODEL, max_tokens=10, messages=USER, thinking=thinking, metadata=None
    )
    assert _block_types(message)[0] == "thinking" and len(message.content) > 1
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        claude.messages.create(
            model=MODEL,
            max_tokens=3,
            messages=USER,
            thinking={"type": "enabled", "budget_tokens": 3},
        )


def test_chat_template_kwargs_turn_thinking_off(oai, default_server) -> None:
    for kwargs in ({"thinking": False}, {"enable_thinking": False}):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=4,
            extra_body={"chat_template_kwargs": kwargs},
        )
        assert getattr(out.choices[0].message, "reasoning_content", None) is None
        assert out.usage.completion_tokens_details is None or (
            out.usage.completion_tokens_details.reasoning_tokens in (0, None)
        )
    response = httpx.post(
        default_server[0] + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "chat_template_kwargs": {"custom": 1}},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs.custom"
    with pytest.raises(openai.BadRequestError, match="contradicts"):
        oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=2,
            extra_body={
                "thinking": {"type": "disabled"},
                "chat_template_kwargs": {"enable_thinking": True},
            },
        )


@pytest.mark.parametrize(("flag", "expected"), [([], True), (["--default-thinking", "off"], False)])
def test_default_thinking_option(flag, expected) -> None:
    assert config_from_args(build_parser().parse_args(flag)).default_thinking is expected


def test_omitted_thinking_comes_back_through_its_signature(claude) -> None:
    # With tools, the recipe keeps each assistant turn's reasoning in the history. An omitted
    # block returns empty text: its signature must bring the reasoning back, so the next
    # turn's prompt is the one a client that kept the text would send.
    tools = [{"name": "look", "input_schema": {"type": "object", "properties": {}}}]
    common = {"model": MODEL, "max_tokens": 12, "tools": tools}

    def next_turn_input_tokens(display: str, stream: bool) -> int:
        thinking = {"type": "enabled", "budget_tokens": 8, "display": display}
        # (thinking mode samples at temperature 1: a bias makes both runs write the same)
        greedy = {"thinking": thinking, "logit_bias": {"1000": 100}}
        if stream:
            with claude.messages.stream(messages=USER, extra_body=greedy, **common) as events:
                first = events.get_final_message()
        else:
            first = claude.messages.create(messages=USER, extra_body=greedy, **common)
        assert first.content[0].type == "thinking"
        assert bool(first.content[0].thinking) == (display == "summarized")
        history = [
            *USER,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": "Go on."},
        ]
        tokens = claude.messages.count_tokens(
            model=MODEL,
            messages=history,
            tools=tools,
            extra_body={"thinking": thinking, "max_tokens": 12},
        )
        return tokens.input_tokens

    shown = next_turn_input_tokens("summarized", stream=False)
    assert next_turn_input_tokens("omitted", stream=False) == shown
    assert next_turn_input_tokens("omitted", stream=True) == shown
