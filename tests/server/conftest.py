"""Server fixtures: apps over a small engine on the session's `tiny` model, plus test-only
routes standing in for the protocol routes (which are wired later)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

import anthropic
import openai
import pytest
import uvicorn
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from engine.async_engine import AsyncEngine, EngineConfig
from engine.distributed.groups import free_port
from engine.sampling_params import SamplingParams
from server.admission import AdmissionController
from server.app import create_app
from server.config import ServerConfig
from server.dependencies import get_admission, get_engine, get_metrics
from server.disconnect import run_until_disconnect
from server.errors import APIError, ErrorKind
from server.metrics import ServerMetrics
from server.sse import data_stream, event_stream

API_KEY = "sk-test-key"
TINY_ENGINE = EngineConfig(
    model="tiny", max_num_seqs=4, max_num_batched_tokens=512, kv_cache_tokens=4096
)

# Paths of the test-only routes: the prefix picks the error envelope (Messages vs OpenAI).
OPENAI_ROUTE = "/v1/test-only/generate"
ANTHROPIC_ROUTE = "/v1/messages/test-only/generate"


Engine = Annotated[AsyncEngine, Depends(get_engine)]
Admission = Annotated[AdmissionController, Depends(get_admission)]
Metrics = Annotated[ServerMetrics, Depends(get_metrics)]


class GenerateBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: list[int]
    max_tokens: int = 4


def add_test_routes(app: FastAPI, events: dict[str, threading.Event]) -> None:
    """Routes shaped like the protocol routes: admission, engine call, SSE, disconnects.

    `events["stream_closed"]` / `events["collect_cancelled"]` are set when the streaming /
    non-streaming generator is closed or cancelled before its natural end.
    """

    async def generate(body: GenerateBody, request: Request, engine, admission, metrics) -> dict:
        # The pattern a protocol route follows: metrics from arrival, admission, engine call
        # under disconnect detection, `on_finish` whatever happens.
        request_id = uuid.uuid4().hex
        metrics.on_request_start(request_id)
        num_prompt_tokens, reason = 0, "rejected"
        try:
            with admission.admit():
                params = SamplingParams(temperature=0, max_tokens=body.max_tokens, ignore_eos=True)

                async def collect() -> list[int]:
                    nonlocal num_prompt_tokens, reason
                    out: list[int] = []
                    reason = "abort"
                    try:
                        async for delta in engine.generate(body.prompt, params, request_id):
                            metrics.on_tokens(request_id, len(delta.token_ids))
                            num_prompt_tokens = delta.num_prompt_tokens
                            out += delta.token_ids
                            if delta.finish_reason is not None:
                                reason = str(delta.finish_reason)
                        return out
                    finally:
                        if reason == "abort":
                            events["collect_cancelled"].set()

                return {"tokens": await run_until_disconnect(request, collect())}
        finally:
            metrics.on_finish(request_id, num_prompt_tokens, reason)

    @app.post(OPENAI_ROUTE)
    async def openai_generate(
        body: GenerateBody, request: Request, e: Engine, a: Admission, m: Metrics
    ):
        return await generate(body, request, e, a, m)

    @app.post(ANTHROPIC_ROUTE)
    async def anthropic_generate(
        body: GenerateBody, request: Request, e: Engine, a: Admission, m: Metrics
    ):
        return await generate(body, request, e, a, m)

    @app.post("/v1/test-only/stream")
    async def stream(body: GenerateBody, e: Engine, a: Admission):
        slot = a.acquire()
        params = SamplingParams(temperature=0, max_tokens=body.max_tokens, ignore_eos=True)

        async def chunks():
            finished = False
            with slot:
                try:
                    async for delta in e.generate(body.prompt, params, request_id="stream"):
                        yield {"tokens": delta.token_ids}
                    finished = True
                finally:
                    if not finished:
                        events["stream_closed"].set()

        return data_stream(chunks())

    @app.post("/v1/messages/test-only/events")
    async def named_events():
        async def events_():
            yield "message_start", {"type": "message_start"}
            yield "message_stop", {"type": "message_stop"}

        return event_stream(events_())

    @app.post("/v1/test-only/stream-fails")
    async def stream_fails():
        async def chunks():
            yield {"n": 1}
            raise RuntimeError("secret internal detail")

        return data_stream(chunks())

    @app.post("/v1/messages/test-only/events-fail")
    async def events_fail():
        async def events_():
            yield "message_start", {"type": "message_start"}
            raise APIError(ErrorKind.INVALID_REQUEST, "stop sequence too long")

        return event_stream(events_())

    @app.get("/v1/test-only/boom")
    async def boom():
        raise RuntimeError("secret internal detail")

    @app.get("/v1/messages/test-only/boom")
    async def boom_anthropic():
        raise RuntimeError("secret internal detail")


@pytest.fixture
def make_app(tiny_model) -> Callable[..., tuple[FastAPI, dict[str, threading.Event]]]:
    """Factory: an app (not started) over a fresh engine on the tiny model + test routes."""

    def make(**overrides) -> tuple[FastAPI, dict[str, threading.Event]]:
        config = ServerConfig(engine=TINY_ENGINE, **overrides)
        app = create_app(config, engine=AsyncEngine.from_model(tiny_model, TINY_ENGINE))
        events = {"stream_closed": threading.Event(), "collect_cancelled": threading.Event()}
        add_test_routes(app, events)
        return app, events

    return make


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """Run `app` under a real uvicorn on a free port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "uvicorn did not stop"


DEFAULT_ENGINE = EngineConfig(
    model="default",
    max_num_seqs=16,
    kv_cache_tokens=16384,
    max_model_len=4096,
    max_num_batched_tokens=2048,
)


@pytest.fixture(scope="session")
def default_server(default_checkpoint):
    """A live server on the `default` model (real vocabulary and V4.1 tokenizer):
    yields (base URL, app, engine)."""
    from engine.models import load_model

    engine = AsyncEngine.from_model(load_model(default_checkpoint), DEFAULT_ENGINE)
    # A short grammar timeout keeps the pathological-schema test quick.
    config = ServerConfig(engine=DEFAULT_ENGINE, grammar_compile_timeout_s=2.0)
    app = create_app(config, engine=engine)
    with live_server(app) as url:
        yield url, app, engine


@pytest.fixture(scope="session")
def oai(default_server) -> openai.OpenAI:
    """The OpenAI SDK pointed at the live `default` server."""
    return openai.OpenAI(base_url=default_server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def claude(default_server) -> anthropic.Anthropic:
    """The Anthropic SDK pointed at the live `default` server."""
    return anthropic.Anthropic(base_url=default_server[0], api_key="unused", max_retries=0)
