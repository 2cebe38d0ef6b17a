"""Request constraints -> grammar specs, for the three protocols and the Chat extensions.

Each spec is compiled with the real vocabulary and probed with texts it must accept or reject,
so these tests check the grammar a request really gets, not only its kind.
"""

from __future__ import annotations

import json

import pytest

from engine.structured import GrammarCompiler, GrammarSpec, RequestMatcher
from recipe import Protocol, Recipe, RecipeError
from recipe.tokenizer import ModelTokenizer

EOS_ID = 1
DSML_ID = 128825
USER = [{"role": "user", "content": "Reply in json please"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": CITY}]
NO_THINKING = {"thinking": {"type": "disabled"}}


def chat(**fields):
    return {"model": "default", "messages": USER, **fields}


THINKING = {"type": "adaptive"}  # Messages think only when asked (Anthropic's semantics)


def messages(**fields):
    return {"model": "default", "max_tokens": 50, "messages": USER, **fields}


def _accepts(
    compiler: GrammarCompiler, tokenizer: ModelTokenizer, spec: GrammarSpec, text: str
) -> bool:
    ids = tokenizer.full.encode(text, add_special_tokens=False).ids
    matcher = RequestMatcher(compiler.compile(spec))
    return matcher.accept([*ids, EOS_ID])


def _invoke(city: str, days: int) -> str:
    return (
        '<｜DSML｜ invoke name="get_weather">\n'
        f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>\n'
        f'<｜DSML｜ parameter name="days" string="false">{days}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
    )


@pytest.mark.parametrize(
    ("body", "good", "bad"),
    [
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": CITY},
                }
            ),
            '{"city": "Oslo", "days": 2}',
            '{"city": "Oslo"}',
        ),
        (chat(response_format={"type": "json_object"}), '{"any": [1]}', "[1]"),
        (chat(response_format={"type": "regex", "regex": "[a-c]{3}"}), "abc", "abcd"),
        (chat(structured_outputs={"json": CITY}), '{"city": "A", "days": 1}', '{"days": 1}'),
        (chat(structured_outputs={"json_object": True}), "{}", '"x"'),
        (chat(structured_outputs={"regex": r"\d{2}-\d{2}"}), "12-34", "1-34"),
        (chat(structured_outputs={"choice": ["yes", 'no "way"']}), 'no "way"', "maybe"),
        (chat(structured_outputs={"grammar": 'root ::= "a" root | "b"'}), "aab", "aba"),
        (chat(guided_json=json.dumps(CITY)), '{"city": "B", "days": 0}', '{"city": 1, "days": 0}'),
        (chat(guided_regex="x+"), "xxx", "xy"),
        (chat(guided_choice=["left", "right"]), "right", "up"),
        (chat(guided_grammar='root ::= "(" root ")" | ""'), "(())", "(()"),
        (chat(ebnf='root ::= [0-9]+ "!"'), "42!", "42"),
    ],
)
def test_chat_constraints_compile_to_the_requested_language(
    recipe: Recipe, tokenizer, v41_grammar_compiler, body, good: str, bad: str
) -> None:
    spec = recipe.prepare(Protocol.CHAT, {**body, **NO_THINKING}).grammar
    assert spec is not None
    assert _accepts(v41_grammar_compiler, tokenizer, spec, good)
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, bad)


def test_thinking_mode_constrains_after_the_reasoning(
    recipe: Recipe, tokenizer, v41_grammar_compiler
) -> None:
    spec = recipe.prepare(Protocol.CHAT, chat(structured_outputs={"regex": "ok"})).grammar
    assert spec is not None and spec.kind == "structural_tag"
    assert _accepts(v41_grammar_compiler, tokenizer, spec, "hmm, fine</think>ok")
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, "ok")


