"""Request conversion: sampling, limits, thinking, the §9 gaps, and errors per protocol."""

from __future__ import annotations

import json

import pytest

from recipe import Protocol, Recipe, RecipeConfig, RecipeError

from .conftest import CONTEXT_LEN

USER_MSG = [{"role": "user", "content": "Hello"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
THINK, END_THINK, ASSISTANT = 128821, 128822, 128804


def chat(**fields):
    return {"model": "default", "messages": USER_MSG, **fields}


def test_chat_sampling_non_thinking(recipe: Recipe) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT,
        chat(
            thinking={"type": "disabled"},
            temperature=0.3,
            top_p=0.5,
            seed=7,
            max_tokens=100,
            max_completion_tokens=50,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            logit_bias={"42": 5},
            stop=["END"],
        ),
    )
    params = prepared.sampling_params
    assert params.temperature == 0.3
    assert params.top_p == 1.0  # V4.1 non-thinking forces top_p 1.0 (recipe.md §5.2)
    assert params.seed == 7
    assert params.max_tokens == 50  # max_completion_tokens wins over max_tokens
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.logit_bias == {42: 5.0}
    assert prepared.parsing_options.stop_sequences == ["END"]
    assert not prepared.thinking
    assert prepared.prompt_token_ids[-2:] == [ASSISTANT, END_THINK]


def test_chat_thinking_defaults(recipe: Recipe) -> None:
    prepared = recipe.prepare(Protocol.CHAT, chat(temperature=0.2))
    assert prepared.thinking
    assert prepared.sampling_params.temperature == 1.0
    assert prepared.sampling_params.max_tokens == 65536 - prepared.num_prompt_tokens
    assert prepared.prompt_token_ids[-2:] == [ASSISTANT, THINK]
    assert prepared.output_constraint is None


def test_thinking_on_off_renders_think_tags(recipe: Recipe, tokenizer) -> None:
    messages = [
        *USER_MSG,
        {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"},
        {"role": "user", "content": "again"},
    ]
    base = {"model": "default", "messages": messages}
    cases = {
        # thinking + tools keeps historical reasoning (recipe.md §2.2)
        "<｜Assistant｜><think>greet</think>Hi!<｜end▁of▁sentence｜>"
        "<｜User｜>again<｜Assistant｜><think>": {**base, "tools": TOOLS},
        # thinking without tools drops it
        "<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜>"
        "<｜User｜>again<｜Assistant｜><think>": base,
        "<｜Assistant｜></think>Hi!<｜end▁of▁sentence｜><｜User｜>again<｜Assistant｜></think>": {
            **base,
            "thinking": {"type": "disabled"},
        },
    }
    for tail, body in cases.items():
        ids = recipe.prepare(Protocol.CHAT, body).prompt_token_ids
        assert tokenizer.decode(ids).endswith(tail)
        expected = tokenizer.full.encode(tail, add_special_tokens=False).ids
        assert ids[-len(expected) :] == expected  # template tags are single special ids
        assert ids[-1] == (END_THINK if "thinking" in body else THINK)


def test_developer_role_is_system(recipe: Recipe) -> None:
    dev = recipe.prepare(
        Protocol.CHAT,
        {"model": "default", "messages": [{"role": "developer", "content": "Be nice"}, *USER_MSG]},
    )
    sys = recipe.prepare(
        Protocol.CHAT,
        {"model": "default", "messages": [{"role": "system", "content": "Be nice"}, *USER_MSG]},
    )
    assert dev.prompt_token_ids == sys.prompt_token_ids


def test_chat_n_and_include_usage(recipe: Recipe) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT, chat(n=3, stream=True, stream_options={"include_usage": True})
    )
    assert prepared.sampling_params.n == 3
    assert prepared.stream and prepared.include_usage


def test_tool_call_constraint_kept_for_auto(recipe: Recipe) -> None:
    prepared = recipe.prepare(Protocol.CHAT, chat(tools=TOOLS))
    assert prepared.output_constraint is not None
    assert prepared.output_constraint.kind == "tool_call"
    assert prepared.parsing_options.parse_tool_calls


def test_responses_stop_and_logprobs(recipe: Recipe) -> None:
    prepared = recipe.prepare(
        Protocol.RESPONSES,
        {
            "model": "default",
            "input": "hi",
            "stop": "STOP",
            "top_logprobs": 2,
            "max_output_tokens": 10,
        },
    )
    assert prepared.parsing_options.stop_sequences == ["STOP"]
    assert prepared.sampling_params.logprobs and prepared.sampling_params.top_logprobs == 2
    assert prepared.sampling_params.max_tokens == 10
    assert prepared.echo is not None and prepared.echo.max_output_tokens == 10


def test_messages_top_k_and_stop(recipe: Recipe) -> None:
    prepared = recipe.prepare(
        Protocol.MESSAGES,
        {
            "model": "default",
            "max_tokens": 20,
            "messages": USER_MSG,
            "top_k": 5,
            "stop_sequences": ["x"],
        },
    )
    assert prepared.sampling_params.top_k == 5
    assert prepared.sampling_params.max_tokens == 20
    assert prepared.parsing_options.stop_sequences == ["x"]


IMAGE_URL = "https://example.com/a.png"
BAD = [
    (Protocol.CHAT, "not a dict", "JSON object"),
    (Protocol.CHAT, {"messages": USER_MSG}, "missing field `model`"),
    (Protocol.CHAT, chat(model="gpt-4"), "you passed gpt-4"),
    (Protocol.CHAT, chat(temperature="hot"), "invalid"),
    (Protocol.CHAT, chat(temperature=3), "temperature"),
    (Protocol.CHAT, chat(max_tokens=0), "max_tokens"),
    (Protocol.CHAT, chat(max_tokens=CONTEXT_LEN), "maximum context length"),
    (Protocol.CHAT, chat(max_completion_tokens=CONTEXT_LEN), "maximum context length"),
    (Protocol.CHAT, chat(n=0), "n must be"),
    (Protocol.CHAT, chat(n=True), "n must be"),
    (Protocol.CHAT, chat(logit_bias={"x": 1}), "logit_bias"),
    (Protocol.CHAT, chat(messages=[{"role": "robot", "content": "x"}]), "unknown variant"),
    (
        Protocol.CHAT,
        chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        "",
    ),
    (
        Protocol.CHAT,
        chat(
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        ),
        "Invalid schema",
    ),
    (
        Protocol.CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what?"},
                        {"type": "image_url", "image_url": {"url": IMAGE_URL}},
                    ],
                }
            ]
        ),
        "Image inputs are not supported yet",
    ),
    (Protocol.CHAT, chat(stream_options={"include_usage": True}), "stream"),
    (
        Protocol.RESPONSES,
        {"model": "default", "input": "hi", "previous_response_id": "r"},
        "previous_response_id",
    ),
    (Protocol.RESPONSES, {"model": "default", "input": "hi", "store": True}, "store"),
    (Protocol.RESPONSES, {"model": "default", "input": "hi", "background": True}, "background"),
    (Protocol.RESPONSES, {"model": "default", "input": "hi", "stop": [""]}, "stop"),
    (Protocol.RESPONSES, {"model": "default", "input": 3}, "invalid"),
    (
        Protocol.RESPONSES,
        {
            "model": "default",
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": IMAGE_URL}]}
            ],
        },
        "Image inputs",
    ),
    (Protocol.MESSAGES, {"model": "default", "messages": USER_MSG, "max_tokens": 0}, "max_tokens"),
    (Protocol.MESSAGES, {"model": "default", "messages": [], "max_tokens": 5}, "at least one"),
    (
        Protocol.MESSAGES,
        {
            "model": "default",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": IMAGE_URL}}],
                }
            ],
        },
        "Image inputs",
    ),
    (
        Protocol.MESSAGES,
        {"model": "default", "max_tokens": 5, "messages": USER_MSG, "top_k": -1},
        "top_k",
    ),
]


