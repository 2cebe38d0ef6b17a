"""Two server processes sharing one `--kv-cache-shared-dir` (`cache.md` §2.4, §6.3): a long
prompt prefilled by server A is a cache hit on server B, which reports the cached tokens and
answers exactly what A answered (greedy, exact replay; prefill in one chunk on both, so that
no timing-dependent chunking changes the float sums); the traffic class travels in the body
or the `X-Deepinfer-Traffic-Class` header, and an unknown class is a 400."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.server.conftest import free_port

MODEL = "DeepSeek-V4.1-Flash"
pytestmark = pytest.mark.slow


@contextmanager
def server_process(shared_dir: str, log_path: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m server` on the `default` preset with the shared directory tier (started,
    not yet ready: see `wait_ready`)."""
    port = free_port()
    args = [
        sys.executable, "-m", "server", "--model", "default", "--device", "cpu",
        "--port", str(port), "--max-num-seqs", "4", "--kv-cache-tokens", "16384",
        "--max-model-len", "4096", "--swa-replay", "exact", "--target-step-ms", "600000",
        "--kv-cache-shared-dir", shared_dir, "--kv-cache-shared-dir-bytes", "1G",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(proc: subprocess.Popen, url: str) -> str:
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited (see its log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server at {url} did not start")
        time.sleep(0.1)


def _num_blocks(root: str) -> int:
    return sum(n.endswith(".kvb") for _, _, files in os.walk(root) for n in files)


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return sum(
        s.value
        for f in families
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_prompt_prefilled_by_one_server_hits_on_another(tmp_path) -> None:
    shared = str(tmp_path / "shared")
    tag = uuid.uuid4().hex
    text = f"[{tag}] " + " ".join(f"item {i} is {tag[i % 32]}." for i in range(280))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"thinking": {"type": "disabled"}, "traffic_class": "agent"},
    }
    with server_process(shared, str(tmp_path / "a.log")) as server_a:
        url_a = wait_ready(*server_a)  # the preset's checkpoint exists once A is up
        with server_process(shared, str(tmp_path / "b.log")) as server_b:
            a = openai.OpenAI(base_url=url_a + "/v1", api_key="unused", max_retries=0)
            first = a.chat.completions.create(**body)
            num_blocks = first.usage.prompt_tokens // 128
            # More blocks than exact replay recomputes (8 layers × 127 rows → 8 blocks).
            assert num_blocks >= 12 and first.usage.prompt_tokens_details.cached_tokens == 0
            deadline = time.monotonic() + 60
            while _num_blocks(shared) < num_blocks and time.monotonic() < deadline:
                time.sleep(0.2)  # write-back runs on A's writer thread
            assert _num_blocks(shared) == num_blocks
            assert _metric(url_a, "deepinfer:kv_tier_written_bytes_total", tier="shared") > 0

            url_b = wait_ready(*server_b)
            b = openai.OpenAI(base_url=url_b + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="traffic_class"):
                b.chat.completions.create(**{**body, "extra_body": {"traffic_class": "nope"}})
            second = b.chat.completions.create(
                **{**body, "extra_body": {"thinking": {"type": "disabled"}}},
                extra_headers={"X-Deepinfer-Traffic-Class": "agent"},
            )
            assert second.usage.prompt_tokens_details.cached_tokens == num_blocks * 128
            assert second.choices[0].message.content == first.choices[0].message.content
            hit_tokens = _metric(url_b, "deepinfer:prefix_cache_hit_tokens_total", tier="shared")
            assert hit_tokens == num_blocks * 128
            hit_blocks = _metric(url_b, "deepinfer:kv_tier_hit_blocks_total", tier="shared")
            assert hit_blocks == num_blocks
