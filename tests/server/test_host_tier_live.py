"""The host tier through the server (`cache.md` §2.3, §2.7): with a GPU pool too small for the
working set, a prompt whose blocks other prompts evicted is served from the host tier on its
next turn — `cached_tokens` reported, the `host` tier in the hit metrics, and the answer the
uncached first turn gave (greedy, exact replay, prefill in one chunk)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.server.conftest import free_port
from tests.server.test_kv_shared_dir_live import _metric, wait_ready

MODEL = "DeepSeek-V4.1-Flash"
pytestmark = pytest.mark.slow


def _server(log_path: str, *extra: str):
    import os
    import subprocess
    import sys

    port = free_port()
    args = [
        sys.executable, "-m", "server", "--model", "default", "--device", "cpu",
        "--port", str(port), "--max-num-seqs", "2", "--kv-cache-tokens", "2048",
        "--max-model-len", "2048", "--swa-replay", "exact", "--target-step-ms", "600000",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _body(seed: str) -> dict:
    text = f"[{seed}] " + " ".join(f"item {i} is {seed[i % 32]}." for i in range(190))
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": {"thinking": {"type": "disabled"}},
    }


def test_evicted_prompt_is_served_from_the_host_tier(tmp_path) -> None:
    proc, url = _server(str(tmp_path / "server.log"), "--host-kv-cache-bytes", "256M")
    try:
        wait_ready(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        a, b, c = (_body(uuid.uuid4().hex) for _ in range(3))
        first = client.chat.completions.create(**a)
        num_blocks = first.usage.prompt_tokens // 128
        assert num_blocks >= 8 and first.usage.prompt_tokens_details.cached_tokens == 0
        stored_blocks = num_blocks  # the prompts' token counts differ with their random seeds
        for other in (b, c):  # each needs most of the 16 GPU blocks: a's are evicted
            stored_blocks += client.chat.completions.create(**other).usage.prompt_tokens // 128
        again = client.chat.completions.create(**a)
        assert again.usage.prompt_tokens_details.cached_tokens == num_blocks * 128
        assert again.choices[0].message.content == first.choices[0].message.content
        host_tokens = _metric(url, "deepinfer:prefix_cache_hit_tokens_total", tier="host")
        assert host_tokens >= (num_blocks - 2) * 128
        assert _metric(url, "deepinfer:kv_tier_hit_blocks_total", tier="host") * 128 == host_tokens
        assert _metric(url, "deepinfer:kv_cache_blocks", tier="host") >= stored_blocks
        capacity = _metric(url, "deepinfer:kv_cache_capacity_bytes", tier="host")
        assert 255 << 20 < capacity <= 256 << 20  # whole slots within the budget
        assert _metric(url, "deepinfer:kv_bytes_total", src="gpu", dst="host") > 0
        assert _metric(url, "deepinfer:kv_bytes_total", src="host", dst="gpu") > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
