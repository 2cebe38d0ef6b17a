"""Grammar compilation: every kind, the cache, errors, the timeout, tool-call structural tags."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from tokenizers import Tokenizer

from engine.structured import (
    BatchBitmask,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    RequestMatcher,
    spec_for_constraint,
    unpack_bitmask_row,
)
from tests.engine.structured.conftest import EOS_ID, V41_VOCAB_SIZE

DSML_TOKEN_ID = 128825
THINK_END_ID = 128822

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": None,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
            "strict": None,
        },
    }
]


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _accepts_text(compiler: GrammarCompiler, spec: GrammarSpec, ids: list[int]) -> bool:
    matcher = RequestMatcher(compiler.compile(spec))
    return matcher.accept([*ids, EOS_ID]) and matcher.is_terminated


def test_tokenizer_info_matches_the_model(compiler: GrammarCompiler) -> None:
    info = compiler.tokenizer_info
    assert info.vocab_size == V41_VOCAB_SIZE
    assert info.stop_token_ids == [EOS_ID]
    assert info.vocab_type.name == "BYTE_LEVEL"
    decoded = info.decoded_vocab
    assert decoded[THINK_END_ID] == b"</think>"
    assert decoded[DSML_TOKEN_ID] == "｜DSML｜".encode()
    assert decoded[1000] == " в".encode()  # byte-level "Ġ" decodes to a space


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("json", '{"type":'), "invalid JSON schema"),
        (GrammarSpec("json", '{"type": "nope"}'), 'Unsupported type "nope"'),
        (GrammarSpec("regex", "(ab"), "parenthesis is not closed"),
        (GrammarSpec("ebnf", "root ::= foo"), 'Rule "foo" is not defined'),
        (GrammarSpec("structural_tag", "{}"), "invalid structural tag"),
    ],
)
def test_invalid_sources_raise_grammar_error(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(spec)
    assert "/project/cpp" not in str(info.value)
    with pytest.raises(GrammarError, match=message):
        asyncio.run(compiler.compile_async(spec, timeout_s=5.0))


def test_unknown_kinds_are_rejected() -> None:
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("xml", "")
    with pytest.raises(GrammarError, match="unknown output constraint kind"):
        spec_for_constraint("yaml", "")


def test_cache_returns_the_same_object(compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("regex", "[a-c]{2,4}")
    first = compiler.compile(spec)
    assert compiler.compile(GrammarSpec("regex", "[a-c]{2,4}")) is first
    assert asyncio.run(compiler.compile_async(spec, timeout_s=1.0)) is first


def test_lru_evicts_the_least_recently_used(v41_tokenizer: Tokenizer) -> None:
    small = GrammarCompiler(
        GrammarCompiler.for_tokenizer(v41_tokenizer, V41_VOCAB_SIZE, EOS_ID).tokenizer_info,
        cache_size=2,
    )
    a, b, c = (GrammarSpec("regex", pattern) for pattern in ("a+", "b+", "c+"))
    grammar_a = small.compile(a)
    small.compile(b)
    assert small.compile(a) is grammar_a  # a is now the most recent
    small.compile(c)  # evicts b
    assert small.cached(b) is None
    assert small.cached(a) is grammar_a


def _nested_one_of(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {
            "oneOf": [
                {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}},
                {"type": "array", "items": schema},
                schema,
            ]
        }
    return schema


def test_pathological_schema_times_out_quickly(compiler: GrammarCompiler) -> None:
    # Depth 8 compiles in ~4 s here (x3 per level): well past the timeout, yet the compilation
    # that keeps running in its thread after the timeout does not hog the rest of the session.
    spec = GrammarSpec("json", json.dumps(_nested_one_of(8)))
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="exceeded the 0.2 s timeout"):
        asyncio.run(compiler.compile_async(spec, timeout_s=0.2))
    assert time.perf_counter() - start < 2.0


def test_json_object_accepts_any_object_only(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("json", "")
    assert _accepts_text(compiler, spec, _ids(v41_tokenizer, '{"x": [1, {"y": null}], "z": "w"}'))
    assert not _accepts_text(compiler, spec, _ids(v41_tokenizer, "[1, 2]"))


def test_thinking_applies_the_constraint_after_the_think_end_token(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("regex", "(yes|no)", thinking=True)
    reasoning = _ids(v41_tokenizer, "Let me think: maybe {not json}.")
    assert _accepts_text(compiler, spec, [*reasoning, THINK_END_ID, *_ids(v41_tokenizer, "yes")])
    # The textual spelling of </think> from ordinary tokens does not end reasoning.
    spelled = _ids(v41_tokenizer, "</") + _ids(v41_tokenizer, "think>")
    assert THINK_END_ID not in spelled
    assert not _accepts_text(compiler, spec, [*reasoning, *spelled, *_ids(v41_tokenizer, "yes")])
    assert not _accepts_text(compiler, spec, [*reasoning, *_ids(v41_tokenizer, "yes")])
    json_spec = spec_for_constraint("json", "", thinking=True)
    answer = _ids(v41_tokenizer, '{"a": 1}')
    assert _accepts_text(compiler, json_spec, [*reasoning, THINK_END_ID, *answer])


def _dsml_call(city: str, days: int) -> str:
    return (
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        f'<｜DSML｜ parameter name="city" string="true">{city}</｜DSML｜ parameter>\n'
        f'<｜DSML｜ parameter name="days" string="false">{days}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )


def test_tool_call_auto_allows_text_and_valid_calls(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("tool_call", json.dumps(WEATHER_TOOLS))
    assert spec.kind == "structural_tag"
    assert _accepts_text(compiler, spec, _ids(v41_tokenizer, "It is sunny today."))
    call = _ids(v41_tokenizer, "Checking.\n\n" + _dsml_call("Paris", 3))
    assert DSML_TOKEN_ID in call
    assert _accepts_text(compiler, spec, call)
    bad_args = _ids(v41_tokenizer, "Checking.\n\n" + _dsml_call("Paris", 3).replace(">3<", ">x<"))
    assert not _accepts_text(compiler, spec, bad_args)
    unknown_tool = _dsml_call("Paris", 3).replace("get_weather", "get_time")
    assert not _accepts_text(compiler, spec, _ids(v41_tokenizer, unknown_tool))


def test_tool_call_required_forces_a_call(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("tool_call_required", json.dumps(WEATHER_TOOLS))
    assert not _accepts_text(compiler, spec, _ids(v41_tokenizer, "It is sunny today."))
    assert _accepts_text(compiler, spec, _ids(v41_tokenizer, "\n\n" + _dsml_call("Oslo", 1)))


def test_tool_call_in_thinking_mode_starts_inside_reasoning(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("tool_call_required", json.dumps(WEATHER_TOOLS), thinking=True)
    text = "I should call the tool.</think>\n\n" + _dsml_call("Rome", 2)
    ids = _ids(v41_tokenizer, text)
    assert THINK_END_ID in ids
    assert _accepts_text(compiler, spec, ids)
    spelled = _ids(v41_tokenizer, "I should call the tool.</") + _ids(v41_tokenizer, "think>")
    assert THINK_END_ID not in spelled
    call = _ids(v41_tokenizer, "\n\n" + _dsml_call("Rome", 2))
    assert not _accepts_text(compiler, spec, spelled + call)


def _agent_tools(num_tools: int, max_length: int) -> list[dict]:
    """A coding agent's tool set: each tool has bounded raw-string parameters (e.g.
    `"maxLength": 256` on a search query, `524288` on a script), the shape that made xgrammar
    expand one rule per allowed character in DSML strings."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": None,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "maxLength": max_length},
                        "cursor": {"type": "string", "minLength": 1, "maxLength": max_length},
                        "limit": {"type": "integer", "minimum": 1},
                    },
                    "additionalProperties": False,
                },
                "strict": None,
            },
        }
        for i in range(num_tools)
    ]


