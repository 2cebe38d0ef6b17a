"""JSON Schema preparation for xgrammar: exact formats, enforced keywords, inferred types.

Formats: xgrammar's builtin `format` grammars accept some strings that standard validators (Python's
`jsonschema` format checker, RFC 3339 / `ipaddress`) reject: `date` accepts `2023-02-31` and
year `0000`; `ipv4` accepts leading zeros (`01.2.3.4`). `strict_formats` replaces such a
`format` with an equivalent `pattern` that accepts exactly the valid strings, so a constrained
answer validates wherever it is checked. A string schema that already has a `pattern` keeps its
format (the two cannot be merged into one pattern).

Keywords: `unenforced_keyword` finds the validation keywords (and formats) that xgrammar 0.2.9
compiles without enforcing, so that a request using one is refused instead of silently
getting a looser grammar; that includes keywords it drops only in combination (a length
bound beside a `pattern`, keywords beside `enum` or `$ref`, ...: see "ignored combinations").
Types: `with_inferred_types` gives `enum` / `const` schemas without
a `type` the type of their values (the recipe's strict-mode checks require one).
"""

from __future__ import annotations

import re
from re import _constants as re_constants
from re import _parser as re_parser
from typing import Any

import jsonschema

_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
# Leap years: divisible by 4 but not by 100 (last two digits), or by 400 (first two, year > 0).
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
    "|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    "|02-(0[1-9]|1[0-9]|2[0-8]))"
)

_LITERAL_KEYWORDS = frozenset({"enum", "const", "default", "examples"})

STRICT_FORMAT_PATTERNS = {
    "date": f"^({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
}


def strict_formats(schema: Any) -> Any:
    """A copy of `schema` with every loosely enforced `format` replaced by its exact pattern.

    Walks nested schemas wherever they can appear (any dict or list value except literal
    values: `enum`, `const`, `default`, `examples`); everything else is kept as it is.
    """
    if isinstance(schema, list):
        return [strict_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {
        key: value if key in _LITERAL_KEYWORDS else strict_formats(value)
        for key, value in schema.items()
    }
    name = result.get("format")
    pattern = STRICT_FORMAT_PATTERNS.get(name) if isinstance(name, str) else None
    if pattern is not None and "pattern" not in result:
        del result["format"]
        result["pattern"] = pattern
    return result


# ---------------------------------------------------------------- schema structure

# Where a schema holds sub-schemas: one schema, a list of schemas, or a name -> schema map.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Validation keywords xgrammar 0.2.9 compiles without enforcing (measured: a violating
# instance is accepted), with the one value that is neutral where there is one.
_UNENFORCED = {
    "uniqueItems": (False,),
    "contains": (),
    "minContains": (),
    "maxContains": (),
    "dependentRequired": (),
    "dependentSchemas": (),
    "dependencies": (),
    "not": (),
    "if": (),
    "then": (),
    "else": (),
    "contentEncoding": (),
    "contentMediaType": (),
    "contentSchema": (),
    "$dynamicRef": (),
    "$recursiveRef": (),
}
# String formats xgrammar enforces (others are compiled as plain strings).
ENFORCED_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))


def _subschemas(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path suffix, sub-schema) for every schema nested directly in `schema`."""
    found: list[tuple[str, Any]] = []
    for key in _ONE_SCHEMA:
        if isinstance(schema.get(key), dict):
            found.append((f"/{key}", schema[key]))
    for key in _SCHEMA_LIST:
        if isinstance(schema.get(key), list):
            found += [(f"/{key}/{i}", item) for i, item in enumerate(schema[key])]
    for key in _SCHEMA_MAP:
        if isinstance(schema.get(key), dict):
            found += [(f"/{key}/{name}", sub) for name, sub in schema[key].items()]
    return found


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The first JSON Schema keyword in `schema` (nested schemas included) that xgrammar would
    accept without enforcing, as a message naming it and where it is; None when all are
    enforced. Annotations (`title`, `description`, `default`, `examples`, ...) and unknown
    (non-JSON-Schema) keys are not keywords and pass.
    """
    if not isinstance(schema, dict):
        return None
    where = path or "/"
    for key, neutral in _UNENFORCED.items():
        if key in schema and schema[key] not in neutral:
            return f"JSON Schema keyword '{key}' (at {where}) is not supported"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"JSON Schema keyword 'allOf' of several schemas (at {where}) is not supported"
    name = schema.get("format")
    if name is not None and name not in ENFORCED_FORMATS:
        known = ", ".join(sorted(ENFORCED_FORMATS))
        return f"JSON Schema format {name!r} (at {where}) is not supported; supported: {known}"
    for check in _IGNORED_COMBINATIONS:
        message = check(schema, where)
        if message is not None:
            return message
    for suffix, sub in _subschemas(schema):
        message = unenforced_keyword(sub, path + suffix)
        if message is not None:
            return message
    return None


