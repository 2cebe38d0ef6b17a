"""`traffic_class` (the KV cache TTL class) in all three APIs: the body field, then the
`X-Deepinfer-Traffic-Class` header, then `agent` with tools / `chat` without."""

from __future__ import annotations

import pytest

from recipe import Recipe, RecipeError
from recipe.errors import Protocol
from tests.recipe.test_cache_salt import BODIES

TOOLS = {
    Protocol.CHAT: [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ],
    Protocol.RESPONSES: [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    Protocol.MESSAGES: [{"name": "f", "input_schema": {"type": "object"}}],
}


@pytest.mark.parametrize("protocol", list(BODIES))
def test_traffic_class_from_field_header_or_tools(recipe: Recipe, protocol) -> None:
    body = BODIES[protocol]
    assert recipe.prepare(protocol, body).traffic_class == "chat"
    assert recipe.prepare(protocol, {**body, "tools": TOOLS[protocol]}).traffic_class == "agent"
    assert recipe.prepare(protocol, body, "agent").traffic_class == "agent"
    field = {**body, "traffic_class": "chat", "tools": TOOLS[protocol]}
    assert recipe.prepare(protocol, field, "agent").traffic_class == "chat"  # the field wins
    assert recipe.prepare(protocol, field).prompt_token_ids == (
        recipe.prepare(protocol, {**body, "tools": TOOLS[protocol]}).prompt_token_ids
    )


@pytest.mark.parametrize("protocol", list(BODIES))
@pytest.mark.parametrize("value", ["batch", "", 3])
def test_unknown_traffic_class_is_a_400(recipe: Recipe, protocol, value) -> None:
    with pytest.raises(RecipeError) as info:
        recipe.prepare(protocol, {**BODIES[protocol], "traffic_class": value})
    assert info.value.status_code == 400 and "traffic_class" in str(info.value)
    with pytest.raises(RecipeError):
        recipe.prepare(protocol, BODIES[protocol], "batch")
