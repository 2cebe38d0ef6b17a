"""Resume slots across two server processes sharing one `--kv-cache-shared-dir` (`cache.md`
§3.4, §3.5): server A serves turn 1 and announces its slot by a pointer file; turn 2 sent to
server B pulls the slot from A over HTTP (loopback), restores the whole turn-1 sequence and
answers what A answers to turn 2 from its own slot. Once A is gone, B's turn 2 of another
conversation falls back to block hits (a miss, never an error)."""

from __future__ import annotations

import os
import time

import openai
import pytest

from tests.server.test_kv_shared_dir_live import _metric, server_process, wait_ready

MODEL = "DeepSeek-V4.1-Flash"
MAX_TOKENS = 6
pytestmark = pytest.mark.slow


def _ask(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int, int]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"thinking": {"type": "disabled"}, "traffic_class": "agent"},
    )
    usage = reply.usage
    return (
        reply.choices[0].message.content,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def _next_turn(messages: list[dict], answer: str, text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": text}]


def _num_pointers(root: str) -> int:
    return sum(n.endswith(".ptr") for _, _, files in os.walk(root) for n in files)


def _wait_pointers(root: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while _num_pointers(root) < count and time.monotonic() < deadline:
        time.sleep(0.1)  # A writes pointers on a worker thread
    assert _num_pointers(root) >= count


def test_a_turn_on_another_server_resumes_from_the_first_servers_slot(tmp_path) -> None:
    shared = str(tmp_path / "shared")
    # The text of `test_resume_slots_live` (its answer re-renders to the ids generated).
    first = [{"role": "user", "content": "resume-slot conversation: " + "a question " * 40}]
    other = [{"role": "user", "content": "dead owner: " + "another question " * 100}]
    with server_process(shared, str(tmp_path / "a.log")) as server_a:
        url_a = wait_ready(*server_a)
        with server_process(shared, str(tmp_path / "b.log")) as server_b:
            a = openai.OpenAI(base_url=url_a + "/v1", api_key="unused", max_retries=0)
            answer, prompt_len, _ = _ask(a, first)
            restored = prompt_len + MAX_TOKENS - 1
            # The slot's blocks [0, P0) must be prompt blocks (A writes back prompt blocks only).
            assert restored // 128 == prompt_len // 128 and restored % 128, prompt_len
            _wait_pointers(shared, 1)
            url_b = wait_ready(*server_b)
            b = openai.OpenAI(base_url=url_b + "/v1", api_key="unused", max_retries=0)
            turn2 = _next_turn(first, answer, "tool result 0: " + "more words " * 10)
            on_b = _ask(b, turn2)
            on_a = _ask(a, turn2)
            assert on_b[2] == on_a[2] == restored  # the whole turn-1 sequence, both servers
            assert on_b[0] == on_a[0]
            assert _metric(url_b, "deepinfer:resume_slot_hits_total") == 1

            answer2, prompt2, _ = _ask(a, other)
            _wait_pointers(shared, 3)
            server_a[0].terminate()  # its pointers remain, its slots are gone
            server_a[0].wait(timeout=30)
            other2 = _next_turn(other, answer2, "tool result: " + "words " * 30)
            content, _, cached = _ask(b, other2)
            assert content and cached % 128 == 0 and cached <= prompt2  # blocks only
            assert _metric(url_b, "deepinfer:resume_slot_hits_total") == 1