# ---------------------------------------------------------------- ignored combinations
# Keywords xgrammar 0.2.9 enforces alone but drops (or loosens) next to another keyword; each
# check below returns the message refusing such a schema, or None. Measured with a violating
# instance (`tests/engine/structured/test_grammar.py`).

_ASSERTIONS = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "unevaluatedItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
    }
)
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_RANGE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Lengths of the strings a format accepts, where fixed (others: unbounded).
_FORMAT_WIDTHS = {"uuid": (36, 36)}
_LENGTH_ADVICE = {
    "pattern": "bound the length inside the pattern instead (e.g. '^[a-z]{1,8}$')",
    "format": "drop the length bound, or replace the format with a pattern that bounds it",
}
_AT_START = (re_constants.AT_BEGINNING, re_constants.AT_BEGINNING_STRING)
_AT_END = (re_constants.AT_END, re_constants.AT_END_STRING)


def _length_beside_pattern(schema: dict[str, Any], where: str) -> str | None:
    """`minLength` / `maxLength` next to `pattern` or `format`: xgrammar keeps only the latter.
    Allowed where the pattern (or format) already implies the bounds, e.g. `^[0-9]{5}$` with
    `maxLength: 5`."""
    bounds = [k for k in ("minLength", "maxLength") if k in schema]
    if schema.get("minLength") == 0:
        bounds.remove("minLength")
    other = "pattern" if "pattern" in schema else "format" if "format" in schema else None
    if not bounds or other is None:
        return None
    width = _string_width(schema)
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if width is not None and width[0] >= low and (high is None or width[1] <= high):
        return None
    advice = _LENGTH_ADVICE[other]
    return (
        f"JSON Schema keyword '{bounds[0]}' together with '{other}' (at {where}) is not "
        f"supported: the grammar enforces the {other} only; {advice}"
    )


def _pattern_beside_format(schema: dict[str, Any], where: str) -> str | None:
    """`pattern` next to an enforced `format`: xgrammar keeps only the format."""
    if "pattern" in schema and schema.get("format") in ENFORCED_FORMATS:
        return (
            f"JSON Schema keyword 'pattern' together with 'format' (at {where}) is not "
            "supported: the grammar enforces the format only; use one of them"
        )
    return None


def _loose_multiple_of(schema: dict[str, Any], where: str) -> str | None:
    """`multipleOf` is enforced only on integers without a range (xgrammar drops it on numbers,
    untyped schemas and, for some ranges, next to `minimum` / `maximum`)."""
    if "multipleOf" not in schema:
        return None
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    ranged = [k for k in _RANGE_KEYWORDS if k in schema]
    if "integer" in types and not {"number", None} & set(types) and not ranged:
        return None
    beside = f" together with '{ranged[0]}'" if ranged else ""
    return (
        f"JSON Schema keyword 'multipleOf'{beside} (at {where}) is not supported: it is "
        "enforced only on type 'integer' without minimum/maximum"
    )


def _assertions_beside_literals(schema: dict[str, Any], where: str) -> str | None:
    """Keywords next to `enum` / `const`: xgrammar allows every listed value regardless, so they
    must hold for each value (a `type` matching the values is fine)."""
    literal = "enum" if "enum" in schema else "const" if "const" in schema else None
    if literal is None:
        return None
    values = schema["enum"] if literal == "enum" else [schema["const"]]
    rest = {k: v for k, v in schema.items() if k in _ASSERTIONS - {"enum", "const"}}
    if not rest or not isinstance(values, list):
        return None
    if "$ref" in rest:
        keyword = "$ref"
    else:
        checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
        validator = jsonschema.Draft202012Validator(rest, format_checker=checker)
        try:
            error = next((e for v in values for e in validator.iter_errors(v)), None)
        except Exception:  # jsonschema raises several kinds for a malformed or unresolvable one
            keyword = sorted(rest)[0]
        else:
            if error is None:
                return None
            keyword = str(error.validator)
    return (
        f"JSON Schema keyword '{keyword}' together with '{literal}' (at {where}) is not "
        f"supported: the grammar allows every '{literal}' value, and not all satisfy it"
    )


def _assertions_beside_combinators(schema: dict[str, Any], where: str) -> str | None:
    """Keywords next to `$ref`, `anyOf`, `oneOf` or `allOf`: xgrammar uses the combinator
    alone."""
    combinator = next((k for k in _COMBINATORS if k in schema), None)
    if combinator is None:
        return None
    rest = sorted(k for k in schema if k in _ASSERTIONS and k != combinator)
    if not rest:
        return None
    return (
        f"JSON Schema keyword '{rest[0]}' together with '{combinator}' (at {where}) is not "
        f"supported: the grammar enforces the '{combinator}' alone; move '{rest[0]}' into "
        "its schemas"
    )