@pytest.mark.parametrize(("protocol", "body", "needle"), BAD)
def test_bad_requests_give_400_in_protocol_envelope(
    recipe: Recipe, protocol: Protocol, body, needle: str
) -> None:
    with pytest.raises(RecipeError) as info:
        recipe.prepare(protocol, body)
    error = info.value
    assert error.status_code == 400
    assert needle in error.message
    envelope = error.body()
    if protocol is Protocol.MESSAGES:
        assert envelope == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": error.message},
        }
    else:
        assert envelope["error"]["type"] == "invalid_request_error"
        assert envelope["error"]["message"] == error.message
        assert set(envelope["error"]) == {"message", "type", "param", "code"}


def test_server_error_types() -> None:
    assert RecipeError(500, "x", Protocol.MESSAGES).body()["error"]["type"] == "api_error"
    assert RecipeError(500, "x", Protocol.CHAT).body()["error"]["type"] == "server_error"
    assert RecipeError(529, "x", Protocol.MESSAGES).error_type == "overloaded_error"


def test_prompt_longer_than_context(tokenizer) -> None:
    from recipe import RecipeConfig

    small = Recipe(tokenizer, RecipeConfig(model_names=("default",), context_len=64))
    long_text = "word " * 200
    for protocol, body in (
        (Protocol.CHAT, {"messages": [{"role": "user", "content": long_text}]}),
        (
            Protocol.MESSAGES,
            {"messages": [{"role": "user", "content": long_text}], "max_tokens": 1},
        ),
    ):
        with pytest.raises(RecipeError) as info:
            small.prepare(protocol, {"model": "default", **body})
        assert info.value.status_code == 400
        assert "maximum context length is 64 tokens" in info.value.message
    short = small.prepare(Protocol.CHAT, chat(thinking={"type": "disabled"}))
    assert short.sampling_params.max_tokens == 64 - short.num_prompt_tokens