def test_extension_json_renders_the_response_format_section(recipe: Recipe) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    via_format = recipe.prepare(
        Protocol.CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        ),
    )
    via_extension = recipe.prepare(Protocol.CHAT, chat(structured_outputs={"json": schema}))
    assert via_extension.prompt_token_ids == via_format.prompt_token_ids
    plain = recipe.prepare(Protocol.CHAT, chat(structured_outputs={"regex": "a"}))
    assert plain.prompt_token_ids == recipe.prepare(Protocol.CHAT, chat()).prompt_token_ids


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (chat(structured_outputs={"regex": "a", "json": {}}), "exactly one"),
        (chat(structured_outputs={}), "exactly one"),
        (chat(structured_outputs={"regex": "a", "whitespace_pattern": " *"}), "not supported"),
        (chat(json_whitespace="loose"), "json_whitespace"),
        (chat(structured_outputs={"regex": "a", "lark": "x"}), "unknown field"),
        (chat(structured_outputs="regex"), "must be an object"),
        (chat(structured_outputs={"choice": []}), "non-empty list"),
        (chat(structured_outputs={"json": "{nope"}), "not a valid JSON schema"),
        (chat(guided_regex="a", ebnf='root ::= "a"'), "only one grammar"),
        (chat(guided_regex="a", guided_decoding_backend="outlines"), "xgrammar"),
        (chat(ebnf='root ::= "a"', tools=CHAT_TOOLS), "cannot be combined"),
        (
            chat(guided_regex="a", response_format={"type": "json_object"}),
            "cannot be combined",
        ),
        (chat(parallel_tool_calls="no"), "parallel_tool_calls"),
    ],
)
def test_malformed_or_conflicting_extensions_are_400(recipe: Recipe, body, needle: str) -> None:
    with pytest.raises(RecipeError, match=needle) as info:
        recipe.prepare(Protocol.CHAT, body)
    assert info.value.status_code == 400


def test_extension_is_fine_when_tools_cannot_be_called(recipe: Recipe) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT,
        chat(ebnf='root ::= "a"', tools=CHAT_TOOLS, tool_choice="none", **NO_THINKING),
    )
    assert prepared.grammar == GrammarSpec("ebnf", 'root ::= "a"')


def test_tool_choice_auto_allows_text_or_valid_calls(
    recipe: Recipe, tokenizer, v41_grammar_compiler
) -> None:
    prepared = recipe.prepare(Protocol.CHAT, chat(tools=CHAT_TOOLS, **NO_THINKING))
    spec = prepared.grammar
    assert spec is not None and spec.token_marker == "｜DSML｜"
    assert prepared.sampling_params.banned_token_ids == ()
    calls = "\n\n<｜DSML｜ calls>\n" + _invoke("Rome", 1) + _invoke("Oslo", 2) + "</｜DSML｜ calls>"
    assert _accepts(v41_grammar_compiler, tokenizer, spec, "Just text.")
    assert _accepts(v41_grammar_compiler, tokenizer, spec, "Let me check." + calls)
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, calls.replace(">1<", ">one<"))
    single = recipe.prepare(
        Protocol.CHAT, chat(tools=CHAT_TOOLS, parallel_tool_calls=False, **NO_THINKING)
    ).grammar
    assert not _accepts(v41_grammar_compiler, tokenizer, single, calls)
    one_call = "\n\n<｜DSML｜ calls>\n" + _invoke("Rome", 1) + "</｜DSML｜ calls>"
    assert _accepts(v41_grammar_compiler, tokenizer, single, one_call)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_tool_choice_continues_the_prefilled_calls_block(
    recipe: Recipe, tokenizer, v41_grammar_compiler, choice
) -> None:
    prepared = recipe.prepare(
        Protocol.CHAT, chat(tools=CHAT_TOOLS, tool_choice=choice, **NO_THINKING)
    )
    assert tokenizer.decode(prepared.prompt_token_ids).endswith("<｜DSML｜ calls>\n")
    spec = prepared.grammar
    body = _invoke("Rome", 1) + "</｜DSML｜ calls>"
    assert _accepts(v41_grammar_compiler, tokenizer, spec, body)
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, "<｜DSML｜ calls>\n" + body)
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, "</｜DSML｜ calls>")


def test_tool_choice_none_bans_the_dsml_token(recipe: Recipe) -> None:
    for body in (chat(tools=CHAT_TOOLS, tool_choice="none"), chat()):
        prepared = recipe.prepare(Protocol.CHAT, body)
        assert prepared.grammar is None
        assert prepared.sampling_params.banned_token_ids == (DSML_ID,)


