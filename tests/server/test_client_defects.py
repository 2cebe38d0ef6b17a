"""Defects real clients hit (issue 12 items 2, 3, 7, 8, 9; issue 13 items 6, 8), through the live
`default` server and the official SDKs. Random weights: these check protocol behaviour only."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from recipe.errors import Protocol
from server.cli import build_parser, config_from_args

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Say hello."}]
OFF = {"thinking": {"type": "disabled"}}
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CHAT_TOOL = {"type": "function", "function": WEATHER}


# --------------------------------------------------------------- 12.2: thinking off everywhere


@pytest.mark.parametrize(
    "off",
    [{"reasoning_effort": "none"}, {"extra_body": OFF}],
    ids=["reasoning_effort", "thinking"],
)
def test_chat_thinking_off(oai, off) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **off)
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert out.usage.completion_tokens_details is None or (
        out.usage.completion_tokens_details.reasoning_tokens in (0, None)
    )


@pytest.mark.parametrize(
    "off",
    [{"reasoning": {"effort": "none"}}, {"extra_body": OFF}],
    ids=["reasoning.effort", "thinking"],
)
def test_responses_thinking_off(oai, off) -> None:
    out = oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, **off)
    assert [item.type for item in out.output if item.type == "reasoning"] == []
    streamed = oai.responses.create(
        model=MODEL, input="Say hello.", max_output_tokens=4, stream=True, **off
    )
    kinds = [e.item.type for e in streamed if e.type == "response.output_item.added"]
    assert "reasoning" not in kinds


def test_responses_thinking_on_and_malformed(oai) -> None:
    on = oai.responses.create(
        model=MODEL,
        input="Say hello.",
        max_output_tokens=2,
        reasoning={"effort": "none"},
        extra_body={"thinking": {"type": "enabled"}},
    )
    assert on.output and on.output[0].type == "reasoning"
    with pytest.raises(openai.BadRequestError, match="thinking"):
        oai.responses.create(
            model=MODEL, input="x", max_output_tokens=2, extra_body={"thinking": {"type": "x"}}
        )


def test_messages_thinking_off(claude) -> None:
    out = claude.messages.create(
        model=MODEL, max_tokens=4, messages=USER, thinking={"type": "disabled"}
    )
    assert [b.type for b in out.content if b.type == "thinking"] == []


# --------------------------------------------------------------- 12.7: limits


def test_messages_without_max_tokens_is_400(default_server) -> None:
    url = default_server[0]
    for path in ("/v1/messages", "/v1/messages"):
        response = httpx.post(url + path, json={"model": MODEL, "messages": USER}, timeout=30)
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["type"] == "error" and "max_tokens" in body["error"]["message"]
    # count_tokens does not need one
    counted = httpx.post(
        url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": USER}, timeout=30
    )
    assert counted.status_code == 200


def test_chat_and_responses_without_a_limit_use_the_rest_of_the_context(tokenizer) -> None:
    from recipe import Recipe, RecipeConfig

    context_len = 300_000  # above the package's per-mode defaults (8,192 / 65,536)
    recipe = Recipe(tokenizer, RecipeConfig(model_names=(MODEL,), context_len=context_len))
    for protocol, body in (
        (Protocol.CHAT, {"model": MODEL, "messages": USER, **OFF}),
        (Protocol.CHAT, {"model": MODEL, "messages": USER}),
        (Protocol.RESPONSES, {"model": MODEL, "input": "hi", "reasoning": {"effort": "none"}}),
    ):
        prepared = recipe.prepare(protocol, body)
        assert prepared.sampling_params.max_tokens == context_len - prepared.num_prompt_tokens
    limited = recipe.prepare(Protocol.CHAT, {"model": MODEL, "messages": USER, "max_tokens": 7})
    assert limited.sampling_params.max_tokens == 7


@pytest.fixture(scope="module")
def tokenizer(v41_tokenizer_dir):
    from recipe import load_tokenizer

    return load_tokenizer(v41_tokenizer_dir)


# --------------------------------------------------------------- 12.8 / 13.6: /tokenize


def _tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body, timeout=30)


@pytest.mark.parametrize(
    "extra",
    [{}, {"tools": [CHAT_TOOL]}, OFF, {"tools": [CHAT_TOOL], **OFF}],
    ids=["thinking", "tools", "off", "tools-off"],
)
def test_tokenize_chat_messages_match_prompt_tokens(oai, default_server, extra) -> None:
    url = default_server[0]
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    body: dict = {"model": MODEL, "messages": messages}
    if "tools" in extra:
        body["tools"] = extra["tools"]
    if "thinking" in extra:
        body["chat_template_kwargs"] = {"thinking": False}
    response = _tokenize(url, body)
    assert response.status_code == 200, response.text
    tokens = response.json()
    chat_extra = {k: v for k, v in extra.items() if k != "thinking"}
    out = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        extra_body={"thinking": extra["thinking"]} if "thinking" in extra else None,
        **chat_extra,
    )
    assert tokens["count"] == len(tokens["tokens"]) == out.usage.prompt_tokens
    assert tokens["tokens"][0] == 0  # BOS
    without = _tokenize(url, {**body, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokens["tokens"][:-2]


@pytest.mark.parametrize(
    "bad",
    [
        {"continue_final_message": True},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"custom": 1}},
        {"chat_template": "{{ messages }}"},
        {"messages": [{"role": "wizard", "content": "x"}]},
    ],
)
def test_tokenize_chat_rejects_what_it_does_not_implement(default_server, bad) -> None:
    response = _tokenize(default_server[0], {"model": MODEL, "messages": USER, **bad})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_lone_surrogate_is_400(default_server) -> None:
    url = default_server[0]
    for body in (
        b'{"prompt": "x\\ud800y"}',
        b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}',
    ):
        response = httpx.post(
            url + "/tokenize", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_encodes_special_spellings_as_prompts_do(default_server) -> None:
    url = default_server[0]
    text = "a <｜User｜> b </think> c ｜DSML｜"
    plain = _tokenize(url, {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert not {128803, 128822, 128825} & set(plain)
    with_bos = _tokenize(url, {"prompt": text}).json()["tokens"]
    assert with_bos == [0, *plain]
    chat = _tokenize(
        url,
        {
            "messages": [{"role": "user", "content": text}],
            "chat_template_kwargs": {"thinking": False},
        },
    ).json()["tokens"]
    # BOS <｜User｜> text <｜Assistant｜> </think>: the text's ids are the prompt form's.
    assert chat == [0, 128803, *plain, 128804, 128822]
    detokenized = httpx.post(url + "/detokenize", json={"tokens": plain}).json()["prompt"]
    assert detokenized == text


# --------------------------------------------------------------- 12.9: names and messages


def test_count_tokens_unknown_model_is_404(claude) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="gpt-4", messages=USER)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="gpt-4", max_tokens=2, messages=USER)


def test_error_messages_do_not_repeat_their_prefix(oai, claude) -> None:
    for call in (
        lambda: oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, extra_body={"thinking": {"type": "bogus"}}
        ),
        lambda: oai.chat.completions.create(model=MODEL, messages="x", max_tokens=2),
        lambda: oai.responses.create(model=MODEL, input=5, max_output_tokens=2),
        lambda: claude.messages.create(model=MODEL, max_tokens=2, messages="x"),
    ):
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as info:
            call()
        message = str(info.value)
        for prefix in ("invalid request body: ", "invalid JSON request: "):
            assert message.count(prefix) <= 1, message


def test_served_model_names_option() -> None:
    args = build_parser().parse_args(["--served-model-name", "flash", "ds-flash"])
    assert config_from_args(args).served_model_names == ("flash", "ds-flash")
    default = config_from_args(build_parser().parse_args([]))
    assert default.served_model_names == (MODEL,)
    assert "--served-model-name" in build_parser().format_help()


def test_served_names_answer_and_the_preset_name_does_not(make_app) -> None:
    app, _ = make_app(served_model_names=("flash", "ds-flash"))
    with TestClient(app) as client:
        listed = client.get("/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["flash", "ds-flash"]
        assert client.get("/v1/models/ds-flash").status_code == 200
        for preset in ("default", "tiny"):
            assert client.get(f"/v1/models/{preset}").status_code == 404
            response = client.post("/tokenize", json={"prompt": "tok5", "model": preset})
            assert response.status_code == 404


def test_served_names_reach_the_protocol_layer(default_server) -> None:
    """The served names are what the package accepts (and nothing else)."""
    _, app, _ = default_server
    assert app.state.server.recipe.config.model_names == app.state.server.config.served_model_names
    models = httpx.get(default_server[0] + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    response = httpx.post(
        default_server[0] + "/v1/chat/completions",
        json={"model": "default", "messages": USER, "max_tokens": 1},
    )
    assert response.status_code == 404


# --------------------------------------------------------------- 13.8: usage


def _chat_usage(url: str, body: dict) -> list[dict]:
    """The usage of a non-streaming and of a streaming Chat request with `body`."""
    plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=streamed, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return [plain, chunks[-1]["usage"]]


def test_usage_counts_every_generated_token(default_server) -> None:
    """EOS sampled in the reasoning (logit_bias makes it likely): completion tokens count every
    token, reasoning tokens never exceed them."""
    url = default_server[0]
    bodies = [
        {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 12,
            "seed": seed,
            "n": 2,
            "logit_bias": {"1": 8},
            "logprobs": True,
        }
        for seed in range(6)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:  # one batch: the counts hold in any batch
        usages = list(pool.map(lambda body: _chat_usage(url, body), bodies))
    for seed, pair in enumerate(usages):
        for usage in pair:
            reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
            assert reasoning <= usage["completion_tokens"], (seed, usage)
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# --------------------------------------------------------------- 12.3: cut tool calls


# A one-letter tool and parameter keep the DSML header short, so a few dozen tokens of the
# random-weight model reach the value. `required` (thinking off) prefills the calls block and
# the grammar forces the invoke. With seed 1 the limits below cut: inside the invoke header
# (no call yet), after the name closed (`{`), inside the parameter's markup, in its name, in
# its attributes and in its value; CUT_REFERENCE tokens are the longer run all are cut from.
CUT_TOOL = {
    "type": "function",
    "function": {
        "name": "w",
        "parameters": {
            "type": "object",
            "properties": {"c": {"type": "string"}},
            "required": ["c"],
        },
    },
}
CUT_SEED = 1
CUT_LIMITS = (5, 12, 19, 22, 25, 28)
CUT_REFERENCE = 30


def _cut_tool_call(oai, max_tokens: int, stream: bool):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Lima?"}],
        tools=[CUT_TOOL],
        tool_choice="required",
        max_tokens=max_tokens,
        logprobs=True,
        seed=CUT_SEED,
        extra_body=OFF,
    )
    if not stream:
        out = oai.chat.completions.create(**kwargs)
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        entries = choice.logprobs.content if choice.logprobs else None
        return choice.finish_reason, [c.function.arguments for c in calls], entries, out.usage
    chunks = list(
        oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    arguments: dict[int, str] = {}
    entries: list = []
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.logprobs and choice.logprobs.content:
                entries += choice.logprobs.content
            for call in choice.delta.tool_calls or []:
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
    return finish, list(arguments.values()), entries or None, chunks[-1].usage


def _assert_cut_prefixes(cuts: list[list[str]], reference: str) -> None:
    """Each cut reports no call (cut inside the invoke header) or one call whose arguments are a
    prefix of the longer run's, `{` at least; the cuts cover the header, `{` and what follows."""
    previous = ""
    for arguments in cuts:
        assert len(arguments) <= 1, arguments
        if arguments:
            assert arguments[0].startswith("{") and reference.startswith(arguments[0]), arguments
            assert arguments[0].startswith(previous)
            previous = arguments[0]
    seen = [a[0] if a else None for a in cuts]
    # Which cut lands in which part depends on the seeded tokens; the bridge tests cut after
    # every token of a DSML block. Here: the header (no call), `{`, and past it.
    assert None in seen and "{" in seen, seen
    assert any(a and a.startswith('{"') for a in seen), seen