def test_penalty_type_checked(recipe: Recipe) -> None:
    with pytest.raises(RecipeError, match="presence_penalty"):
        recipe.prepare(Protocol.CHAT, chat(presence_penalty="x"))
    with pytest.raises(RecipeError):
        recipe.prepare(Protocol.CHAT, chat(frequency_penalty=5))


@pytest.mark.parametrize(
    ("protocol", "field", "value"),
    [
        (Protocol.CHAT, "store", True),
        (Protocol.CHAT, "service_tier", "flex"),
        (Protocol.RESPONSES, "truncation", "auto"),
        (Protocol.RESPONSES, "include", ["message.output_text.logprobs"]),
        (Protocol.RESPONSES, "metadata", {"k": "v"}),
    ],
)
def test_fields_asking_for_missing_behaviour_are_refused(recipe, protocol, field, value) -> None:
    base = (
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
        if protocol is Protocol.CHAT
        else {"model": "default", "input": "hi"}
    )
    with pytest.raises(RecipeError) as err:
        recipe.prepare(protocol, {**base, field: value})
    assert err.value.status_code == 400 and field in str(err.value)
    fine = {
        "store": False,
        "service_tier": "auto",
        "truncation": "disabled",
        "include": [],
        "metadata": {},
    }[field]
    recipe.prepare(protocol, {**base, field: fine})


# ------------------------------------------------------------------ coding agents (issue 14)

CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "strict": False, "parameters": SCHEMA_CMD}
    for SCHEMA_CMD in [
        {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "timeout_ms": {"type": "number"}},
            "required": ["cmd"],
            "additionalProperties": False,
        }
    ]
] + [
    {
        "type": "namespace",
        "name": "agents_ns",
        "description": "sub agents",
        "tools": [
            {
                "type": "function",
                "name": "spawn",
                "strict": False,
                "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
            }
        ],
    },
    {"type": "web_search", "external_web_access": False},
]


def codex_body(**overrides) -> dict:
    """Codex CLI's request shape (synthetic texts)."""
    body = {
        "model": "default",
        "stream": True,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are a test agent."}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "t1", "session_id": "s1"},
    }
    return {**body, **overrides}