def _ignored_pattern_syntax(schema: dict[str, Any], where: str) -> str | None:
    """Lookaround assertions and anchors inside a `pattern`: xgrammar ignores them (it matches
    the whole string, so only a leading `^` and a trailing `$` of a top-level branch are
    no-ops)."""
    pattern = schema.get("pattern")
    if not isinstance(pattern, str):
        return None
    try:
        parsed = re_parser.parse(pattern)
    except (re.error, OverflowError, RecursionError):
        parsed = None
    if parsed is None:
        found = "lookaround '(?'" if re.search(r"\(\?<?[=!]", pattern) else None
    else:
        found = _ignored_regex_item(parsed, True, True)
    if found is None:
        return None
    return (
        f"{found} in JSON Schema keyword 'pattern' (at {where}) is not supported: the grammar "
        "ignores it"
    )


def _ignored_regex_item(sub: Any, at_start: bool, at_end: bool) -> str | None:
    """The first lookaround, or anchor not at an edge of the whole match, in a parsed regex
    (`re._parser` items); `at_start` / `at_end`: `sub` begins / ends where the match does."""
    items = list(sub)
    for i, (op, arg) in enumerate(items):
        starts, ends = at_start and i == 0, at_end and i == len(items) - 1
        if op is re_constants.AT and not (starts and arg in _AT_START or ends and arg in _AT_END):
            return "an anchor ('^', '$', '\\b') inside the pattern"
        if op in (re_constants.ASSERT, re_constants.ASSERT_NOT):
            return "a lookaround assertion"
        edges = op in (re_constants.BRANCH, re_constants.SUBPATTERN)
        for nested in _regex_children(op, arg):
            found = _ignored_regex_item(nested, starts and edges, ends and edges)
            if found is not None:
                return found
    return None


def _regex_children(op: Any, arg: Any) -> list[Any]:
    if op is re_constants.BRANCH:
        return list(arg[1])
    if op is re_constants.SUBPATTERN:
        return [arg[-1]]
    if op in (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT, re_constants.POSSESSIVE_REPEAT):
        return [arg[2]]
    if op is re_constants.GROUPREF_EXISTS:
        return [a for a in arg[1:] if a is not None]
    return []


def _string_width(schema: dict[str, Any]) -> tuple[int, int] | None:
    """(shortest, longest) length of the strings `schema`'s pattern or format accepts, or None
    when unknown."""
    pattern = schema.get("pattern")
    name = schema.get("format")
    if pattern is None and isinstance(name, str):
        pattern = STRICT_FORMAT_PATTERNS.get(name)
        if pattern is None:
            return _FORMAT_WIDTHS.get(name)
    if not isinstance(pattern, str):
        return None
    try:
        return re_parser.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError):
        return None


_IGNORED_COMBINATIONS = (
    _length_beside_pattern,
    _pattern_beside_format,
    _loose_multiple_of,
    _assertions_beside_literals,
    _assertions_beside_combinators,
    _ignored_pattern_syntax,
)


def with_inferred_types(schema: Any) -> Any:
    """A copy of `schema` where every schema with `enum` or `const` but no `type`, `anyOf` or
    `$ref` gets the `type` its literal values have (`["string", "integer"]` for mixed values;
    integers and floats together are `number`). Other keys are kept as they are.
    """
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _ONE_SCHEMA:
        if isinstance(result.get(key), dict):
            result[key] = with_inferred_types(result[key])
    for key in _SCHEMA_LIST:
        if isinstance(result.get(key), list):
            result[key] = [with_inferred_types(item) for item in result[key]]
    for key in _SCHEMA_MAP:
        if isinstance(result.get(key), dict):
            result[key] = {name: with_inferred_types(s) for name, s in result[key].items()}
    if not {"type", "anyOf", "$ref"} & result.keys():
        values = result["enum"] if isinstance(result.get("enum"), list) else []
        values = [result["const"], *values] if "const" in result else values
        types = _literal_types(values)
        if types:
            result["type"] = types[0] if len(types) == 1 else types
    return result


def _literal_types(values: list[Any]) -> list[str]:
    types: list[str] = []
    for value in values:
        if value is None:
            name = "null"
        elif isinstance(value, list):
            name = "array"
        elif isinstance(value, dict):
            name = "object"
        else:
            name = next(json_type for cls, json_type in _JSON_TYPES if isinstance(value, cls))
        if name not in types:
            types.append(name)
    if "integer" in types and "number" in types:
        types.remove("integer")
    return types