def test_responses_formats_and_parallel_calls(recipe: Recipe, tokenizer, v41_grammar_compiler):
    base = {"model": "default", "input": "json please", "reasoning": {"effort": "none"}}
    fmt = {"format": {"type": "json_schema", "name": "c", "schema": CITY}}
    spec = recipe.prepare(Protocol.RESPONSES, {**base, "text": fmt}).grammar
    assert _accepts(v41_grammar_compiler, tokenizer, spec, '{"city": "X", "days": 3}')
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    single = recipe.prepare(
        Protocol.RESPONSES, {**base, "tools": tools, "parallel_tool_calls": False}
    ).grammar
    calls = "\n\n<｜DSML｜ calls>\n" + _invoke("A", 1) + _invoke("B", 2) + "</｜DSML｜ calls>"
    assert not _accepts(v41_grammar_compiler, tokenizer, single, calls)


def test_messages_any_requires_a_call_and_output_format_is_json(
    recipe: Recipe, tokenizer, v41_grammar_compiler
) -> None:
    any_choice = recipe.prepare(
        Protocol.MESSAGES,
        messages(tools=MESSAGES_TOOLS, tool_choice={"type": "any"}, **NO_THINKING),
    )
    spec = any_choice.grammar
    call = "\n\n<｜DSML｜ calls>\n" + _invoke("Oslo", 2) + "</｜DSML｜ calls>"
    assert _accepts(v41_grammar_compiler, tokenizer, spec, call)
    assert not _accepts(v41_grammar_compiler, tokenizer, spec, "No tools needed.")
    single = recipe.prepare(
        Protocol.MESSAGES,
        messages(
            tools=MESSAGES_TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            **NO_THINKING,
        ),
    ).grammar
    two = "\n\n<｜DSML｜ calls>\n" + _invoke("A", 1) + _invoke("B", 2) + "</｜DSML｜ calls>"
    assert _accepts(v41_grammar_compiler, tokenizer, spec, two)
    assert not _accepts(v41_grammar_compiler, tokenizer, single, two)

    fmt = {"format": {"type": "json_schema", "schema": CITY}}
    prepared = recipe.prepare(Protocol.MESSAGES, messages(output_config=fmt, **NO_THINKING))
    assert _accepts(v41_grammar_compiler, tokenizer, prepared.grammar, '{"city": "C", "days": 4}')
    assert '"additionalProperties"' in tokenizer.decode(prepared.prompt_token_ids)
    with pytest.raises(RecipeError, match="output_config.format"):
        recipe.prepare(Protocol.MESSAGES, messages(output_config={"format": {"type": "xml"}}))


def test_answer_formats_cannot_continue_a_partial_answer(recipe: Recipe) -> None:
    partial = [*USER, {"role": "assistant", "content": '{"city": ', "prefix": True}]
    with pytest.raises(RecipeError, match="prefix continuation"):
        recipe.prepare(
            Protocol.CHAT,
            chat(messages=partial, structured_outputs={"regex": "a+"}, **NO_THINKING),
        )
    with pytest.raises(RecipeError, match="prefix continuation"):
        recipe.prepare(Protocol.CHAT, chat(messages=partial, ebnf='root ::= "a"'))
    # Continuing the reasoning is fine: the grammar starts after `</think>`.
    reasoning = {"role": "assistant", "content": "", "reasoning_content": "So", "prefix": True}
    prepared = recipe.prepare(Protocol.CHAT, chat(messages=[*USER, reasoning], ebnf='root ::= "a"'))
    assert prepared.grammar is not None and prepared.grammar.kind == "structural_tag"


TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TWO_CHAT_TOOLS = [
    *CHAT_TOOLS,
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
TWO_RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": CITY},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
TWO_MESSAGES_TOOLS = [*MESSAGES_TOOLS, {"name": "get_time", "input_schema": TIME}]
TIME_CALL = (
    '<｜DSML｜ invoke name="get_time">\n'
    '<｜DSML｜ parameter name="zone" string="true">UTC</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
)


def _calls(*invokes: str) -> str:
    return "\n\n<｜DSML｜ calls>\n" + "".join(invokes) + "</｜DSML｜ calls>"


def _responses(**fields):
    return {"model": "default", "input": "Reply in json please", **fields}


# (protocol, body with a forced choice, the same body as the package would take it, named?)
FORCED_IN_THINKING = [
    (
        Protocol.CHAT,
        chat(tools=TWO_CHAT_TOOLS, tool_choice="required"),
        chat(tools=TWO_CHAT_TOOLS, tool_choice="auto"),
        False,
    ),
    (
        Protocol.CHAT,
        chat(
            tools=TWO_CHAT_TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        ),
        chat(tools=CHAT_TOOLS, tool_choice="auto"),
        True,
    ),
    (
        Protocol.RESPONSES,
        _responses(tools=TWO_RESPONSES_TOOLS, tool_choice="required"),
        _responses(tools=TWO_RESPONSES_TOOLS),
        False,
    ),
    (
        Protocol.RESPONSES,
        _responses(
            tools=TWO_RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
        ),
        _responses(tools=TWO_RESPONSES_TOOLS[:1]),
        True,
    ),
    (
        Protocol.MESSAGES,
        messages(tools=TWO_MESSAGES_TOOLS, tool_choice={"type": "any"}, thinking=THINKING),
        messages(tools=TWO_MESSAGES_TOOLS, tool_choice={"type": "auto"}, thinking=THINKING),
        False,
    ),
    (
        Protocol.MESSAGES,
        messages(
            tools=TWO_MESSAGES_TOOLS,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            thinking=THINKING,
        ),
        messages(tools=MESSAGES_TOOLS, tool_choice={"type": "auto"}, thinking=THINKING),
        True,
    ),
]


@pytest.mark.parametrize(("protocol", "body", "as_auto", "named"), FORCED_IN_THINKING)
def test_forced_tool_choice_in_thinking_mode_reasons_then_must_call(
    recipe: Recipe, tokenizer, v41_grammar_compiler, protocol, body, as_auto, named: bool
) -> None:
    # The package refuses these in thinking mode (400 "Thinking mode does not support this
    # tool_choice", Messages `any` is silently `auto`); here the grammar requires the call.
    prepared = recipe.prepare(protocol, body)
    assert prepared.thinking
    # The prompt is the package's own rendering of the allowed choice: thinking header, the
    # named tool only (as it keeps for a named choice outside thinking mode).
    assert prepared.prompt_token_ids == recipe.prepare(protocol, as_auto).prompt_token_ids
    assert tokenizer.decode(prepared.prompt_token_ids).endswith("<｜Assistant｜><think>")
    spec = prepared.grammar
    weather = _invoke("Oslo", 2)

    def accepts(text: str) -> bool:
        return _accepts(v41_grammar_compiler, tokenizer, spec, text)

    assert accepts("Let me think.</think>" + _calls(weather))
    assert not accepts("Let me think.</think>No tool needed.")
    assert not accepts("Let me think.</think>")
    assert not accepts(_calls(weather))  # the reasoning must end first
    assert accepts("Let me think.</think>" + _calls(TIME_CALL)) is not named
    assert accepts("Hm.</think>" + _calls(weather, weather)) is not named


def test_forced_tool_choice_keeps_the_package_errors(recipe: Recipe) -> None:
    unknown = chat(tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}})
    with pytest.raises(RecipeError, match="no function named 'x'"):
        recipe.prepare(Protocol.CHAT, unknown)
    # Outside thinking mode the package's prefilled calls block is kept.
    prepared = recipe.prepare(Protocol.CHAT, chat(tools=CHAT_TOOLS, tool_choice="required"))
    assert prepared.parsing_options.starts_in_tool_calls is False
    off = recipe.prepare(
        Protocol.CHAT, chat(tools=CHAT_TOOLS, tool_choice="required", **NO_THINKING)
    )
    assert off.parsing_options.starts_in_tool_calls is True


LIMITED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "kind": {"const": "trip"},
    },
    "required": ["city", "tags", "kind"],
}
GOOD_ARGS = {"city": "Oslo", "tags": ["a"], "kind": "trip"}
# Each is a value the package's strict mode would let through: it drops maxLength, minItems,
# maxItems and a typed const, and refuses `enum` / `const` without `type`.
BAD_ARGS = [
    {"city": "Oslo" * 3, "tags": ["a"], "kind": "trip"},
    {"city": "Oslo", "tags": [], "kind": "trip"},
    {"city": "Oslo", "tags": ["a", "b", "a"], "kind": "trip"},
    {"city": "Oslo", "tags": ["c"], "kind": "trip"},
    {"city": "Oslo", "tags": ["a"], "kind": "work"},
]


