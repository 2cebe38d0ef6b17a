"""Client token ids outside the vocabulary are a 400 naming the field, in every protocol, and
they never reach the engine (a concurrent request is unaffected)."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "DeepSeek-V4.1-Flash"
VOCAB = 129280  # the `default` model's logits width
BAD_BIAS = {str(VOCAB): 1}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_out_of_vocabulary_logit_bias_is_a_400_in_chat(oai) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias=BAD_BIAS
        )
    error = info.value.body
    assert error["param"] == "logit_bias" and f"token id {VOCAB}" in error["message"]


def test_out_of_vocabulary_logit_bias_is_a_400_in_responses(oai) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(
            model=MODEL, input="hi", max_output_tokens=16, extra_body={"logit_bias": BAD_BIAS}
        )
    error = info.value.body
    assert error["param"] == "logit_bias" and f"token id {VOCAB}" in error["message"]


def test_out_of_vocabulary_logit_bias_is_a_400_in_messages(claude) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL, max_tokens=2, messages=MESSAGES, extra_body={"logit_bias": BAD_BIAS}
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert f"token id {VOCAB}" in info.value.body["error"]["message"]