@pytest.fixture(scope="module")
def plain_cuts(oai) -> tuple[str, list]:
    """The non-streamed reference call's arguments and the non-streamed cuts at CUT_LIMITS, one
    request each, sequential (seeded tokens may move with the batch): both forms use them."""
    _, (reference,), _, _ = _cut_tool_call(oai, CUT_REFERENCE, stream=False)
    return reference, [_cut_tool_call(oai, m, stream=False) for m in CUT_LIMITS]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.slow  # sequential cut requests, ~8 s each
def test_tool_call_cut_by_max_tokens_keeps_its_logprobs(oai, plain_cuts, stream) -> None:
    """A forced call cut by `max_tokens` at every part of the DSML block: finish `length`, the
    arguments are the JSON prefix generated so far (streamed deltas concatenate to the same
    text), and every generated token keeps its logprob entry."""
    reference, plain = plain_cuts
    cuts = []
    for i, max_tokens in enumerate(CUT_LIMITS):
        finish, arguments, entries, usage = (
            _cut_tool_call(oai, max_tokens, stream) if stream else plain[i]
        )
        assert finish == "length"
        assert usage.completion_tokens == max_tokens
        # Every generated token is tool-call markup (the prompt opened the calls block).
        assert entries is not None and len(entries) == usage.completion_tokens
        cuts.append(arguments)
    _assert_cut_prefixes(cuts, reference)
    if stream:
        assert cuts == [arguments for _, arguments, _, _ in plain]


