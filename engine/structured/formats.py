"""JSON Schema preparation for xgrammar: exact formats, enforced keywords, inferred types.

Formats: xgrammar's builtin `format` grammars accept some strings that standard validators (Python's
`jsonschema` format checker, RFC 3339 / `ipaddress`) reject: `date` accepts `2023-02-31` and
year `0000`; `ipv4` accepts leading zeros (`01.2.3.4`). `strict_formats` replaces such a
`format` with an equivalent `pattern` that accepts exactly the valid strings, so a constrained
answer validates wherever it is checked. A string schema that already has a `pattern` keeps its
format (the two cannot be merged into one pattern).

Keywords: `unenforced_keyword` finds the validation keywords (and formats) that xgrammar 0.2.9
compiles without enforcing, so that a request using one is refused instead of silently
getting a looser grammar. Types: `with_inferred_types` gives `enum` / `const` schemas without
a `type` the type of their values (the recipe's strict-mode checks require one).
"""

from __future__ import annotations

from typing import Any

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
    for suffix, sub in _subschemas(schema):
        message = unenforced_keyword(sub, path + suffix)
        if message is not None:
            return message
    return None


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
