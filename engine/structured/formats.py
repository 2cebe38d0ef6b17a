"""JSON Schema string formats that xgrammar enforces more loosely than validators check them.

xgrammar's builtin `format` grammars accept some strings that standard validators (Python's
`jsonschema` format checker, RFC 3339 / `ipaddress`) reject: `date` accepts `2023-02-31` and
year `0000`; `ipv4` accepts leading zeros (`01.2.3.4`). `strict_formats` replaces such a
`format` with an equivalent `pattern` that accepts exactly the valid strings, so a constrained
answer validates wherever it is checked. A string schema that already has a `pattern` keeps its
format (the two cannot be merged into one pattern).
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