def test_agent_tool_sets_with_string_bounds_compile_fast(
    v41_tokenizer: Tokenizer,
) -> None:
    # Before: one string parameter with maxLength 256 took ~13 s to compile on 2 cores.
    compiler = GrammarCompiler.for_tokenizer(v41_tokenizer, V41_VOCAB_SIZE, EOS_ID)
    spec = spec_for_constraint("tool_call", json.dumps(_agent_tools(4, 256)), thinking=True)
    start = time.monotonic()
    compiler.compile(spec)
    assert time.monotonic() - start < 5.0
    # Raw-string length bounds are not enforced in DSML tool calls (documented rule): a
    # 300-character query is accepted, the integer bound still is enforced.
    call = (
        "done</think>\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="tool_1">\n'
        f'<｜DSML｜ parameter name="query" string="true">{"a" * 300}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">{limit}</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )
    assert _accepts_text(compiler, spec, _ids(v41_tokenizer, call.replace("{limit}", "3")))
    assert not _accepts_text(compiler, spec, _ids(v41_tokenizer, call.replace("{limit}", "0")))


def test_invalid_tool_list_is_a_grammar_error() -> None:
    with pytest.raises(GrammarError, match="invalid tool list"):
        spec_for_constraint("tool_call", "[{")
    with pytest.raises(GrammarError, match="invalid tool list"):
        spec_for_constraint("tool_call_required", "[]")


def test_a_busy_compiler_refuses_instead_of_piling_up(v41_tokenizer: Tokenizer) -> None:
    from engine.structured import GrammarCompilerBusyError

    compiler = GrammarCompiler.for_tokenizer(
        v41_tokenizer, V41_VOCAB_SIZE, EOS_ID, max_compilations=1
    )
    slow = GrammarSpec("json", json.dumps({"type": "string", "pattern": "^([a-z]{1,30}-){1,30}$"}))

    async def scenario() -> None:
        with pytest.raises(GrammarError, match="exceeded"):
            await compiler.compile_async(slow, timeout_s=0.1)
        # The abandoned compilation still holds the only slot.
        with pytest.raises(GrammarCompilerBusyError):
            await compiler.compile_async(GrammarSpec("regex", "a+"), timeout_s=0.1)
        # A cached grammar needs no slot; once the slot frees, compilation works again.
        assert await compiler.compile_async(slow, timeout_s=30.0) is compiler.cached(slow)
        assert await compiler.compile_async(GrammarSpec("regex", "a+"), timeout_s=5.0)

    asyncio.run(scenario())


_EXIT_SCRIPT = """
import asyncio, atexit, json
import xgrammar as xgr

compiled_before_finalising = []
# Registered before the compile thread starts (and with it the grammar exit hook): runs last.
atexit.register(lambda: print("compiled at exit:", compiled_before_finalising[0]()))

from engine.structured import GrammarCompiler, GrammarError, GrammarSpec

vocab = [chr(c) for c in range(32, 127)] + [a + b for a in "abcdefghij-" for b in "abcdefghij-"]
info = xgr.TokenizerInfo(vocab, vocab_size=len(vocab) + 1, stop_token_ids=[len(vocab)])
compiler = GrammarCompiler(info)
slow = GrammarSpec("json", json.dumps({"type": "string", "pattern": "^([a-z]{1,200}-){1,200}$"}))
compiled_before_finalising.append(lambda: compiler.cached(slow) is not None)
try:
    asyncio.run(compiler.compile_async(slow, timeout_s=0.01))
except GrammarError:
    print("timed out")
"""


@pytest.mark.slow  # ~6 s of pathological compiles
def test_exit_waits_for_abandoned_compilations() -> None:
    # A compilation thread finishing while the interpreter finalises aborts the process (its
    # C++ frames are unwound by pthread_exit), so exit must wait for it.
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[3],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["timed out", "compiled at exit: True"]


PLACEHOLDER_ID = 128706  # <｜place▁holder▁no▁706｜>
USER_TOKEN = "<｜User｜>"


def _allows(matcher: RequestMatcher, token_id: int) -> bool:
    mask = BatchBitmask(V41_VOCAB_SIZE).fill([matcher])
    assert mask is not None
    return bool(unpack_bitmask_row(mask.bitmask, 0, V41_VOCAB_SIZE)[token_id])


def _string_schema() -> str:
    return json.dumps(
        {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}
    )


@pytest.mark.parametrize(
    ("spec", "prefix"),
    [
        (spec_for_constraint("json", _string_schema()), '{"c": "ab'),
        (spec_for_constraint("json", _string_schema(), thinking=True), 'hm</think>{"c": "ab'),
        (spec_for_constraint("json", ""), '{"c": "ab'),
        (
            spec_for_constraint("tool_call_required", json.dumps(WEATHER_TOOLS)),
            '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
            '<｜DSML｜ parameter name="city" string="true">Os',
        ),
        (spec_for_constraint("regex", ".*"), "ab"),
    ],
)
def test_added_tokens_are_never_allowed_inside_constrained_output(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer, spec: GrammarSpec, prefix: str
) -> None:
    # xgrammar alone takes an added token for its literal spelling: valid string content.
    bare = RequestMatcher(compiler.compile(spec))
    assert bare.accept(_ids(v41_tokenizer, prefix))
    assert _allows(bare, PLACEHOLDER_ID)
    matcher = compiler.constraint(spec).new_matcher()
    assert matcher.accept(_ids(v41_tokenizer, prefix))
    assert not _allows(matcher, PLACEHOLDER_ID)
    assert not _allows(matcher, v41_tokenizer.token_to_id(USER_TOKEN))
    assert _allows(matcher, _ids(v41_tokenizer, "x")[0])  # ordinary text still flows


def test_tokens_a_grammar_names_stay_allowed(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    thinking = compiler.constraint(spec_for_constraint("regex", "ok", thinking=True))
    assert _allows(thinking.new_matcher(), THINK_END_ID)
    tool = compiler.constraint(spec_for_constraint("tool_call", json.dumps(WEATHER_TOOLS)))
    matcher = tool.new_matcher()
    assert matcher.accept(_ids(v41_tokenizer, "\n\n<"))
    assert _allows(matcher, DSML_TOKEN_ID)
    named = compiler.constraint(GrammarSpec("regex", f"a{USER_TOKEN}b")).new_matcher()
    assert named.accept(_ids(v41_tokenizer, "a"))
    assert _allows(named, v41_tokenizer.token_to_id(USER_TOKEN))
    done = compiler.constraint(GrammarSpec("regex", "a")).new_matcher()
    assert done.accept(_ids(v41_tokenizer, "a"))
    assert _allows(done, EOS_ID)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({"type": "object", "properties": {"n": {"not": {"type": "null"}}}}, "not"),
        ({"if": {"type": "integer"}, "then": {"minimum": 3}}, "if"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
        ({"type": "string", "format": "iri"}, "format 'iri'"),
        ({"$defs": {"d": {"type": "string", "format": "bogus"}}, "$ref": "#/$defs/d"}, "bogus"),
    ],
)
def test_unenforced_keywords_are_refused_by_name(schema: dict, keyword: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(keyword)):
        spec_for_constraint("json", json.dumps(schema))
    with pytest.raises(GrammarError, match=re.escape(keyword)):
        spec_for_constraint("json", json.dumps(schema), thinking=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": schema}}}}]  # fmt: skip
    with pytest.raises(GrammarError, match=r"tool 'f' parameters.*" + re.escape(keyword)):
        spec_for_constraint("tool_call", json.dumps(tools))


# Each pair xgrammar 0.2.9 compiles with one keyword dropped (or loosened): the instance on the
# right violates the schema, yet its grammar accepts it.
IGNORED_COMBINATIONS = [
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'maxLength' together with 'pattern'"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' together with 'pattern'"),
    ({"type": "string", "format": "email", "maxLength": 5}, "'maxLength' together with 'format'"),
    ({"type": "string", "format": "date", "maxLength": 5}, "'maxLength' together with 'format'"),
    ({"type": "string", "format": "email", "pattern": "^[a-z]+$"}, "'pattern' together with"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "'multipleOf' together with 'minimum'"),
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}, "a lookaround assertion"),
    ({"type": "string", "pattern": "a^b"}, "an anchor"),
    ({"type": "string", "enum": ["a", 1]}, "'type' together with 'enum'"),
    ({"type": "string", "const": "abc", "pattern": "^x$"}, "'pattern' together with 'const'"),
    ({"anyOf": [{"type": "string"}], "maxLength": 1}, "'maxLength' together with 'anyOf'"),
    ({"$defs": {"o": {"type": "object"}}, "$ref": "#/$defs/o", "required": ["b"]}, "'required'"),
    ({"enum": [1], "minimum": "x"}, "'minimum' together with 'enum'"),  # jsonschema raises
]


