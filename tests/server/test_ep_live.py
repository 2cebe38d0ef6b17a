"""`deepinfer-server --ep 2 --device cpu`: two gloo engine ranks behind one API process, started
as the user starts it (a subprocess of the CLI), on the `default_server` checkpoint so that its
greedy answers can be compared with the in-process (`--ep 1`) server's.

One server serves the module; the last test kills one of its ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.runner import server_cpu_seconds
from tests.server.conftest import DEFAULT_ENGINE, free_port
from tests.server.ep_servers import launch, logged_pids, stop, wait_gone, wait_healthy

DIST_TIMEOUT_S = 10.0  # the server's --dist-timeout
pytestmark = pytest.mark.slow  # a `--ep 2` server process (~20 s to start)
MODEL = "DeepSeek-V4.1-Flash"
PROMPTS = [
    "ep test: name a colour",
    "ep test: count to five",
    "ep test: what is a rank?",
    "ep test: say hello in French",
    "ep test: one word for the sea",
    "ep test: a prime number",
]


class EPServer:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path, rank_pids: list[int]):
        self.proc, self.url, self.log, self.rank_pids = proc, url, log, rank_pids

    def metrics(self) -> dict[tuple[str, str], float]:
        """(metric name, rank) → value of the per-rank gauges."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (s.name, s.labels["rank"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if "rank" in s.labels
        }


@pytest.fixture(scope="module")
def ep_server(default_server, tmp_path_factory) -> EPServer:
    checkpoint = default_server[2].core.runner.model.checkpoint_path
    port = free_port()
    log = tmp_path_factory.mktemp("ep2") / "server.log"
    cfg = DEFAULT_ENGINE
    args = [
        *("--model", str(checkpoint), "--device", "cpu"),
        *("--ep", "2", "--port", str(port), "--dist-timeout", str(DIST_TIMEOUT_S)),
        *("--max-num-seqs", str(cfg.max_num_seqs), "--kv-cache-tokens", str(cfg.kv_cache_tokens)),
        *("--max-model-len", str(cfg.max_model_len), "--swa-replay", "exact"),
    ]
    proc = launch(args, log)
    url = f"http://127.0.0.1:{port}"
    rank_pids: list[int] = []
    try:
        wait_healthy(proc, url, log)
        rank_pids = logged_pids(log)
        yield EPServer(proc, url, log, rank_pids)
    finally:
        stop(proc)
        assert not wait_gone([proc.pid, *rank_pids], 10), "a process outlived the server"


def _client(url: str, timeout: float = 120.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def _greedy(client: openai.OpenAI, prompt: str) -> str:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        reasoning_effort="none",  # thinking mode samples (DeepSeek ignores temperature there)
    )
    choice = response.choices[0]
    return f"{choice.message.model_dump()} {choice.finish_reason} {response.usage}"


def test_ep2_answers_the_same_greedy_completions_as_ep1(ep_server, oai) -> None:
    ep2 = _client(ep_server.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _greedy(ep2, p), PROMPTS))
        want = list(pool.map(lambda p: _greedy(oai, p), PROMPTS))
    assert got == want


def test_metrics_per_rank_and_cancel_frees_every_rank(ep_server) -> None:
    client = _client(ep_server.url)
    streams = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"ep cancel test {i}"}],
            max_tokens=400,
            temperature=0,
            stream=True,
        )
        for i in range(4)
    ]
    for stream in streams:
        next(iter(stream))  # the request runs: its first chunk arrived
    running = ep_server.metrics()
    for stream in streams:
        stream.close()
    busy = {r for (name, r), v in running.items() if name.endswith("num_requests_running") and v}
    assert busy == {"0", "1"}, running  # placement spread the requests over both ranks
    # Each rank process publishes its own CPU time, which loadtest adds to the API process's.
    cpu = {r: v for (name, r), v in running.items() if name.endswith("engine_process_cpu_seconds")}
    assert set(cpu) == {"0", "1"} and min(cpu.values()) > 0, running
    text = httpx.get(ep_server.url + "/metrics", timeout=10).text
    api_cpu = next(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_cpu_seconds_total"
    )
    assert server_cpu_seconds(text) >= api_cpu + sum(cpu.values())  # later values only grow
    deadline = time.monotonic() + 20
    while True:
        values = ep_server.metrics()
        gauges = {
            k: v
            for k, v in values.items()
            if not k[0].endswith(("_created", "engine_process_cpu_seconds"))
        }
        if not any(gauges.values()):
            break
        assert time.monotonic() < deadline, f"ranks still hold work after cancelling: {gauges}"
        time.sleep(0.2)
    names = {name for name, _ in gauges}
    assert names == {
        "deepinfer:num_requests_running",
        "deepinfer:num_requests_waiting",
        "deepinfer:kv_cache_usage_perc",
    }
    assert {rank for _, rank in gauges} == {"0", "1"}


def test_killing_a_rank_fails_requests_and_health_then_the_server_exits(ep_server) -> None:
    """Runs last: the server does not survive it."""
    client = _client(ep_server.url, timeout=DIST_TIMEOUT_S + 20)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "ep kill test"}],
                max_tokens=2000,
                temperature=0,
            )
        except BaseException as exc:  # noqa: BLE001 (the assertion below looks at it)
            errors.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(2.0)  # mid-generation
    os.kill(ep_server.rank_pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(DIST_TIMEOUT_S + 20)
    assert not thread.is_alive(), "the request hangs after a rank died"
    assert time.monotonic() - killed_at < DIST_TIMEOUT_S + 5
    assert errors and isinstance(errors[0], openai.InternalServerError), errors
    assert "engine rank" in str(errors[0])
    statuses = []
    while ep_server.proc.poll() is None and len(statuses) < 100:
        try:
            statuses.append(httpx.get(ep_server.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            break
        time.sleep(0.1)
    assert 503 in statuses and 200 not in statuses, statuses
    assert ep_server.proc.wait(timeout=30) == 1
    assert not wait_gone([ep_server.proc.pid, *ep_server.rank_pids], 10)
