"""SIGTERM drain of a real `deepinfer-server` process (issue 13 item 7): new requests get 503,
short in-flight requests finish, long streams end with their protocol's error event, and the
process exits within `--shutdown-timeout` plus a small margin.

One server process serves the module (~15 s to start on the CPU); the SIGTERM test runs last:
the server does not survive it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from server.drain import STOP_GRACE_S

from .conftest import free_port

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Hi"}]
SHUTDOWN_TIMEOUT_S = 8.0
KEEP_ALIVE_TIMEOUT_S = 2.0
LONG = 3000  # tokens: far more than the drain lets a stream generate
SHORT = 4  # tokens: done well within the timeout
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.slow  # a server process


@pytest.fixture(scope="module")
def server_process():
    port = free_port()
    args = [sys.executable, "-m", "server", "--model", "default", "--port", str(port)]
    args += ["--max-model-len", "4096", "--kv-cache-tokens", "16384"]
    args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    args += ["--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT_S)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


class Stream(threading.Thread):
    """Consume one long stream through the protocol's SDK; records events and how it ended."""

    def __init__(self, name: str, url: str, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.protocol, self.url, self.max_tokens = name, url, max_tokens
        self.events: list = []
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        oai = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)
        claude = anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0)
        try:
            if self.protocol == "chat":
                stream = oai.chat.completions.create(
                    model=MODEL, messages=USER, max_tokens=self.max_tokens, stream=True
                )
            elif self.protocol == "responses":
                stream = oai.responses.create(
                    model=MODEL, input="Hi", max_output_tokens=self.max_tokens, stream=True
                )
            else:
                stream = claude.messages.create(
                    model=MODEL, messages=USER, max_tokens=self.max_tokens, stream=True
                )
            for event in stream:
                self.events.append(event)
                self.started.set()
        except Exception as exc:  # the SDKs raise on a protocol error event
            self.error = exc
        finally:
            self.started.set()


def _get_health(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    return reply


def test_an_idle_connection_stays_open_for_the_keep_alive_timeout(server_process):
    _, url = server_process
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        # idle for most of the timeout (uvicorn's own default, 5 s, would be past it too)
        time.sleep(KEEP_ALIVE_TIMEOUT_S * 0.6)
        assert _get_health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(KEEP_ALIVE_TIMEOUT_S + 1.0)
        assert sock.recv(4096) == b""  # closed by the server once idle past the timeout


def test_sigterm_drains_then_ends_streams_with_error_events(server_process):
    process, url = server_process
    streams = [Stream(name, url) for name in ("chat", "responses", "messages")]
    short = Stream("chat", url, max_tokens=SHORT)  # in flight at the signal, then finishes
    for stream in [*streams, short]:
        stream.start()
    for stream in [*streams, short]:
        assert stream.started.wait(60) and stream.error is None, stream.error
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)

    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = httpx.post(
        url + "/v1/messages",
        json={"model": MODEL, "messages": USER, "max_tokens": 2},
        timeout=5,
    )
    assert refused.status_code == 529 and refused.json()["error"]["type"] == "overloaded_error"
    refused = httpx.post(url + "/v1/chat/completions", json={"model": MODEL}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"

    short.join(30)
    assert short.error is None and short.events[-1].choices[0].finish_reason == "length"
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive()
    process.wait(timeout=SHUTDOWN_TIMEOUT_S + STOP_GRACE_S + 10)
    took = time.monotonic() - signalled
    assert took < SHUTDOWN_TIMEOUT_S + 3.0, took

    log = process.stdout.read()[-4000:]  # the server's own account, should a check fail
    chat, responses, messages = streams
    assert isinstance(chat.error, openai.APIError), (chat.error, log)
    assert "shutting down" in str(chat.error) and chat.events, (chat.error, log)
    assert responses.error is None
    last = responses.events[-1]
    assert last.type == "error" and last.code == "service_unavailable"
    assert last.param is None and "shutting down" in last.message
    assert last.sequence_number == responses.events[-2].sequence_number + 1
    assert isinstance(messages.error, anthropic.APIStatusError), messages.error
    assert "shutting down" in str(messages.error) and messages.events