@pytest.mark.parametrize(("schema", "keyword"), IGNORED_COMBINATIONS)
def test_keywords_xgrammar_drops_in_combination_are_refused_with_their_path(
    schema: dict, keyword: str
) -> None:
    wrapped = {
        "type": "object",
        "properties": {"v": {"type": "object", "properties": {"w": schema}}},
    }
    where = re.escape(keyword) + r".*\(at /properties/v/properties/w\)"
    with pytest.raises(GrammarError, match=where):
        spec_for_constraint("json", json.dumps(wrapped))
    with pytest.raises(GrammarError, match=where):
        spec_for_constraint("json", json.dumps(wrapped), thinking=True)
    for strict in (True, None):
        function = {"name": "f", "parameters": wrapped, **({"strict": strict} if strict else {})}
        tools = [{"type": "function", "function": function}]
        with pytest.raises(GrammarError, match=r"tool 'f' parameters.*" + where):
            spec_for_constraint("tool_call", json.dumps(tools))


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
        ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
        ({"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"'),
        ({"type": "string", "format": "date-time"}, '"2020-01-01T00:00:00Z"', '"noon"'),
        ({"type": "integer", "minimum": 3, "exclusiveMaximum": 5}, "4", "5"),
        ({"type": "integer", "multipleOf": 2}, "4", "3"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
        ({"const": "k"}, '"k"', '"j"'),
        ({"type": "array", "items": {"enum": ["a", "b"]}}, '["a"]', '["c"]'),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1, 1]", "[1.5]"),
        # combinations whose pattern, format or values already imply the other keyword
        ({"type": "string", "pattern": "^[0-9]{5}$", "maxLength": 5}, '"01234"', '"0123"'),
        ({"type": "string", "format": "date", "minLength": 10}, '"2024-02-29"', '"2023-02-29"'),
        ({"type": "string", "enum": ["a", "bb"], "maxLength": 2}, '"bb"', '"c"'),
        ({"anyOf": [{"type": "string"}, {"type": "null"}], "title": "t"}, "null", "1"),
        ({"type": "string", "pattern": "^a$|^b$"}, '"b"', '"ab"'),
    ],
)
def test_accepted_keywords_are_enforced(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer, schema: dict, good: str, bad: str
) -> None:
    spec = spec_for_constraint("json", json.dumps(schema))
    assert _accepts_text(compiler, spec, _ids(v41_tokenizer, good))
    assert not _accepts_text(compiler, spec, _ids(v41_tokenizer, bad))


