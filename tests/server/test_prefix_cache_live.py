"""The prefix cache through the live server: a repeated long prompt reports cached tokens in
each API's usage field; `cache_salt` isolates (the `default` model, real SDK clients)."""

from __future__ import annotations

import uuid

import pytest

MODEL = "DeepSeek-V4.1-Flash"
NO_THINKING = {"thinking": {"type": "disabled"}}


def _long_text() -> str:
    # A fresh text per test so that no earlier test's blocks are hit.
    tag = uuid.uuid4().hex
    return f"[{tag}] " + " ".join(f"item {i} is {tag[i % 32]}." for i in range(150))


def _min_cached(num_prompt_tokens: int) -> int:
    return num_prompt_tokens // 128 * 128 - 128


def test_chat_second_identical_prompt_reports_cached_tokens(oai) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _long_text()}],
        "max_tokens": 2,
        "extra_body": NO_THINKING,
    }
    first = oai.chat.completions.create(**body)
    second = oai.chat.completions.create(**body)
    assert first.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert _min_cached(second.usage.prompt_tokens) <= cached <= second.usage.prompt_tokens
    stream = oai.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_metrics_count_prefix_cache_hits(oai, default_server) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def value(name: str) -> float:
        text = httpx.get(default_server[0] + "/metrics").text
        families = text_string_to_metric_families(text)
        return sum(s.value for f in families for s in f.samples if s.name == name)

    def rows(stack: str) -> float:
        text = httpx.get(default_server[0] + "/metrics").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        name = "deepinfer:prefix_cache_replayed_rows_total"
        return sum(s.value for s in samples if s.name == name and s.labels["stack"] == stack)

    before = value("deepinfer:prefix_cache_hits_total")
    rows_before = (rows("encoder"), rows("decoder"))
    skipped_before = value("deepinfer:prefix_cache_decoder_skipped_rows_total")
    body = {"model": MODEL, "messages": [{"role": "user", "content": _long_text()}]}
    for _ in range(2):
        out = oai.chat.completions.create(**body, max_tokens=2, extra_body=NO_THINKING)
    assert value("deepinfer:prefix_cache_hits_total") - before >= 256
    assert value("deepinfer:prefix_cache_queries_total") > 0
    assert value("deepinfer:prefix_cache_blocks") > 0
    # The hit at P (bounded replay, the default) replays [P − 128, S): 128 cached rows through
    # the encoder; the decoder runs only the last 128 rows, so the S − P new rows before them
    # skip it and only 128 − (S − P) cached rows go through it.
    encoder = rows("encoder") - rows_before[0]
    decoder = rows("decoder") - rows_before[1]
    skipped = value("deepinfer:prefix_cache_decoder_skipped_rows_total") - skipped_before
    new_rows = out.usage.prompt_tokens - out.usage.prompt_tokens_details.cached_tokens
    assert (encoder, decoder, skipped) == (128, 128 - new_rows, new_rows)


def test_cache_salt_isolates_requests(oai) -> None:
    messages = [{"role": "user", "content": _long_text()}]

    def cached(salt: str | None) -> int:
        extra = {**NO_THINKING, **({} if salt is None else {"cache_salt": salt})}
        out = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body=extra
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0 and cached(None) == 0
    assert cached("a") > 0


def test_responses_second_identical_prompt_reports_cached_tokens(oai) -> None:
    text = _long_text()
    outs = [
        oai.responses.create(model=MODEL, input=text, max_output_tokens=16, extra_body=NO_THINKING)
        for _ in range(2)
    ]
    assert outs[0].usage.input_tokens_details.cached_tokens == 0
    cached = outs[1].usage.input_tokens_details.cached_tokens
    assert _min_cached(outs[1].usage.input_tokens) <= cached <= outs[1].usage.input_tokens


def test_messages_second_identical_prompt_reports_cache_read_tokens(claude) -> None:
    messages = [{"role": "user", "content": _long_text()}]
    outs = [
        claude.messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body=NO_THINKING)
        for _ in range(2)
    ]
    assert not outs[0].usage.cache_read_input_tokens
    cached = outs[1].usage.cache_read_input_tokens
    assert cached >= _min_cached(outs[1].usage.input_tokens + cached) and cached > 0


def test_cli_prefix_caching_options() -> None:
    from server.cli import build_parser, config_from_args

    defaults = config_from_args(build_parser().parse_args([])).engine
    assert defaults.enable_prefix_caching is True and defaults.swa_replay == "bounded"
    args = build_parser().parse_args(["--no-enable-prefix-caching", "--swa-replay", "exact"])
    engine = config_from_args(args).engine
    assert engine.enable_prefix_caching is False and engine.swa_replay == "exact"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--swa-replay", "sometimes"])
