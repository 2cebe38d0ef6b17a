"""The bridge driven by the token ids of real DSML tool calls, for all three protocols.

The DSML text comes from the package's own rendering of an assistant turn with those calls
(`recipe.md` §2.4); its ids are what the model would write (`｜DSML｜` as its special id, the
rest plain tokens). The ids are fed one token per delta, split in two at every token boundary,
and in groups of several tokens (speculative decoding); the accumulated client-side tool calls
(names, parsed arguments) must match for Chat chunks, Responses events and Messages events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import deepseek_recipe as dr
import pytest

from engine.outputs import Delta, TokenLogprob
from engine.request import FinishReason
from recipe import DONE, ModelTokenizer, PreparedRequest, Protocol, Recipe, ResponseBridge

END_THINK, EOS = 128822, 1
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": SCHEMA}}
    for name in ("get_weather", "get_time")
]
BODIES = {
    Protocol.CHAT: {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS},
    Protocol.RESPONSES: {
        "input": "hi",
        "tools": [
            {"type": "function", "name": t["function"]["name"], "parameters": SCHEMA}
            for t in CHAT_TOOLS
        ],
    },
    Protocol.MESSAGES: {
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": t["function"]["name"], "input_schema": SCHEMA} for t in CHAT_TOOLS],
    },
}
CALLS = {
    "single": [("get_weather", {"city": "Lima"})],
    "parallel": [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "utc": True})],
    "escapes_non_ascii": [
        (
            "get_weather",
            {
                "city": 'Zürich "quoted" \\ back\\slash\nnew line\ttab \u0001 東京 🌧️',
                "days": 3,
                "ratio": 2.5e-07,
                "nested": {"a": [1, None, 'x"y'], "b": "ü"},
                "markup": "</think> <｜User｜> </tool_result>",
            },
        ),
        ("get_time", {}),
    ],
}


def dsml_ids(tokenizer: ModelTokenizer, calls) -> list[int]:
    """The ids of the DSML block the package renders for `calls` (model output form)."""
    tool_calls = [
        dr.ToolCall(f"c{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)
    ]
    conversation = dr.Conversation(
        [dr.UserMessage("x"), dr.AssistantMessage("", tool_calls=tool_calls)],
        thinking_mode=False,
    )
    encoding = dr.DeepseekV41Encoding().with_special_tokens(tokenizer.special_tokens)
    rendered = encoding.render_conversation(conversation)
    ids = tokenizer.encode_prompt(rendered)
    # ... <｜Assistant｜></think> [DSML block] <｜end▁of▁sentence｜> <｜Assistant｜></think>
    start = ids.index(END_THINK, ids.index(128804)) + 1
    block = ids[start : ids.index(EOS, start)]
    assert block.count(128825) == 2 + 2 * len(calls) + 2 * sum(len(a) for _, a in calls)
    return block


def output_ids(tokenizer: ModelTokenizer, calls) -> list[int]:
    plain = tokenizer.plain.encode
    return (
        plain("Need data.").ids
        + [END_THINK]
        + plain("Let me check.").ids
        + dsml_ids(tokenizer, calls)
        + [EOS]
    )


def splits(ids: list[int]) -> Iterator[list[list[int]]]:
    yield [[t] for t in ids]
    for group in (2, 3, 7):
        yield [ids[k : k + group] for k in range(0, len(ids), group)]
    for k in range(1, len(ids)):
        yield [ids[:k], ids[k:]]


def run(prepared: PreparedRequest, tokenizer: ModelTokenizer, chunks: list[list[int]]):
    bridge = ResponseBridge(prepared, tokenizer, "resp1", created=0)
    events = bridge.start()
    done = 0
    for i, chunk in enumerate(chunks):
        done += len(chunk)
        last = i == len(chunks) - 1
        step = bridge.push(
            Delta(
                "r",
                0,
                chunk,
                None,
                prepared.num_prompt_tokens,
                done,
                FinishReason.STOP if last else None,
            )
        )
        assert not step.abort
        events += step.events
    assert bridge.is_finished
    return events, bridge.response()


def client_tool_calls(protocol: Protocol, events) -> list[tuple[str, dict]]:
    """Accumulate tool calls the way an SDK client would from the stream."""
    calls: dict[int, list] = {}
    if protocol is Protocol.CHAT:
        assert events[-1].data == DONE
        for event in events[:-1]:
            assert event.event is None
            for choice in event.data["choices"]:
                for call in choice["delta"].get("tool_calls") or ():
                    entry = calls.setdefault(call["index"], ["", ""])
                    if "id" in call:
                        assert call["id"].startswith(f"call_{call['index']:02}_")
                        entry[0] = call["function"]["name"]
                    entry[1] += call["function"].get("arguments") or ""
    elif protocol is Protocol.RESPONSES:
        done: dict[int, str] = {}
        for event in events:
            data = event.data
            assert data["type"] == event.event
            if event.event == "response.output_item.added" and data["item"]["type"] == (
                "function_call"
            ):
                calls[data["output_index"]] = [data["item"]["name"], ""]
            elif event.event == "response.function_call_arguments.delta":
                calls[data["output_index"]][1] += data["delta"]
            elif event.event == "response.function_call_arguments.done":
                done[data["output_index"]] = data["arguments"]
        assert done == {k: v[1] for k, v in calls.items()}
        assert events[-1].event == "response.completed"
    else:
        for event in events:
            data = event.data
            assert data["type"] == event.event
            if event.event == "content_block_start" and data["content_block"]["type"] == (
                "tool_use"
            ):
                calls[data["index"]] = [data["content_block"]["name"], ""]
            elif event.event == "content_block_delta" and data["delta"]["type"] == (
                "input_json_delta"
            ):
                calls[data["index"]][1] += data["delta"]["partial_json"]
        assert events[-1].event == "message_stop"
    return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


def final_tool_calls(protocol: Protocol, response: dict) -> list[tuple[str, dict]]:
    if protocol is Protocol.CHAT:
        message = response["choices"][0]["message"]
        assert message["reasoning_content"] == "Need data."
        assert message["content"] == "Let me check."
        assert response["choices"][0]["finish_reason"] == "tool_calls"
        return [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]
        ]
    if protocol is Protocol.RESPONSES:
        return [
            (i["name"], json.loads(i["arguments"]))
            for i in response["output"]
            if i["type"] == "function_call"
        ]
    assert response["stop_reason"] == "tool_use"
    return [(b["name"], b["input"]) for b in response["content"] if b["type"] == "tool_use"]


@pytest.mark.parametrize("protocol", list(Protocol))
@pytest.mark.parametrize("case", list(CALLS))
def test_tool_call_streaming_from_dsml_ids(
    recipe: Recipe, tokenizer: ModelTokenizer, protocol: Protocol, case: str
) -> None:
    calls = CALLS[case]
    expected = [(name, args) for name, args in calls]
    prepared = recipe.prepare(protocol, {"model": "default", **BODIES[protocol]})
    ids = output_ids(tokenizer, calls)
    for chunks in splits(ids):
        events, response = run(prepared, tokenizer, chunks)
        assert client_tool_calls(protocol, events) == expected
        assert final_tool_calls(protocol, response) == expected
        text = json.dumps([e.data for e in events], ensure_ascii=False)
        assert "<｜end▁of▁sentence｜>" not in text


def test_stop_sequence_aborts_and_strips_eos(recipe: Recipe, tokenizer: ModelTokenizer) -> None:
    for protocol, body in (
        (Protocol.CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": "XY"}),
        (Protocol.RESPONSES, {"input": "hi", "stop": ["XY"], "reasoning": {"effort": "none"}}),
        (
            Protocol.MESSAGES,
            {
                "max_tokens": 50,
                "messages": [{"role": "user", "content": "hi"}],
                "stop_sequences": ["XY"],
            },
        ),
    ):
        prepared = recipe.prepare(
            protocol, {"model": "default", "thinking": {"type": "disabled"}, **body}
        )
        bridge = ResponseBridge(prepared, tokenizer, "r")
        bridge.start()
        ids = tokenizer.plain.encode("Hello XY world").ids
        step = bridge.push(Delta("r", 0, ids[:1], None, 5, 1))
        assert not step.abort and not bridge.is_finished
        step = bridge.push(Delta("r", 0, ids[1:], None, 5, len(ids)))
        assert step.abort and bridge.is_finished
        # late deltas from the engine are ignored
        assert bridge.push(Delta("r", 0, [EOS], None, 5, 9, FinishReason.STOP)).events == []
        text = json.dumps(bridge.response())
        assert "Hello " in text and "world" not in text


def test_eos_stripped_without_tools(recipe: Recipe, tokenizer: ModelTokenizer) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT,
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "disabled"},
        },
    )
    ids = tokenizer.plain.encode("Done.").ids + [EOS]
    _, response = run(prepared, tokenizer, [ids])
    assert response["choices"][0]["message"]["content"] == "Done."


def test_chat_n_include_usage_and_logprobs(recipe: Recipe, tokenizer: ModelTokenizer) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT,
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 1,
            "thinking": {"type": "disabled"},
        },
    )
    bridge = ResponseBridge(prepared, tokenizer, "c", created=0, num_cached_tokens=4)
    events = bridge.start()
    texts = ["One two", "Three four five"]
    for index, text in enumerate(texts):
        ids = tokenizer.plain.encode(text).ids + [EOS]
        logprobs = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids]
        step = bridge.push(
            Delta(f"c-{index}", index, ids, logprobs, 9, len(ids), FinishReason.STOP)
        )
        events += step.events
    assert events[-1].data == DONE
    usage_chunk = events[-2].data
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == prepared.num_prompt_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4
    # Every generated token counts, the EOS that ended each choice included (as the engine's
    # and the server's token counters count them).
    assert usage["completion_tokens"] == sum(len(tokenizer.plain.encode(t).ids) + 1 for t in texts)
    assert all(e.data["usage"] is None for e in events[:-2])
    contents = {0: "", 1: ""}
    for event in events[:-2]:
        for choice in event.data["choices"]:
            contents[choice["index"]] += choice["delta"].get("content") or ""
    assert contents == {0: texts[0], 1: texts[1]}
    response = bridge.response()
    assert [c["message"]["content"] for c in response["choices"]] == texts
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert response["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert response["usage"]["completion_tokens"] == usage["completion_tokens"]


def test_chat_without_include_usage_sends_no_usage(
    recipe: Recipe, tokenizer: ModelTokenizer
) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT,
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    events, response = run(prepared, tokenizer, [tokenizer.plain.encode("Hi").ids])
    assert all(e.data == DONE or e.data["usage"] is None for e in events)
    assert response["usage"]["prompt_tokens"] == prepared.num_prompt_tokens


def test_engine_abort_raises(recipe: Recipe, tokenizer: ModelTokenizer) -> None:
    from recipe import RecipeError

    prepared = recipe.prepare(
        Protocol.MESSAGES,
        {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    bridge = ResponseBridge(prepared, tokenizer, "m")
    with pytest.raises(RecipeError) as info:
        bridge.push(Delta("m", 0, [], None, 5, 0, FinishReason.ABORT, error="out of memory"))
    assert info.value.status_code == 500
    assert info.value.body()["error"]["type"] == "api_error"


# ------------------------------------------------------------ 12.3: tool calls cut by length

REQUIRED = {
    Protocol.CHAT: "required",
    Protocol.RESPONSES: "required",
    Protocol.MESSAGES: {"type": "any"},
}
CUT_CALLS = [
    ("get_weather", {"city": "Lima", "days": 3}),
    (
        "get_time",
        {"tz": 'a "b" \\ </think> </x', "nested": {"k": [1, "v"]}, "utc": True, "last": "z"},
    ),
]


def cut_run(prepared: PreparedRequest, tokenizer: ModelTokenizer, chunks: list[list[int]]):
    """Feed `chunks`, the last delta ending the choice at the output limit."""
    bridge = ResponseBridge(prepared, tokenizer, "resp1", created=0)
    events = bridge.start()
    done = 0
    for i, chunk in enumerate(chunks):
        done += len(chunk)
        last = i == len(chunks) - 1
        finish = FinishReason.LENGTH if last else None
        events += bridge.push(
            Delta("r", 0, chunk, None, prepared.num_prompt_tokens, done, finish)
        ).events
    if not chunks:
        events += bridge.push(
            Delta("r", 0, [], None, prepared.num_prompt_tokens, 0, FinishReason.LENGTH)
        ).events
    assert bridge.is_finished
    return events, bridge.response()


def streamed_arguments(protocol: Protocol, events) -> list[tuple[str, str]]:
    """(name, concatenated argument text) per call, as a client reads the stream."""
    calls: dict[int, list[str]] = {}
    for event in events:
        data = event.data
        if data == DONE:
            continue
        if protocol is Protocol.CHAT:
            for call in (c for e in data["choices"] for c in e["delta"].get("tool_calls") or ()):
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] = call["function"].get("name") or entry[0]
                entry[1] += call["function"].get("arguments") or ""
        elif protocol is Protocol.RESPONSES:
            if event.event == "response.output_item.added" and data["item"]["type"] == (
                "function_call"
            ):
                calls[data["output_index"]] = [data["item"]["name"], ""]
            elif event.event == "response.function_call_arguments.delta":
                calls[data["output_index"]][1] += data["delta"]
            elif event.event == "response.function_call_arguments.done":
                assert data["arguments"] == calls[data["output_index"]][1]
        elif event.event == "content_block_start" and data["content_block"]["type"] == ("tool_use"):
            calls[data["index"]] = [data["content_block"]["name"], ""]
        elif event.event == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            calls[data["index"]][1] += data["delta"]["partial_json"]
    return [(name, args) for _, (name, args) in sorted(calls.items())]


def body_calls(protocol: Protocol, response: dict) -> list[tuple[str, Any]]:
    """(name, arguments text / Messages input object) per call, and checks the finish."""
    if protocol is Protocol.CHAT:
        choice = response["choices"][0]
        assert choice["finish_reason"] == "length"
        calls = choice["message"].get("tool_calls") or []
        return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if protocol is Protocol.RESPONSES:
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        return [
            (i["name"], i["arguments"]) for i in response["output"] if i["type"] == "function_call"
        ]
    assert response["stop_reason"] == "max_tokens"
    return [(b["name"], b["input"]) for b in response["content"] if b["type"] == "tool_use"]


@pytest.mark.parametrize("protocol", list(Protocol))
def test_tool_call_cut_by_length_at_every_token(
    recipe: Recipe, tokenizer: ModelTokenizer, protocol: Protocol
) -> None:
    """A choice cut by the output limit after each token of a DSML block (call header,
    parameter name, attributes, string and verbatim values, closing tags): every reported call
    has its full name and arguments that are a prefix of the complete call's arguments (`{` at
    least; never text that may be the closing tag), growing token by token; the streamed
    deltas concatenate to the body's text; a Messages `input` holds the parameters complete so
    far."""
    body = {
        "model": "default",
        "thinking": {"type": "disabled"},
        **BODIES[protocol],
        "tool_choice": REQUIRED[protocol],
        "stream": True,
    }
    prepared = recipe.prepare(protocol, body)
    block = dsml_ids(tokenizer, CUT_CALLS)
    # `required` prefills "\n\n<｜DSML｜ calls>\n": the model writes from the first invoke.
    ids = block[5:] if prepared.parsing_options.starts_in_tool_calls else block
    full = [(name, json.dumps(args)) for name, args in CUT_CALLS]
    previous: list[tuple[str, str]] = []
    num_open_calls = 0
    for cut in range(len(ids) + 1):
        generated = ids[:cut]
        for chunks in ([[t] for t in generated], [generated] if generated else []):
            events, response = cut_run(prepared, tokenizer, chunks)
            streamed = streamed_arguments(protocol, events)
            assert len(streamed) <= len(full)
            for (name, args), (full_name, full_args) in zip(streamed, full, strict=False):
                assert name == full_name, (cut, name)
                assert args.startswith("{") and full_args.startswith(args), (cut, args)
            for (_, args), (_, before) in zip(streamed, previous, strict=False):
                assert args.startswith(before), (cut, args, before)
            in_body = body_calls(protocol, response)
            assert [name for name, _ in in_body] == [name for name, _ in streamed]
            if protocol is not Protocol.MESSAGES:
                assert in_body == streamed, cut
            else:
                for (_, given), (_, args), (_, complete) in zip(
                    in_body, streamed, CUT_CALLS, strict=False
                ):
                    assert list(given) == list(complete)[: len(given)], (cut, given)
                    assert all(given[k] == complete[k] for k in given), (cut, given)
                    if args == json.dumps(complete):
                        assert given == complete
        previous = streamed
        num_open_calls = max(num_open_calls, len(streamed))
    assert num_open_calls == len(full)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", {}),
        ('{"ci', {}),
        ('{"city": ', {}),
        ('{"city": "Li', {}),
        ('{"city": "Lima"', {"city": "Lima"}),
        ('{"city": "Lima", "days": 3', {"city": "Lima"}),
        ('{"city": "Lima", "days": 3, "', {"city": "Lima", "days": 3}),
        ('{"a": {"b": 1}', {}),
        ('{"a": {"b": 1}}', {"a": {"b": 1}}),
        ('{"a": not json, "b": "x"', {}),
    ],
)
def test_messages_cut_input_holds_complete_parameters(text: str, expected: dict) -> None:
    from recipe.cut_tool_calls import complete_parameters

    assert complete_parameters(text) == expected
