"""A real uvicorn server on a free port: routes over HTTP, and client disconnects that abort
the engine request (streaming and not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ANTHROPIC_ROUTE, API_KEY, OPENAI_ROUTE, free_port, live_server

BEARER = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def live(make_app):
    app, events = make_app(api_key=API_KEY, max_queued_requests=2)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, app, events


def _wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Wait until the engine (the server's `EngineClient`) holds nothing, then check its
    scheduler's bookkeeping."""
    deadline = time.monotonic() + timeout
    while not all(rank.is_idle for rank in engine.snapshot().ranks):
        assert time.monotonic() < deadline, "the engine kept running the abandoned request"
        time.sleep(0.01)
    scheduler = engine.async_engine.core.scheduler
    scheduler.check_integrity()
    assert scheduler.kv_manager.usage() == 0


def test_live_routes(live):
    client, app, _ = live
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models", headers=BEARER).json()
    assert [m["id"] for m in models["data"]] == ["DeepSeek-V4.1-Flash"]

    tokens = client.post(
        "/tokenize", json={"prompt": "tok9 Tok300", "add_special_tokens": False}, headers=BEARER
    ).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": tokens}, headers=BEARER).json()["prompt"]
    assert text == "tok9 Tok300"

    response = client.post(OPENAI_ROUTE, json={"prompt": [5, 6], "max_tokens": 2}, headers=BEARER)
    assert response.status_code == 200

    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(metrics.text))
    names = {family.name for family in families}
    values = {s.name: s.value for family in families for s in family.samples}
    assert values["deepinfer:generation_tokens_total"] == 2
    assert values["deepinfer:e2e_request_latency_seconds_count"] == 1
    for name in (
        "deepinfer:num_requests_running",
        "deepinfer:num_requests_waiting",
        "deepinfer:kv_cache_usage_perc",
        "deepinfer:prompt_tokens",
        "deepinfer:generation_tokens",
        "deepinfer:time_to_first_token_seconds",
        "deepinfer:inter_token_latency_seconds",
        "deepinfer:e2e_request_latency_seconds",
        "deepinfer:request_queue_time_seconds",
    ):
        assert name in names, name


def test_live_errors(live):
    client, app, _ = live
    bad_json = client.post(
        "/tokenize", content=b"{", headers={**BEARER, "content-type": "application/json"}
    )
    assert (
        bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    )
    wrong_type = client.post("/tokenize", json={"prompt": ["x"]}, headers=BEARER)
    assert wrong_type.status_code == 400
    assert client.get("/v1/unknown", headers=BEARER).json()["error"]["type"] == "not_found_error"

    missing = client.get("/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    anthropic = client.post(ANTHROPIC_ROUTE, json={"prompt": [5]}, headers={"x-api-key": "no"})
    assert anthropic.status_code == 401
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": anthropic.json()["error"]["message"]},
    }
    bad_anthropic = client.post(
        ANTHROPIC_ROUTE, json={"prompt": "x"}, headers={"x-api-key": API_KEY}
    )
    assert bad_anthropic.status_code == 400
    assert bad_anthropic.json()["error"]["type"] == "invalid_request_error"

    admission = app.state.server.admission
    slots = [admission.acquire(), admission.acquire()]
    try:
        body = {"prompt": [5], "max_tokens": 1}
        full = client.post(OPENAI_ROUTE, json=body, headers=BEARER)
        assert full.status_code == 429 and full.json()["error"]["type"] == "requests"
        full = client.post(ANTHROPIC_ROUTE, json=body, headers={"x-api-key": API_KEY})
        assert full.status_code == 529 and full.json()["error"]["type"] == "overloaded_error"
    finally:
        for slot in slots:
            slot.release()


def test_stream_disconnect_aborts_the_request(live):
    client, app, events = live
    engine = app.state.server.engine
    body = {"prompt": [5, 6, 7], "max_tokens": 3000}
    with client.stream("POST", "/v1/test-only/stream", json=body, headers=BEARER) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["tokens"]
                break
    assert events["stream_closed"].wait(10), "the stream's generator was not closed"
    _wait_until_idle(engine)
    deadline = time.monotonic() + 5
    while app.state.server.admission.num_in_flight:  # the slot is released in the generator
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_non_streaming_disconnect_aborts_the_request(live):
    client, app, events = live
    engine = app.state.server.engine
    body = {"prompt": [5, 6, 7], "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        client.post(OPENAI_ROUTE, json=body, headers=BEARER, timeout=0.5)
    assert events["collect_cancelled"].wait(10), "the request was not cancelled"
    _wait_until_idle(engine)
    assert app.state.server.admission.num_in_flight == 0
    deadline = time.monotonic() + 5
    while 'finished_reason="abort"' not in client.get("/metrics").text:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.01)


@pytest.mark.slow
def test_cli_serves(tmp_path):
    """`python -m server` end to end: generates the tiny preset, serves, stops on SIGINT."""
    port = free_port()
    env = {**os.environ, "DEEPINFER_CACHE_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "server", "--model", "tiny", "--port", str(port)]
    command += ["--kv-cache-tokens", "1024", "--max-model-len", "1024", "--max-num-seqs", "2"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "the CLI server did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "DeepSeek-V4.1-Flash"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
