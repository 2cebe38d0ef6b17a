"""Strict string formats: the patterns accept exactly what standard validators accept."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import re

import pytest
from tokenizers import Tokenizer

from engine.structured import GrammarCompiler, RequestMatcher, spec_for_constraint
from engine.structured.formats import (
    STRICT_FORMAT_PATTERNS,
    strict_formats,
    unenforced_keyword,
    with_inferred_types,
)
from tests.engine.structured.conftest import EOS_ID


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def test_date_pattern_equals_the_calendar() -> None:
    pattern = re.compile(STRICT_FORMAT_PATTERNS["date"])
    years = ["0000", "0001", "0004", "0100", "0400", "1900", "2000", "2023", "2024", "9996"]
    for year, month, day in itertools.product(years, range(0, 14), range(0, 33)):
        text = f"{year}-{month:02d}-{day:02d}"
        assert bool(pattern.fullmatch(text)) == _is_date(text), text


def test_ipv4_pattern_equals_ipaddress() -> None:
    pattern = re.compile(STRICT_FORMAT_PATTERNS["ipv4"])
    octets = ["0", "00", "01", "9", "10", "099", "100", "199", "200", "249", "250", "255", "256"]
    for a, b in itertools.product(octets, repeat=2):
        text = f"{a}.{b}.1.2"
        assert bool(pattern.fullmatch(text)) == _is_ipv4(text), text


def test_strict_formats_rewrites_nested_schemas_but_not_literals() -> None:
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "hosts": {"type": "array", "items": {"type": "string", "format": "ipv4"}},
            "id": {"type": "string", "format": "uuid"},
            "custom": {"type": "string", "format": "date", "pattern": "^2024"},
            "format": {"const": {"format": "date"}},
        },
    }
    fixed = strict_formats(schema)
    props = fixed["properties"]
    assert props["when"] == {"type": "string", "pattern": STRICT_FORMAT_PATTERNS["date"]}
    assert props["hosts"]["items"]["pattern"] == STRICT_FORMAT_PATTERNS["ipv4"]
    assert props["id"] == schema["properties"]["id"]
    assert props["custom"] == schema["properties"]["custom"]
    assert props["format"] == {"const": {"format": "date"}}
    assert schema["properties"]["when"]["format"] == "date"  # the input is not mutated


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ('"2024-02-29"', True),
        ('"2023-02-29"', False),
        ('"2023-04-31"', False),
        ('"0000-01-01"', False),
        ('"1999-12-31"', True),
    ],
)
def test_constrained_dates_are_valid_dates(
    compiler: GrammarCompiler, v41_tokenizer: Tokenizer, value: str, ok: bool
) -> None:
    spec = spec_for_constraint("json", json.dumps({"type": "string", "format": "date"}))
    ids = v41_tokenizer.encode(value, add_special_tokens=False).ids
    assert RequestMatcher(compiler.compile(spec)).accept([*ids, EOS_ID]) is ok


def test_enum_and_const_schemas_get_the_type_of_their_values() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"enum": ["x", "y"]},
            "b": {"const": 3},
            "c": {"enum": [1, 2.5, None]},
            "d": {"type": "array", "items": {"enum": [True, "no"]}},
            "e": {"anyOf": [{"const": "k"}, {"type": "null"}]},
            "f": {"enum": ["x"], "type": "string", "description": "kept"},
            "g": {"$ref": "#/$defs/G"},
        },
        "$defs": {"G": {"const": {"k": 1}}},
    }
    typed = with_inferred_types(schema)
    props = typed["properties"]
    assert props["a"] == {"enum": ["x", "y"], "type": "string"}
    assert props["b"]["type"] == "integer"
    assert props["c"]["type"] == ["number", "null"]
    assert props["d"]["items"]["type"] == ["boolean", "string"]
    assert props["e"]["anyOf"][0]["type"] == "string"
    assert props["f"] == schema["properties"]["f"]
    assert props["g"] == {"$ref": "#/$defs/G"}
    assert typed["$defs"]["G"]["type"] == "object"
    assert "type" not in schema["properties"]["a"]  # the input is not changed


def test_property_names_are_not_mistaken_for_keywords() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "null"}}}
    assert unenforced_keyword(schema) is None
    nested = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    assert "'uniqueItems' (at /properties/x)" in unenforced_keyword(nested)