def test_codex_request_shape_is_accepted(recipe: Recipe) -> None:
    prepared = recipe.prepare(Protocol.RESPONSES, codex_body())
    assert prepared.reasoning_sealer is not None
    assert prepared.prompt_cache_key == "thread-1"
    assert prepared.sampling_params.affinity_key == "thread-1"
    names = [t["function"]["name"] for t in json.loads(prepared.output_constraint.schema)]
    # namespace tools are flattened; web_search is dropped (the package's documented rule)
    assert names == ["exec_command", "agents_ns::spawn"]
    plain = recipe.prepare(Protocol.RESPONSES, codex_body(include=[], prompt_cache_key=None))
    assert plain.reasoning_sealer is None and plain.sampling_params.affinity_key is None
    assert plain.prompt_token_ids == prepared.prompt_token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("include", ["reasoning.encrypted_content", "file_search_call.results"]),
        ("include", "reasoning.encrypted_content"),
        ("prompt_cache_key", 7),
        ("client_metadata", {"turn": 1}),
        ("reasoning", {"summary": "verbose"}),
    ],
)
def test_codex_fields_are_checked(recipe: Recipe, field: str, value) -> None:
    with pytest.raises(RecipeError) as err:
        recipe.prepare(Protocol.RESPONSES, codex_body(**{field: value}))
    assert err.value.status_code == 400 and field.split(".")[0] in err.value.message


def _turn_two(reasoning_item: dict) -> dict:
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "exec_command",
        "arguments": '{"cmd": "ls"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    return codex_body(input=[user, reasoning_item, call, output])


def test_sealed_reasoning_comes_back_as_history(recipe: Recipe) -> None:
    sealer = recipe.prepare(Protocol.RESPONSES, codex_body()).reasoning_sealer
    thought = "I should list the files first."
    sealed = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "encrypted_content": sealer.seal(thought),
    }
    plain = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": thought}],
    }
    restored = recipe.prepare(Protocol.RESPONSES, _turn_two(sealed))
    assert (
        restored.prompt_token_ids
        == recipe.prepare(Protocol.RESPONSES, _turn_two(plain)).prompt_token_ids
    )
    empty = recipe.prepare(Protocol.RESPONSES, _turn_two({"type": "reasoning", "summary": []}))
    assert len(restored.prompt_token_ids) > len(empty.prompt_token_ids)
    # sealing hides the reasoning from the client; a forged or foreign token is a 400
    assert thought not in sealed["encrypted_content"]
    for forged in ("rs_1-0", sealer.seal(thought)[:-4] + "AAAA", 3):
        with pytest.raises(RecipeError) as err:
            recipe.prepare(Protocol.RESPONSES, _turn_two({**sealed, "encrypted_content": forged}))
        assert err.value.status_code == 400 and "could not be verified" in err.value.message


def test_default_max_tokens_and_limit(tokenizer) -> None:
    config = RecipeConfig(
        model_names=("default",),
        context_len=CONTEXT_LEN,
        default_max_tokens=100,
        max_tokens_limit=500,
    )
    capped = Recipe(tokenizer, config)
    responses = {"model": "default", "input": "hi"}
    assert capped.prepare(Protocol.RESPONSES, responses).sampling_params.max_tokens == 100
    asked = capped.prepare(Protocol.RESPONSES, {**responses, "max_output_tokens": 400})
    assert asked.sampling_params.max_tokens == 400
    with pytest.raises(RecipeError) as err:  # OpenAI protocols refuse more than the limit
        capped.prepare(Protocol.RESPONSES, {**responses, "max_output_tokens": 501})
    assert err.value.status_code == 400
    with pytest.raises(RecipeError):
        capped.prepare(Protocol.CHAT, chat(max_tokens=501))
    messages = {
        "model": "default",
        "max_tokens": 32000,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert capped.prepare(Protocol.MESSAGES, messages).sampling_params.max_tokens == 500
    limited = Recipe(tokenizer, RecipeConfig(("default",), CONTEXT_LEN, max_tokens_limit=50))
    assert limited.prepare(Protocol.CHAT, chat()).sampling_params.max_tokens == 50
    with pytest.raises(ValueError):
        RecipeConfig(("default",), CONTEXT_LEN, default_max_tokens=0)


def claude_code_body(**overrides) -> dict:
    """Claude Code's request shape (synthetic texts)."""
    body = {
        "model": "default",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "billing header line"},
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
                    {"type": "text", "text": "<reminder>be brief</reminder>"},
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "# Environment: test"}]},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "run a command",
                "input_schema": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "type": "object",
                    "properties": {"command": {"type": "string", "maxLength": 4096}},
                    "required": ["command"],
                    "additionalProperties": False,
                },
            }
        ],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "stream": True,
    }
    return {**body, **overrides}


