"""Request fields through the live server and the real SDKs (`recipe/fields.py`): an unknown
field is a 400 in the vendor's envelope and words, an unsupported one names itself, and
Responses `seed` reproduces the sampled tokens."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Hi"}]
NO_REASONING = {"effort": "none"}


def test_unknown_chat_field_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"foo": 1})
    error = caught.value.body
    assert error["message"] == "Unrecognized request argument supplied: foo"
    assert (error["type"], error["param"]) == ("invalid_request_error", "foo")


def test_unknown_responses_field_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(
            model=MODEL, input="hi", max_output_tokens=2, store=False, extra_body={"foo": 1}
        )
    assert caught.value.body["message"] == "Unrecognized request argument supplied: foo"


def test_unknown_messages_field_is_a_400_in_anthropics_envelope(
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=2, messages=USER, extra_body={"foo": 1})
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "foo: Extra inputs are not permitted",
        },
    }


def test_unsupported_field_says_so(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="flex")
    assert caught.value.body["message"].startswith(
        "'service_tier' is not supported by this server: "
    )
    assert caught.value.body["param"] == "service_tier"
    # The neutral value asks for nothing the server does not do.
    oai.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, service_tier="auto", store=False
    )


def test_responses_seed_reproduces_tokens(oai: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = oai.responses.create(
            model=MODEL,
            input="Tell me a story.",
            max_output_tokens=12,
            temperature=1.0,
            reasoning=NO_REASONING,
            store=False,
            extra_body={"seed": seed},
        )
        return out.output_text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9))


def test_chat_vllm_sampling_extensions_take_effect(oai: openai.OpenAI) -> None:
    """`ignore_eos` + `min_tokens`: exactly max_tokens out; `top_k: 1` is greedy (the same
    answer whatever the seed)."""
    out = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=12,
        extra_body={"ignore_eos": True, "min_tokens": 12, "thinking": {"type": "disabled"}},
    )
    assert out.usage.completion_tokens == 12
    answers = {
        oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=8,
            seed=seed,
            extra_body={"top_k": 1, "thinking": {"type": "disabled"}},
        )
        .choices[0]
        .message.content
        for seed in (1, 2, 3)
    }
    assert len(answers) == 1
