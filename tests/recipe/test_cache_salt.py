"""`cache_salt` (the vLLM extension field) in all three APIs: accepted, validated, carried."""

from __future__ import annotations

import pytest

from recipe import Recipe, RecipeError
from recipe.errors import Protocol
from tests.recipe.conftest import MODEL

BODIES = {
    Protocol.CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    Protocol.RESPONSES: {"model": MODEL, "input": "hi"},
    Protocol.MESSAGES: {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    },
}


@pytest.mark.parametrize("protocol", list(BODIES))
def test_cache_salt_is_carried_to_the_prepared_request(recipe: Recipe, protocol) -> None:
    salted = recipe.prepare(protocol, {**BODIES[protocol], "cache_salt": "tenant-7"})
    plain = recipe.prepare(protocol, BODIES[protocol])
    assert salted.cache_salt == "tenant-7" and plain.cache_salt is None
    assert salted.prompt_token_ids == plain.prompt_token_ids


@pytest.mark.parametrize("protocol", list(BODIES))
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_bad_cache_salt_is_a_400(recipe: Recipe, protocol, salt) -> None:
    with pytest.raises(RecipeError) as info:
        recipe.prepare(protocol, {**BODIES[protocol], "cache_salt": salt})
    assert info.value.status_code == 400 and "cache_salt" in str(info.value)
