"""`deepinfer-server --ep 2 --device cpu` from start to stop, as the user runs it: the weights
each rank prints at start, a request no rank's pool can hold (400, as with `--ep 1`), and
SIGTERM / Ctrl-C with streams in flight (every stream ends, every rank process exits)."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.async_engine import EngineConfig
from engine.distributed.dispatch import ExpertPlacement
from engine.distributed.memory import RELEASED_EP_SIZE, planned_host_bytes, planned_weight_bytes
from engine.models import load_checkpoint
from engine.models.deepseek_v41.checkpoint_loader import read_config, routed_expert_filter
from engine.models.deepseek_v41.config import config_with
from engine.models.embedded import resolve_model_source
from server.app import create_app
from server.config import ServerConfig
from tests.server.conftest import free_port, live_server
from tests.server.ep_servers import launch, logged_pids, stop, wait_gone, wait_healthy

pytestmark = pytest.mark.slow  # `--ep 2` server processes (~15 s each to start)
MODEL = "DeepSeek-V4.1-Flash"
SHUTDOWN_TIMEOUT_S = 2.0  # the servers' --shutdown-timeout
EXIT_BOUND_S = 30.0  # drain + stop grace (5 s) + the ranks' stop, with room for a loaded box
POOL_TOKENS = 4100  # 32 blocks of 128 hold 4096: a request reaching 4098..4100 fits no pool


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        port = free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", log
        self.proc = launch([*args, "--port", str(port), "--device", "cpu"], log)
        try:
            wait_healthy(self.proc, self.url, log)
        except BaseException:
            stop(self.proc)
            raise
        self.rank_pids = logged_pids(log)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def close(self) -> None:
        stop(self.proc)
        assert not wait_gone([self.proc.pid, *self.rank_pids], 10), "a process outlived it"


def test_each_rank_prints_the_bytes_it_holds_and_sigterm_stops_every_rank(tmp_path) -> None:
    path = resolve_model_source("tiny")
    server = Server(["--model", "tiny", "--ep", "2", "--shutdown-timeout", "2"], tmp_path / "log")
    try:
        text = server.log.read_text()
        printed = {
            int(r): int(b.replace(",", ""))
            for r, b in re.findall(r"\[rank (\d)\] holds [^(]*\(([\d,]+) B\)", text)
        }
        loaded = {}
        num_experts = read_config(path).n_routed_experts
        for rank in (0, 1):
            owns = ExpertPlacement(num_experts, 2, rank).local_experts
            tensors = load_checkpoint(
                path, progress=False, include=routed_expert_filter(owns.__contains__)
            ).tensors
            loaded[rank] = sum(
                t.numel() * t.element_size()
                for n, t in tensors.items()
                if ".engram.embed." not in n  # mapped by every rank, once per node (CPU: host)
            )
        assert printed == loaded
        shared = planned_host_bytes(read_config(path), "host").total
        assert len(re.findall(rf"shared by the node's ranks: [^(]*\({shared:,} B\)", text)) == 2
        cfg = config_with()
        released = planned_weight_bytes(cfg, RELEASED_EP_SIZE, torch.float32, False, "host").total
        tables = planned_host_bytes(cfg, "host").total
        assert "released DeepSeek-V4.1-Flash at EP 8 (float32 on cpu), Engram tables on " in text
        assert f"per rank {released / 2**30:.2f} GiB ({released:,} B)" in text
        assert f"({tables:,} B): engram" in text
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=EXIT_BOUND_S)
        assert not wait_gone([server.proc.pid, *server.rank_pids], 5)
    finally:
        server.close()


def _pool_config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint),
        max_num_seqs=8,
        kv_cache_tokens=POOL_TOKENS,
        max_model_len=POOL_TOKENS,
        max_num_batched_tokens=2048,
    )


def _server_args(config: EngineConfig) -> list[str]:
    return [
        *("--model", config.model, "--ep", "2", "--max-num-seqs", str(config.max_num_seqs)),
        *("--kv-cache-tokens", str(config.kv_cache_tokens)),
        *("--max-model-len", str(config.max_model_len)),
        *("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)),
    ]


@pytest.fixture(scope="module")
def checkpoint(default_server) -> Path:
    return default_server[2].core.runner.model.checkpoint_path


@pytest.fixture(scope="module")
def pool_server(checkpoint, tmp_path_factory):
    """`--ep 2` ranks whose pools hold 32 blocks (4096 tokens) of a 4100-token context."""
    server = Server(_server_args(_pool_config(checkpoint)), tmp_path_factory.mktemp("ep") / "log")
    yield server
    server.close()


def _refusal(client: openai.OpenAI, max_tokens: int, content: str) -> str:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            reasoning_effort="none",
        )
    return refused.value.message


def test_a_request_no_ranks_pool_holds_is_a_400_as_with_ep1(pool_server, checkpoint) -> None:
    """Prompt + max_tokens = the 4100-token context, which needs 33 KV blocks; a rank's pool
    holds 32. `--ep 1` refuses it at admission; so must `--ep 2` (not fail its stream)."""
    content = "a request that fills the context"
    ep1_app = create_app(ServerConfig(engine=_pool_config(checkpoint)))  # as `--ep 1` builds it
    with live_server(ep1_app) as ep1_url:
        counted = httpx.post(
            ep1_url + "/tokenize",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "chat_template_kwargs": {"thinking": False},
            },
            timeout=30,
        ).json()["count"]
        max_tokens = POOL_TOKENS - counted
        ep1 = openai.OpenAI(base_url=ep1_url + "/v1", api_key="unused", max_retries=0)
        want = _refusal(ep1, max_tokens, content)
    assert "needs 33 KV blocks" in want and "holds 32 blocks" in want, want
    assert _refusal(pool_server.client(), max_tokens, content) == want


def _stream(client: openai.OpenAI, prompt: str, started: threading.Event, out: list) -> None:
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=1000,
            temperature=0,
            reasoning_effort="none",
            stream=True,
        )
        finish = None
        for chunk in stream:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        out.append(("finished", finish))
    except openai.APIError as exc:
        out.append(("error", exc))
    finally:
        started.set()


def _signal_with_streams_in_flight(server: Server, sig: signal.Signals) -> None:
    client = server.client()
    outcomes: list[list] = [[] for _ in range(3)]
    started = [threading.Event() for _ in outcomes]
    threads = [
        threading.Thread(target=_stream, args=(client, f"stop test {i}", started[i], outcomes[i]))
        for i in range(len(outcomes))
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "a stream never started"
    server.proc.send_signal(sig)
    signalled = time.monotonic()
    for thread in threads:
        thread.join(max(0.0, EXIT_BOUND_S - (time.monotonic() - signalled)))
    assert not any(t.is_alive() for t in threads), "a stream hangs after the signal"
    for outcome in outcomes:
        assert len(outcome) == 1, outcomes
        kind, detail = outcome[0]
        assert kind == "error" or detail in ("stop", "length"), outcome
        if kind == "error":  # the protocol's error event, not a connection cut
            assert not isinstance(detail, openai.APIConnectionError), detail
    server.proc.wait(timeout=max(1.0, EXIT_BOUND_S - (time.monotonic() - signalled)))
    assert not wait_gone([server.proc.pid, *server.rank_pids], 5), "a rank outlived the server"


def test_sigterm_with_streams_in_flight_ends_them_and_stops_every_rank(pool_server) -> None:
    """Runs after the 400 test: the server does not survive it."""
    _signal_with_streams_in_flight(pool_server, signal.SIGTERM)


@pytest.mark.slow
def test_ctrl_c_with_streams_in_flight_ends_them_and_stops_every_rank(checkpoint, tmp_path):
    server = Server(_server_args(_pool_config(checkpoint)), tmp_path / "log")
    try:
        _signal_with_streams_in_flight(server, signal.SIGINT)
    finally:
        server.close()