def _strict_bodies():
    chat_tool = {
        "type": "function",
        "function": {"name": "f", "strict": True, "parameters": LIMITED},
    }
    chat_format = {
        "type": "json_schema",
        "json_schema": {"name": "f", "strict": True, "schema": LIMITED},
    }
    responses_tool = {"type": "function", "name": "f", "strict": True, "parameters": LIMITED}
    responses_format = {
        "format": {"type": "json_schema", "name": "f", "strict": True, "schema": LIMITED}
    }
    off = {"reasoning": {"effort": "none"}}
    return [
        (Protocol.CHAT, chat(tools=[chat_tool], tool_choice="required", **NO_THINKING), True),
        (Protocol.CHAT, chat(response_format=chat_format, **NO_THINKING), False),
        (
            Protocol.RESPONSES,
            _responses(tools=[responses_tool], tool_choice="required", **off),
            True,
        ),
        (Protocol.RESPONSES, _responses(text=responses_format, **off), False),
    ]


@pytest.mark.parametrize(("protocol", "body", "is_tool"), _strict_bodies())
def test_strict_schemas_keep_and_enforce_every_keyword(
    recipe: Recipe, tokenizer, v41_grammar_compiler, protocol, body, is_tool: bool
) -> None:
    prepared = recipe.prepare(protocol, body)

    def text(arguments: dict) -> str:
        if not is_tool:
            return json.dumps(arguments)
        params = "".join(
            f'<｜DSML｜ parameter name="{k}" string="{str(isinstance(v, str)).lower()}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜ parameter>\n"
            for k, v in arguments.items()
        )
        return f'<｜DSML｜ invoke name="f">\n{params}</｜DSML｜ invoke>\n</｜DSML｜ calls>'

    assert _accepts(v41_grammar_compiler, tokenizer, prepared.grammar, text(GOOD_ARGS))
    for bad in BAD_ARGS:
        assert not _accepts(v41_grammar_compiler, tokenizer, prepared.grammar, text(bad)), bad
    # Strict normalisation as the package does it, in the prompt too, keywords kept.
    prompt = tokenizer.decode(prepared.prompt_token_ids)
    assert '"maxLength": 10' in prompt
    assert '"additionalProperties": false, "required": ["city", "tags", "kind"]' in prompt
    assert '"items": {"enum": ["a", "b"], "type": "string"}' in prompt


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({**LIMITED, "required": ["city"]}, "Required properties must match"),
        ({**LIMITED, "additionalProperties": True}, "additionalProperties should not be true"),
        (
            {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
        ),
    ],
)
def test_strict_rule_breaks_and_unenforced_keywords_are_400(
    recipe: Recipe, schema: dict, needle: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    with pytest.raises(RecipeError, match=needle) as info:
        recipe.prepare(Protocol.CHAT, chat(tools=[tool], **NO_THINKING))
    assert info.value.status_code == 400


def test_json_whitespace_option(recipe: Recipe, tokenizer, v41_grammar_compiler) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}
    pretty = json.dumps({"city": "Oslo", "days": 2}, indent=2)
    for protocol, body in (
        (Protocol.CHAT, chat(response_format=fmt, **NO_THINKING)),
        (Protocol.CHAT, chat(tools=CHAT_TOOLS, tool_choice="required", **NO_THINKING)),
        (
            Protocol.MESSAGES,
            messages(
                output_config={"format": {"type": "json_schema", "schema": CITY}}, **NO_THINKING
            ),
        ),
    ):
        compact = recipe.prepare(protocol, body).grammar
        free = recipe.prepare(protocol, {**body, "json_whitespace": "any"}).grammar
        assert compact != free
        if compact.kind == "json":
            assert not _accepts(v41_grammar_compiler, tokenizer, compact, pretty)
            assert _accepts(v41_grammar_compiler, tokenizer, free, pretty)
    vllm = chat(structured_outputs={"json": CITY, "disable_any_whitespace": False})
    spec = recipe.prepare(Protocol.CHAT, {**vllm, **NO_THINKING}).grammar
    assert _accepts(v41_grammar_compiler, tokenizer, spec, pretty)
