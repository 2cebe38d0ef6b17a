"""Grounding tokens typed in assistant turns become special ids, as deepseek-recipe renders them;
every other special spelling, and grounding spellings anywhere else, stay plain text (issue 13
item 9; the rule is in docs/model.md)."""

from __future__ import annotations

import httpx
import pytest

from recipe.errors import Protocol
from recipe.tokenizer import V41_SPECIAL_TOKEN_IDS

MODEL = "DeepSeek-V4.1-Flash"
GROUNDING = ("ref", "ref_end", "box", "box_end", "point", "point_end", "polygon", "polygon_end")
PLAIN = ("user", "assistant", "eos", "thinking_end", "dsml", "image", "system")


def spelling(recipe, name: str) -> str:
    return recipe.tokenizer.full.id_to_token(V41_SPECIAL_TOKEN_IDS[name])


def body(protocol: Protocol, role: str, text: str) -> dict:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    turns[0 if role == "user" else 1]["content"] = text
    turns.append({"role": "user", "content": "next"})
    if protocol is Protocol.RESPONSES:
        return {"model": MODEL, "input": turns}
    return {"model": MODEL, "messages": turns, "max_tokens": 1}


@pytest.mark.parametrize("protocol", list(Protocol))
def test_grounding_spellings_are_special_only_in_assistant_turns(default_server, protocol):
    recipe = default_server[1].state.server.recipe
    for name in GROUNDING:
        token_id = V41_SPECIAL_TOKEN_IDS[name]
        text = f"see {spelling(recipe, name)} here"
        assistant = recipe.prepare(protocol, body(protocol, "assistant", text)).prompt_token_ids
        user = recipe.prepare(protocol, body(protocol, "user", text)).prompt_token_ids
        assert assistant.count(token_id) == 1, (protocol, name)
        assert token_id not in user, (protocol, name)
    for name in PLAIN:
        token_id = V41_SPECIAL_TOKEN_IDS[name]
        text = f"see {spelling(recipe, name)} here"
        baseline = recipe.prepare(protocol, body(protocol, "assistant", "see here"))
        assistant = recipe.prepare(protocol, body(protocol, "assistant", text))
        # The spelling adds plain tokens only: the special id occurs as often as the template
        # itself puts it there.
        assert assistant.prompt_token_ids.count(token_id) == baseline.prompt_token_ids.count(
            token_id
        ), (protocol, name)


def test_count_tokens_shows_the_rule(default_server):
    url = default_server[0] + "/v1/messages/count_tokens"
    recipe = default_server[1].state.server.recipe
    ref = spelling(recipe, "ref")

    def count(role: str, text: str) -> int:
        response = httpx.post(url, json=body(Protocol.MESSAGES, role, text), timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    base = count("assistant", "x")
    assert count("assistant", "x" + ref) == base + 1  # one special id
    assert count("user", "x" + ref) - count("user", "x") > 1  # plain byte-level tokens
