"""Matchers and bitmasks with the real V4.1 vocabulary: every valid token is allowed at its step,
invalid ones are rejected, rollback restores the state, and masked sampling obeys the grammar."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from engine.structured import (
    DSML_MARKER,
    BatchBitmask,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    RequestMatcher,
    StepMask,
    apply_bitmask,
    apply_bitmask_reference,
    spec_for_constraint,
    unpack_bitmask_row,
)
from engine.structured.grammar import JSON_COMPACT_WHITESPACE, JSON_MAX_WHITESPACE
from tests.engine.structured.conftest import EOS_ID, V41_VOCAB_SIZE

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "role", "active", "address", "tags"],
    "additionalProperties": False,
}
PERSON = {
    "name": "Ann",
    "role": "admin",
    "active": True,
    "age": 41,
    "address": {"city": "Lyon", "zip": 69001},
    "tags": ["a", "c"],
}


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _allowed(matcher: RequestMatcher) -> torch.Tensor:
    mask = BatchBitmask(V41_VOCAB_SIZE).fill([matcher])
    assert mask is not None
    return unpack_bitmask_row(mask.bitmask, 0, V41_VOCAB_SIZE)


@pytest.fixture(scope="module")
def person_matcher_factory(compiler: GrammarCompiler):
    grammar = compiler.compile(GrammarSpec("json", json.dumps(PERSON_SCHEMA)))
    return lambda: RequestMatcher(grammar)


@pytest.mark.parametrize(
    ("json_whitespace", "dumps"),
    [
        (JSON_COMPACT_WHITESPACE, {"separators": (",", ":")}),
        (JSON_COMPACT_WHITESPACE, {}),  # ", " / ": "
        (JSON_MAX_WHITESPACE, {"indent": 2}),
    ],
)
def test_valid_document_is_allowed_token_by_token(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer, json_whitespace: int, dumps: dict
) -> None:
    spec = GrammarSpec("json", json.dumps(PERSON_SCHEMA), json_whitespace=json_whitespace)
    matcher = RequestMatcher(compiler.compile(spec))
    for token_id in _ids(v41_tokenizer, json.dumps(PERSON, **dumps)):
        assert _allowed(matcher)[token_id], v41_tokenizer.decode([token_id])
        assert not _allowed(matcher)[EOS_ID]
        assert matcher.accept([token_id])
    assert _allowed(matcher)[EOS_ID]
    assert matcher.accept([EOS_ID])
    assert matcher.is_terminated


def test_compact_json_refuses_whitespace_runs(compiler: GrammarCompiler, v41_tokenizer) -> None:
    # The degenerate output: `{"unit"\n\n\n\t  \n \n :` ran out of max_tokens.
    schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    compact = RequestMatcher(compiler.compile(GrammarSpec("json", json.dumps(schema))))
    free = RequestMatcher(
        compiler.compile(
            GrammarSpec("json", json.dumps(schema), json_whitespace=JSON_MAX_WHITESPACE)
        )
    )
    run = _ids(v41_tokenizer, '{"unit"\n\n\n\t  \n \n :')
    assert not compact.accept(run)
    assert free.accept(run)
    assert compact.accept(_ids(v41_tokenizer, '{"unit": "c"}'))


def test_invalid_continuation_is_rejected_and_leaves_the_state(
    person_matcher_factory, v41_tokenizer: Tokenizer
) -> None:
    matcher = person_matcher_factory()
    prefix = _ids(v41_tokenizer, '{"name": "Ann", "role": "')
    assert matcher.accept(prefix)
    before = _allowed(matcher)
    bad = _ids(v41_tokenizer, "root")  # not a prefix of any enum value
    assert not before[bad[0]]
    assert not matcher.accept(_ids(v41_tokenizer, "adm") + bad)  # all or nothing
    assert torch.equal(_allowed(matcher), before)
    assert matcher.accept(_ids(v41_tokenizer, 'user"'))


def test_rollback_restores_the_mask(person_matcher_factory, v41_tokenizer: Tokenizer) -> None:
    matcher = person_matcher_factory()
    assert matcher.accept(_ids(v41_tokenizer, '{"name": "A'))
    before = _allowed(matcher)
    more = _ids(v41_tokenizer, 'nn", "role": "guest", ')
    assert matcher.accept(more)
    assert not torch.equal(_allowed(matcher), before)
    matcher.rollback(len(more))
    assert torch.equal(_allowed(matcher), before)
    matcher.rollback(0)
    with pytest.raises(ValueError):
        matcher.rollback(-1)


def test_regex_must_match_fully(compiler: GrammarCompiler, v41_tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(GrammarSpec("regex", r"\d{3}-[a-z]+"))
    matcher = RequestMatcher(grammar)
    assert matcher.accept(_ids(v41_tokenizer, "123-"))
    assert not _allowed(matcher)[EOS_ID]  # [a-z]+ needs a letter
    assert not matcher.accept(_ids(v41_tokenizer, "4"))
    assert matcher.accept(_ids(v41_tokenizer, "abc"))
    assert matcher.accept([EOS_ID]) and matcher.is_terminated


def test_ebnf_grammar(compiler: GrammarCompiler, v41_tokenizer: Tokenizer) -> None:
    ebnf = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]+ "."'
    grammar = compiler.compile(GrammarSpec("ebnf", ebnf))
    matcher = RequestMatcher(grammar)
    assert matcher.accept(_ids(v41_tokenizer, "no because it rains."))
    assert matcher.accept([EOS_ID]) and matcher.is_terminated
    assert not RequestMatcher(grammar).accept(_ids(v41_tokenizer, "maybe"))


def _random_mask(num_rows: int, rows: list[int], vocab: int, seed: int) -> StepMask:
    generator = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (num_rows, words), generator=generator)
    return StepMask(bitmask=bitmask.to(torch.int32), rows=rows)


@pytest.mark.parametrize(("vocab", "rows"), [(V41_VOCAB_SIZE, [0, 2, 5]), (100, [1]), (64, [])])
def test_apply_matches_the_torch_reference(vocab: int, rows: list[int]) -> None:
    mask = _random_mask(6, rows, vocab, seed=vocab)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    fast, reference = logits.clone(), logits.clone()
    apply_bitmask(fast, mask)
    apply_bitmask_reference(reference, mask)
    assert torch.equal(fast, reference)
    untouched = [row for row in range(6) if row not in rows]
    assert torch.equal(fast[untouched], logits[untouched])
    for row in rows:
        allowed = unpack_bitmask_row(mask.bitmask, row, vocab)
        assert torch.equal(fast[row][allowed], logits[row][allowed])
        assert torch.isneginf(fast[row][~allowed]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "rows"), [(6, [0, 2, 5]), (256, list(range(0, 256, 3)))])
def test_cuda_apply_matches_the_torch_reference(num_rows: int, rows: list[int], dtype) -> None:
    mask = _random_mask(num_rows, rows, V41_VOCAB_SIZE, seed=num_rows)
    logits = torch.randn(num_rows, V41_VOCAB_SIZE, dtype=dtype)
    fast = logits.cuda()
    apply_bitmask(fast, mask)
    reference = logits.clone()
    apply_bitmask_reference(reference, mask)
    assert torch.equal(fast.cpu(), reference)


def test_terminated_matcher_allows_only_eos(compiler: GrammarCompiler) -> None:
    matcher = RequestMatcher(compiler.compile(GrammarSpec("regex", "")))
    assert matcher.accept([EOS_ID]) and matcher.is_terminated
    allowed = _allowed(matcher)
    assert allowed.nonzero().flatten().tolist() == [EOS_ID]


def test_apply_checks_shapes() -> None:
    mask = _random_mask(2, [0], 64, seed=0)
    with pytest.raises(ValueError, match="do not match"):
        apply_bitmask(torch.zeros(3, 64), mask)
    with pytest.raises(ValueError, match="width"):
        apply_bitmask(torch.zeros(2, 200), mask)


def test_masked_greedy_sampling_picks_allowed_tokens(
    compiler: GrammarCompiler, person_matcher_factory
) -> None:
    regex = RequestMatcher(compiler.compile(GrammarSpec("regex", r"[0-9]{2,5}")))
    matchers = [person_matcher_factory(), None, regex, None]
    batch = BatchBitmask(V41_VOCAB_SIZE)
    assert batch.fill([None, None]) is None
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        mask = batch.fill(matchers)
        assert mask is not None and mask.rows == [0, 2]
        logits = torch.randn(len(matchers), V41_VOCAB_SIZE, generator=generator)
        apply_bitmask(logits, mask)
        sampled = logits.argmax(dim=-1).tolist()
        for row in mask.rows:
            assert unpack_bitmask_row(mask.bitmask, row, V41_VOCAB_SIZE)[sampled[row]]
            if matchers[row].is_terminated:  # finished: only EOS stays allowed
                assert sampled[row] == EOS_ID
            else:
                assert matchers[row].accept([sampled[row]])


def test_greedy_generation_under_a_schema_yields_valid_json(
    person_matcher_factory, v41_tokenizer: Tokenizer
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    batch = BatchBitmask(V41_VOCAB_SIZE)
    generator = torch.Generator().manual_seed(1234)
    for _ in range(3):
        matcher = person_matcher_factory()
        output: list[int] = []
        while not matcher.is_terminated:
            assert len(output) < 2000, v41_tokenizer.decode(output)
            mask = batch.fill([matcher])
            logits = torch.randn(1, V41_VOCAB_SIZE, generator=generator)
            apply_bitmask(logits, mask)
            token_id = int(logits.argmax())
            assert matcher.accept([token_id])
            output.append(token_id)
        assert output[-1] == EOS_ID
        text = v41_tokenizer.decode(output[:-1], skip_special_tokens=False)
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


DSML_TOKEN_ID = 128825
FORECAST_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": None,
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["unit", "days"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]


def test_marker_guard_blocks_sub_token_spellings_of_dsml(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    assert compiler.guard_for(GrammarSpec("regex", "a")) is None
    spec = spec_for_constraint("tool_call_required", json.dumps(FORECAST_TOOLS))
    guard = compiler.guard_for(spec)
    assert guard is not None and guard.marker_id == DSML_TOKEN_ID
    assert compiler.marker_guard(DSML_MARKER) is guard and DSML_MARKER in compiler.prepared_markers
    with pytest.raises(GrammarError, match="not a single token"):
        compiler.marker_guard("｜not a marker｜")
    bar = _ids(v41_tokenizer, "｜")
    assert len(bar) == 1 and bar[0] in guard.blocked_ids
    matcher = RequestMatcher(compiler.compile(spec), guard)
    assert matcher.accept(_ids(v41_tokenizer, "\n\n<"))
    assert _allowed(matcher).nonzero().flatten().tolist() == [DSML_TOKEN_ID]
    unguarded = RequestMatcher(compiler.compile(spec))
    assert unguarded.accept(_ids(v41_tokenizer, "\n\n<"))
    assert _allowed(unguarded)[bar[0]]  # what the guard is for


def test_greedy_tool_call_uses_only_dsml_tokens(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer
) -> None:
    spec = spec_for_constraint("tool_call_required", json.dumps(FORECAST_TOOLS))
    grammar, guard = compiler.compile(spec), compiler.guard_for(spec)
    batch = BatchBitmask(V41_VOCAB_SIZE)
    generator = torch.Generator().manual_seed(7)
    for _ in range(1):
        matchers = [RequestMatcher(grammar, guard), None, RequestMatcher(grammar, guard)]
        outputs: list[list[int]] = [[], [], []]
        while not all(m is None or m.is_terminated for m in matchers):
            assert len(outputs[0]) < 3000
            mask = batch.fill(matchers)
            logits = torch.randn(len(matchers), V41_VOCAB_SIZE, generator=generator)
            apply_bitmask(logits, mask)
            for row in mask.rows:
                if not matchers[row].is_terminated:
                    token_id = int(logits[row].argmax())
                    assert matchers[row].accept([token_id])
                    outputs[row].append(token_id)
        for output in (outputs[0], outputs[2]):
            text = v41_tokenizer.decode(output[:-1], skip_special_tokens=False)
            assert text.startswith("\n\n<｜DSML｜ calls>") and text.endswith("</｜DSML｜ calls>")
            assert text.count("｜DSML｜") == output.count(DSML_TOKEN_ID) >= 6