def test_claude_code_request_shape_is_accepted(recipe: Recipe) -> None:
    prepared = recipe.prepare(Protocol.MESSAGES, claude_code_body())
    assert prepared.output_constraint.kind == "tool_call"
    for bad in ({"edits": [{"type": "clear_tool_uses_20250919"}]}, {"edits": "all"}):
        with pytest.raises(RecipeError) as err:
            recipe.prepare(Protocol.MESSAGES, claude_code_body(context_management=bad))
        assert err.value.status_code == 400 and "context_management" in err.value.message


# ---------------------------------------------------------------- thinking (issue 14.3)


def messages(**fields):
    return {"model": "default", "max_tokens": 100, "messages": USER_MSG, **fields}


def test_messages_without_thinking_do_not_think(recipe: Recipe) -> None:
    for body in (messages(), messages(thinking=None), messages(output_config={"effort": "max"})):
        prepared = recipe.prepare(Protocol.MESSAGES, body)
        assert not prepared.thinking and prepared.prompt_token_ids[-1] == END_THINK
    for kind in ("enabled", "adaptive"):
        prepared = recipe.prepare(Protocol.MESSAGES, messages(thinking={"type": kind}))
        assert prepared.thinking and prepared.prompt_token_ids[-1] == THINK
        assert prepared.is_thinking_shown and prepared.sampling_params.thinking_budget is None


@pytest.mark.parametrize(
    ("effort", "level"), [("low", 50), ("medium", 75), ("high", 75), ("xhigh", 75), ("max", 100)]
)
def test_messages_effort_sets_the_reasoning_effort_line(recipe, tokenizer, effort, level) -> None:
    body = messages(thinking={"type": "adaptive"}, output_config={"effort": effort})
    text = tokenizer.decode(recipe.prepare(Protocol.MESSAGES, body).prompt_token_ids)
    assert f"Reasoning Effort: {level} (range 1-100" in text


def test_claude_codes_adaptive_omitted_thinking(recipe: Recipe) -> None:
    body = messages(
        thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "high"}
    )
    prepared = recipe.prepare(Protocol.MESSAGES, body)
    assert prepared.thinking and not prepared.is_thinking_shown
    shown = messages(thinking={"type": "enabled", "budget_tokens": 9, "display": "summarized"})
    assert recipe.prepare(Protocol.MESSAGES, shown).is_thinking_shown


@pytest.mark.parametrize(
    ("protocol", "body"),
    [
        (Protocol.MESSAGES, messages(thinking={"type": "enabled", "budget_tokens": 12})),
        (Protocol.CHAT, chat(max_tokens=100, thinking={"type": "enabled", "budget_tokens": 12})),
        (
            Protocol.RESPONSES,
            {
                "model": "default",
                "input": "hi",
                "thinking": {"type": "enabled", "budget_tokens": 12},
            },
        ),
    ],
    ids=["messages", "chat", "responses"],
)
def test_budget_tokens_becomes_the_engines_thinking_budget(recipe, protocol, body) -> None:
    budget = recipe.prepare(protocol, body).sampling_params.thinking_budget
    assert budget is not None and budget.max_tokens == 12 and budget.end_token_id == END_THINK
    assert budget.ended_by == ()


def test_with_tools_a_tool_call_also_ends_the_budgeted_reasoning(recipe: Recipe) -> None:
    body = chat(tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 12})
    budget = recipe.prepare(Protocol.CHAT, body).sampling_params.thinking_budget
    assert budget.ended_by == (recipe.tokenizer.dsml_token_id,)


