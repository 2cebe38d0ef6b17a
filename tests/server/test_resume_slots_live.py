"""Resume slots through the live server (`default` model, the OpenAI SDK): an agent-style
conversation whose every turn resends the history and adds a turn is restored from the slot of
the turn before. `cached_tokens` covers the restored length (not only whole blocks), the
resume-slot metrics count the hits, and every greedy answer equals a cache-off server's."""

from __future__ import annotations

import dataclasses
import zlib

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from server.app import create_app
from server.config import ServerConfig
from tests.server.conftest import DEFAULT_ENGINE, live_server

MODEL = "DeepSeek-V4.1-Flash"
NO_THINKING = {"thinking": {"type": "disabled"}}
MAX_TOKENS = 6
COUNTERS = ("hits", "misses", "corrupt", "evictions")


def _metrics(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    values = {s.name: s.value for f in families for s in f.samples}
    out = {n: values.get(f"deepinfer:resume_slot_{n}_total", -1.0) for n in COUNTERS}
    out["bytes"] = values.get("deepinfer:resume_slot_bytes", -1.0)
    return out


def _conversation(client: openai.OpenAI, answers: list[str] | None = None) -> list[tuple]:
    """4 turns; each resends the history with `answers` (default: this client's own)."""
    # A fixed text (greedy outputs are then fixed too) that no other test sends.
    messages = [{"role": "user", "content": "resume-slot conversation: " + "a question " * 40}]
    turns = []
    for turn in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body=NO_THINKING,
        )
        usage = reply.usage
        content = reply.choices[0].message.content
        turns.append((content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages += [
            {"role": "assistant", "content": content if answers is None else answers[turn]},
            {"role": "user", "content": f"tool result {turn}: " + "more words " * (10 + 40 * turn)},
        ]
    return turns


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow  # two servers, 8 `default` turns, ~15 s
def test_chat_turns_resume_from_slots_and_answer_as_without_cache(default_model_exact_kv) -> None:
    """Two servers on the session's `default` checkpoint with exact KV storage, slots on and
    cache off, each prefilling a prompt in one chunk. Float sums differ between a decoded and
    a prefilled row and between chunkings; with encoded (FP4/FP8) KV such a difference can
    round a row the other way and flip a random model's greedy token (`docs/model.md`)."""
    model = default_model_exact_kv
    one_chunk = dataclasses.replace(DEFAULT_ENGINE, target_step_ms=600_000.0)
    configs = [one_chunk, dataclasses.replace(one_chunk, enable_prefix_caching=False)]
    apps = [
        create_app(ServerConfig(engine=c), engine=AsyncEngine.from_model(model, c)) for c in configs
    ]
    with live_server(apps[0]) as url:
        before = _metrics(url)
        on = _conversation(_client(url))
        after = _metrics(url)
    with live_server(apps[1]) as off_url:
        off = _conversation(_client(off_url), answers=[content for content, *_ in on])
    # Turn k restores turn k−1's prompt + its first MAX_TOKENS − 1 answer tokens (the last one
    # was sampled, never computed), whatever the block rounding.
    expected = [0] + [prompt + MAX_TOKENS - 1 for _, prompt, _ in on[:-1]]
    assert [cached for *_, cached in on] == expected
    assert any(n % 128 for n in expected[1:])  # more than a block hit could give
    assert after["hits"] - before["hits"] == 3 and after["misses"] - before["misses"] == 1
    assert after["bytes"] > 0 and after["corrupt"] == before["corrupt"]
    assert [t[:2] for t in off] == [t[:2] for t in on]  # same answers to the same prompts
    assert all(cached == 0 for *_, cached in off)


def test_cli_resume_slot_memory_option() -> None:
    from server.cli import build_parser, config_from_args

    defaults = config_from_args(build_parser().parse_args([])).engine
    assert defaults.resume_slot_memory == 4 << 30
    args = build_parser().parse_args(["--resume-slot-memory", "512M"])
    assert config_from_args(args).engine.resume_slot_memory == 512 << 20
    off = build_parser().parse_args(["--resume-slot-memory", "0"])
    assert config_from_args(off).engine.resume_slot_memory == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--resume-slot-memory", "lots"])


def test_the_slot_route_serves_only_the_exact_slot(make_app) -> None:
    app, _ = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        engine = app.state.server.engine.async_engine

        async def turn() -> None:
            async for _ in engine.generate([5] * 40, greedy(), "r1"):
                pass

        client.portal.call(turn)
        (slot,) = engine.core.scheduler.prefix_reuse.resume.pool.slots()
        ok = client.get(f"/internal/kv/slot/{slot.slot_id}", params={"generation": slot.generation})
        assert ok.status_code == 200 and zlib.crc32(ok.content) == slot.checksum
        stale = client.get(f"/internal/kv/slot/{slot.slot_id}", params={"generation": 99})
        assert stale.status_code == 404 and stale.json()["error"]["message"]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
