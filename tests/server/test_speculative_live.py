"""Streams with several tokens per engine step keep tool-call arguments, the reasoning/content
split and UTF-8 intact (`dspark.md` §5.3), through a live server and the real SDKs.

The server runs the `default` model with `--speculative dspark` semantics. Its drafts come from
`NgramDrafts` (test-only): the continuation of the request's last four committed tokens as seen
earlier on this server (prompt lookup). Each request is sent twice, non-streamed first: the
second run's drafts are the first run's tokens, so its steps commit several tokens and its
stream events carry several tokens each. Coupled acceptance makes a seeded second run the same
tokens as the first; exact KV storage keeps the numerics batch-invariant (see
`tests/engine/speculative/test_lossless.py`). The streamed pieces must add up to the body.
"""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.models.deepseek_v41.state import TOKEN_RING
from engine.speculative.drafts import DraftRequests, Proposal
from server.app import create_app
from server.config import ServerConfig
from tests.server.conftest import DEFAULT_ENGINE, live_server

pytestmark = pytest.mark.slow  # the `default` model, speculative, 6-12 s a test
MODEL = "DeepSeek-V4.1-Flash"
KEY = 4
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


class NgramDrafts:
    """Drafts by looking the last KEY committed tokens up among those seen before."""

    num_drafts = 5

    def __init__(self) -> None:
        self.state = None
        self.table: dict[tuple[int, ...], int] = {}

    def propose(self, requests: DraftRequests) -> Proposal:
        rows = []
        for anchor, p, slot in zip(
            requests.anchors.tolist(),
            requests.positions.tolist(),
            requests.slots.tolist(),
            strict=True,
        ):
            first = max(0, p - TOKEN_RING + 1)
            seen = self.state.tokens[slot, [q % TOKEN_RING for q in range(first, p)]].tolist()
            seen.append(anchor)
            for i in range(KEY, len(seen)):
                self.table[tuple(seen[i - KEY : i])] = seen[i]
            drafts = []
            for _ in range(self.num_drafts):
                seen.append(self.table.get(tuple(seen[-KEY:]), 0))
                drafts.append(seen[-1])
            rows.append(drafts)
        drafts = torch.tensor(rows, dtype=torch.long)
        return Proposal(drafts, None, torch.full(drafts.shape, 0.5))


@pytest.fixture(scope="module")
def speculative_server(default_model_exact_kv):
    """(OpenAI client, engine) of a live server with speculation over the `default` weights."""
    model = default_model_exact_kv
    config = dataclasses.replace(
        DEFAULT_ENGINE,
        speculative="dspark",
        speculative_acceptance="coupled",
        enable_prefix_caching=False,
    )
    source = NgramDrafts()
    engine = AsyncEngine.from_model(model, config, draft_source=source)
    source.state = engine.core.runner.state
    app = create_app(ServerConfig(engine=config), engine=engine)
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        yield client, engine


def _multi_token_steps(engine: AsyncEngine) -> int:
    lengths = engine.core.runner.speculative.metrics.accept_length
    return sum(lengths[2:])


def test_streamed_tool_call_arguments_add_up_across_multi_token_steps(speculative_server):
    client, engine = speculative_server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 200,
        "seed": 3,
        "extra_body": {"thinking": {"type": "disabled"}},
    }
    whole = client.chat.completions.create(**body)
    before = _multi_token_steps(engine)
    pieces: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            if call.function.name:
                names[call.index] = call.function.name
            pieces.setdefault(call.index, []).append(call.function.arguments or "")
    assert _multi_token_steps(engine) > before  # several tokens per step in the streamed run
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == [names[i] for i in sorted(names)]
    for i, call in enumerate(calls):
        streamed = "".join(pieces[i])
        assert streamed == call.function.arguments
        arguments = json.loads(streamed)
        assert arguments["city"] in ("Paris", "Oslo", "Rome") and 1 <= arguments["days"] <= 14


def test_streamed_reasoning_and_content_split_and_utf8_across_multi_token_steps(
    speculative_server,
):
    client, engine = speculative_server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Écris un mot: 你好, ça va? 🙂"}],
        "max_tokens": 90,
        "seed": 11,
        "extra_body": {"thinking": {"type": "enabled", "budget_tokens": 30}},
    }
    whole = client.chat.completions.create(**body)
    before = _multi_token_steps(engine)
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
    assert _multi_token_steps(engine) > before
    message = whole.choices[0].message
    assert "".join(reasoning) == message.reasoning_content
    assert "".join(content) == (message.content or "")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 30
    for text in ("".join(reasoning), "".join(content)):
        text.encode("utf-8")  # no lone surrogates from a split multi-byte character


def test_a_stop_string_inside_a_multi_token_step_ends_the_text_before_it(speculative_server):
    client, engine = speculative_server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something long."}],
        "max_tokens": 60,
        "seed": 5,
        "extra_body": {"thinking": {"type": "disabled"}},
    }
    free = client.chat.completions.create(**body).choices[0].message.content
    stop = next(
        free[i : i + 3]
        for i in range(len(free) // 2, len(free) - 3)
        if free[i : i + 3].strip() and free.index(free[i : i + 3]) == i
    )
    before = _multi_token_steps(engine)
    whole = client.chat.completions.create(**body, stop=[stop])
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**body, stop=[stop], stream=True)
        if chunk.choices
    )
    assert _multi_token_steps(engine) > before
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == free[: free.index(stop)] == streamed