def test_budget_is_not_applied_when_the_output_does_not_start_in_reasoning(recipe) -> None:
    prefix = [*USER_MSG, {"role": "assistant", "content": "Partial", "prefix": True}]
    body = chat(messages=prefix, thinking={"type": "enabled", "budget_tokens": 5})
    assert recipe.prepare(Protocol.CHAT, body).sampling_params.thinking_budget is None


BAD_THINKING = [
    (Protocol.MESSAGES, messages(thinking={"type": "enabled", "budget_tokens": 100}), "greater"),
    (Protocol.MESSAGES, messages(thinking={"type": "enabled", "budget_tokens": 0}), ">= 1"),
    (Protocol.MESSAGES, messages(thinking={"type": "adaptive", "budget_tokens": 9}), "enabled"),
    (Protocol.MESSAGES, messages(thinking={"type": "enabled", "budget_tokens": "9"}), "integer"),
    (Protocol.MESSAGES, messages(thinking={"type": "adaptive", "display": "full"}), "display"),
    (Protocol.MESSAGES, messages(thinking={"type": "disabled", "display": "omitted"}), "display"),
    (Protocol.MESSAGES, messages(thinking={"type": "adaptive", "extra": 1}), "thinking"),
    (Protocol.MESSAGES, messages(thinking="on"), "thinking"),
    (
        Protocol.CHAT,
        chat(max_tokens=10, thinking={"type": "enabled", "budget_tokens": 10}),
        "greater",
    ),
    (Protocol.CHAT, chat(thinking={"type": "adaptive", "display": "omitted"}), "thinking"),
    (Protocol.CHAT, chat(chat_template_kwargs={"custom": 1}), "chat_template_kwargs.custom"),
    (Protocol.CHAT, chat(chat_template_kwargs={"thinking": "no"}), "chat_template_kwargs"),
    (Protocol.CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (
        Protocol.CHAT,
        chat(chat_template_kwargs={"enable_thinking": True}, thinking={"type": "disabled"}),
        "contradicts",
    ),
    (
        Protocol.CHAT,
        chat(chat_template_kwargs={"reasoning_effort": "low"}, reasoning_effort="max"),
        "contradicts",
    ),
]


@pytest.mark.parametrize(("protocol", "body", "needle"), BAD_THINKING)
def test_bad_thinking_options_are_400(recipe: Recipe, protocol, body, needle) -> None:
    with pytest.raises(RecipeError) as info:
        recipe.prepare(protocol, body)
    assert info.value.status_code == 400 and needle in info.value.message


@pytest.mark.parametrize(
    ("kwargs", "thinking"),
    [
        ({"thinking": False}, False),
        ({"enable_thinking": False}, False),
        ({"enable_thinking": True}, True),
        ({"thinking": True, "reasoning_effort": "low"}, True),
    ],
)
def test_chat_template_kwargs_switch_thinking(recipe, tokenizer, kwargs, thinking) -> None:
    prepared = recipe.prepare(Protocol.CHAT, chat(chat_template_kwargs=kwargs))
    assert prepared.thinking is thinking
    text = tokenizer.decode(prepared.prompt_token_ids)
    assert ("Reasoning Effort: 50" in text) is ("reasoning_effort" in kwargs)


def test_default_thinking_off_applies_to_chat_and_responses_only(tokenizer) -> None:
    off = Recipe(
        tokenizer,
        RecipeConfig(
            model_names=("default",), context_len=CONTEXT_LEN, default_thinking_mode=False
        ),
    )
    assert not off.prepare(Protocol.CHAT, chat()).thinking
    assert not off.prepare(Protocol.RESPONSES, {"model": "default", "input": "hi"}).thinking
    assert off.prepare(Protocol.CHAT, chat(thinking={"type": "enabled"})).thinking
    assert off.prepare(Protocol.MESSAGES, messages(thinking={"type": "adaptive"})).thinking
    assert not off.prepare(Protocol.MESSAGES, messages()).thinking
