"""Agent frameworks and CLIs other than Codex / Claude Code (issue 14 item 6), through the live
`default` server: openai-agents and LangChain with their real packages, aider / `llm` / the
`openai` CLI as replays of their request shapes (synthetic texts). Each test uses the settings
the README's "Other clients" section gives. Random weights: protocol behaviour only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from server.app import build_recipe

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Say hello."}]


def _sse_chunks(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _deltas(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


@contextmanager
def thinking_off(default_server) -> Iterator[str]:
    """The live server as `--default-thinking off` runs it (its recipe swapped for the one that
    option builds, restored on exit); yields the base URL."""
    url, app, _ = default_server
    state = app.state.server
    saved = state.recipe
    off = dataclasses.replace(state.config, default_thinking=False)
    state.recipe = build_recipe(state.engine, off)
    try:
        yield url
    finally:
        state.recipe = saved


# ---------------------------------------------------------------- aider (litellm, Chat)


def _aider_body(**extra) -> dict:
    """aider 0.86 through litellm (`--model openai/DeepSeek-V4.1-Flash`): streamed Chat with a
    system prompt, temperature 0 and usage in the stream."""
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Act as an expert software developer."},
            {"role": "user", "content": "Rename foo to bar in a.py."},
        ],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 12,
        **extra,
    }


@pytest.mark.parametrize("effort", [None, "none"], ids=["thinking", "reasoning-effort-none"])
def test_aider_request_shape(default_server, effort) -> None:
    body = _aider_body(**({"reasoning_effort": effort} if effort else {}))
    with httpx.stream(
        "POST", default_server[0] + "/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        chunks = _sse_chunks(response)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12
    reasoning = _deltas(chunks, "reasoning_content")
    # aider shows `reasoning_content` as its thinking section; `--reasoning-effort none` skips it
    assert bool(reasoning) is (effort is None)
    if effort == "none":
        assert _deltas(chunks, "content")


# ---------------------------------------------------------------- `llm` and the `openai` CLI


def test_llm_and_openai_cli_print_nothing_while_thinking_but_answer_with_thinking_off(
    default_server,
) -> None:
    """`llm` 0.36 (extra-openai-models.yaml, streamed with usage) and `openai api
    chat.completions.create -g user ... -M 8` (not streamed) show only `content`. With thinking
    on a short answer is all reasoning (nothing printed); `--default-thinking off` fixes both."""
    import openai

    def ask(url: str) -> tuple[str, str]:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        once = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)
        return streamed, once.choices[0].message.content or ""

    thinking = ask(default_server[0])
    assert thinking == ("", "")  # 8 tokens of reasoning: what these CLIs printed (nothing)
    with thinking_off(default_server) as url:
        streamed, once = ask(url)
    assert streamed and once


# ---------------------------------------------------------------- openai-agents (real package)


def _run_agent(url: str, api: str) -> str:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace uploads to api.openai.com

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    models = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}
    agent = Agent(
        name="helper",
        instructions="Answer briefly.",
        model=models[api](model=MODEL, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(max_tokens=16, extra_body={"thinking": {"type": "disabled"}}),
    )
    return Runner.run_sync(agent, "Say hello.", max_turns=2).final_output


def test_openai_agents(default_server) -> None:
    agents = pytest.importorskip("agents")
    output = _run_agent(default_server[0], "chat")
    assert isinstance(output, str) and output
    # On Responses, an answer cut by the output limit is `status: "incomplete"`, which the SDK
    # raises on (as with OpenAI): give agents a limit their answers fit in.
    with pytest.raises(agents.exceptions.ModelBehaviorError, match="max_output_tokens"):
        _run_agent(default_server[0], "responses")


# ---------------------------------------------------------------- LangChain (real packages)


def test_langchain_openai(default_server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        base_url=default_server[0] + "/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=12,
        reasoning_effort="none",  # ChatOpenAI drops `reasoning_content`
        max_retries=0,
    )
    reply = chat.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] == 12
    streamed = "".join(chunk.content for chunk in chat.stream("Say hello."))
    assert streamed
    with_tool = chat.bind_tools(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ).invoke("Call f.")
    assert isinstance(with_tool.content, str)


def test_langchain_anthropic(default_server) -> None:
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    chat = langchain_anthropic.ChatAnthropic(
        base_url=default_server[0],
        api_key="unused",
        model=MODEL,
        max_tokens=12,
        max_retries=0,
    )
    # No `thinking` sent: no thinking (Anthropic's rule), so the content is the answer's text.
    reply = chat.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content
    thinking = langchain_anthropic.ChatAnthropic(
        base_url=default_server[0],
        api_key="unused",
        model=MODEL,
        max_tokens=12,
        max_retries=0,
        thinking={"type": "enabled", "budget_tokens": 4},
    ).invoke("Say hello.")
    kinds = [block["type"] for block in thinking.content]
    assert kinds[0] == "thinking" and "text" in kinds  # the budget ended the reasoning
