"""Two "nodes" on one machine: `--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1
--master-port P --ep 2` (one rank each), launched as the README's Multi-GPU section shows.
Node 0 serves HTTP and tells node 1's rank what to serve; the pair answers the same greedy
completions as `--ep 1`; when node 1 dies, node 0 fails and exits and no process is left."""

from __future__ import annotations

import secrets
import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import DEFAULT_ENGINE, free_port
from tests.server.ep_servers import launch, logged_pids, stop, wait_gone, wait_healthy

MODEL = "DeepSeek-V4.1-Flash"
PROMPTS = ["two nodes: name a colour", "two nodes: count to three"]
DIST_TIMEOUT_S = 10.0


def _greedy(client: openai.OpenAI, prompt: str) -> str:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        reasoning_effort="none",
    )
    return f"{response.choices[0].message.content!r} {response.choices[0].finish_reason}"


@pytest.mark.slow
def test_two_nodes_serve_the_same_greedy_completions_as_ep1(default_server, oai, tmp_path):
    checkpoint = default_server[2].core.runner.model.checkpoint_path
    master_port, http_port = free_port(), free_port()
    parallel = [
        *("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port)),
        *("--ep", "2", "--device", "cpu", "--dist-timeout", str(DIST_TIMEOUT_S)),
    ]
    cfg = DEFAULT_ENGINE
    engine = [
        *("--model", str(checkpoint), "--max-num-seqs", str(cfg.max_num_seqs)),
        *("--kv-cache-tokens", str(cfg.kv_cache_tokens)),
        *("--max-model-len", str(cfg.max_model_len), "--swa-replay", "exact"),
    ]
    env = {"DEEPINFER_ENGINE_AUTHKEY": secrets.token_hex(16)}
    # Node 1 first: its rank waits for node 0's API process to listen.
    node1 = launch([*parallel, "--node-rank", "1"], tmp_path / "node1.log", env)
    node0 = launch(
        [*parallel, "--node-rank", "0", *engine, "--port", str(http_port)],
        tmp_path / "node0.log",
        env,
    )
    url = f"http://127.0.0.1:{http_port}"
    pids: list[int] = []
    try:
        wait_healthy(node0, url, tmp_path / "node0.log")
        pids = logged_pids(tmp_path / "node0.log")  # both ranks', by rank
        node1_pids = logged_pids(tmp_path / "node1.log", r"node 1 runs ranks \[1\]: pids")
        assert node1_pids == pids[1:]  # rank 1 runs on node 1
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [_greedy(client, p) for p in PROMPTS] == [_greedy(oai, p) for p in PROMPTS]

        node1.send_signal(signal.SIGTERM)  # node 1 dies: node 0 fails, then exits
        statuses = []
        deadline = time.monotonic() + 30
        while node0.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert 503 in statuses, statuses
        assert node0.wait(timeout=30) == 1
        assert node1.wait(timeout=30) == 1
    finally:
        stop(node1)
        stop(node0)
        assert not wait_gone([node0.pid, node1.pid, *pids], 15), "a process was left behind"