@pytest.mark.slow  # ~6 s
def test_responses_tool_call_cut_by_max_output_tokens(oai) -> None:
    """Responses, streaming and not: status `incomplete` (`max_output_tokens`) and a cut call's
    arguments start with `{`; streamed deltas, the `done` event and the final output agree.
    NOTE: Responses has no `seed` (the package drops it), so the two forms sample apart."""
    tool = {"type": "function", "name": "w", "parameters": CUT_TOOL["function"]["parameters"]}
    kwargs = dict(
        model=MODEL, input="Weather in Lima?", tools=[tool], tool_choice="required", extra_body=OFF
    )

    def plain_and_streamed(max_tokens: int):
        out = oai.responses.create(**kwargs, max_output_tokens=max_tokens)
        streamed, done, final = "", None, None
        for event in oai.responses.create(**kwargs, max_output_tokens=max_tokens, stream=True):
            if event.type == "response.function_call_arguments.delta":
                streamed += event.delta
            elif event.type == "response.function_call_arguments.done":
                done = event.arguments
            elif event.type == "response.incomplete":
                final = [i.arguments for i in event.response.output if i.type == "function_call"]
        return out, streamed, done, final

    with ThreadPoolExecutor(3) as pool:  # unseeded: nothing here depends on the batch
        results = list(pool.map(plain_and_streamed, (12, 19, 28)))
    for out, streamed, done, final in results:
        assert out.status == "incomplete"
        assert out.incomplete_details.reason == "max_output_tokens"
        assert all(i.arguments.startswith("{") for i in out.output if i.type == "function_call")
        assert final is not None and final == ([] if done is None else [done])
        assert done is None or (done == streamed and done.startswith("{")), (done, streamed)