@pytest.mark.parametrize("where", ["answer", "answer-after-thinking", "tool-argument"])
def test_length_bounded_json_strings_are_valid_json(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer, where: str
) -> None:
    # xgrammar alone let a raw tab into a `maxLength` string (`{"note": ">\tdbmv"}`, which
    # json.loads refuses) and allowed no escapes in it.
    note = {
        "type": "object",
        "properties": {"note": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["note"],
        "additionalProperties": False,
    }
    if where == "tool-argument":
        wrapper = {"type": "object", "properties": {"arg": note}, "required": ["arg"]}
        tools = [{"type": "function", "function": {"name": "f", "parameters": wrapper}}]
        spec = spec_for_constraint("tool_call_required", json.dumps(tools))

        def text(value: str) -> str:
            return (
                '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="arg" '
                f'string="false">{value}</｜DSML｜ parameter>\n'
                "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
            )
    else:
        thinking = where == "answer-after-thinking"
        spec = spec_for_constraint("json", json.dumps(note), thinking=thinking)

        def text(value: str) -> str:
            return f"hm</think>{value}" if thinking else value

    def accepts(value: str) -> bool:
        return _accepts_text(compiler, spec, _ids(v41_tokenizer, text(value)))

    assert accepts('{"note": "ab"}')
    assert not accepts('{"note": "a\tb"}')  # a raw control character
    assert not accepts('{"note": "a\x00"}')
    assert accepts('{"note": "a\\tb"}')  # escapes count as one character each
    assert accepts('{"note": "\\"\\\\\\u00e9x"}')
    assert not accepts('{"note": "abcde"}')
    assert not accepts('{"note": "a"}')
