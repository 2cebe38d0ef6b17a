"""AdmissionController, ServerMetrics and the error/SSE helpers on their own."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sse_starlette import ServerSentEvent

from recipe.errors import Protocol, RecipeError
from server.admission import AdmissionController
from server.errors import APIError, ErrorKind, error_body, protocol_of
from server.metrics import ServerMetrics
from server.sse import data_stream, encode_json, event_stream


def test_admission_counts_and_refuses_when_full():
    admission = AdmissionController(2)
    first = admission.acquire()
    with admission.admit():
        assert admission.num_in_flight == 2 and admission.is_full
        with pytest.raises(APIError) as refused:
            admission.acquire()
        assert refused.value.kind is ErrorKind.OVERLOADED
    first.release()
    first.release()  # idempotent
    assert admission.num_in_flight == 0


def test_admission_slot_is_released_on_error():
    admission = AdmissionController(1)
    with pytest.raises(RuntimeError), admission.admit():
        raise RuntimeError
    assert admission.num_in_flight == 0


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("/v1/messages", Protocol.MESSAGES),
        ("/v1/messages/count_tokens", Protocol.MESSAGES),
        ("/v1/messagesX", Protocol.CHAT),
        ("/v1/chat/completions", Protocol.CHAT),
        ("/v1/responses", Protocol.RESPONSES),
        ("/v1/models", Protocol.CHAT),
    ],
)
def test_protocol_of_route(path, protocol):
    assert protocol_of(path) is protocol


def test_error_wire_statuses():
    assert ErrorKind.OVERLOADED.status(Protocol.CHAT) == 429
    assert ErrorKind.OVERLOADED.status(Protocol.MESSAGES) == 529
    assert error_body(Protocol.MESSAGES, ErrorKind.OVERLOADED, "busy", None, None) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    body = error_body(Protocol.CHAT, ErrorKind.INVALID_REQUEST, "bad", "n", None)
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }


@pytest.mark.parametrize("protocol", list(Protocol))
@pytest.mark.parametrize("kind", list(ErrorKind))
def test_server_and_recipe_errors_share_one_table(protocol, kind):
    """An APIError and a RecipeError of the same status answer with the same envelope."""
    recipe_error = RecipeError(kind.status(protocol), "m", protocol)
    assert recipe_error.body() == error_body(protocol, kind, "m", None, None)


def test_rate_limit_types_are_the_vendors():
    """OpenAI: type `requests`, code `rate_limit_exceeded`; Anthropic: 413 / 429 / 529 types."""
    openai = error_body(Protocol.CHAT, ErrorKind.OVERLOADED, "busy", None, None)["error"]
    assert (openai["type"], openai["code"]) == ("requests", "rate_limit_exceeded")
    assert RecipeError(429, "m", Protocol.RESPONSES).body()["error"]["type"] == "requests"
    anthropic = {s: RecipeError(s, "m", Protocol.MESSAGES).error_type for s in (413, 429, 529)}
    assert anthropic == {413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render(None).decode()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_recorder_timings():
    now = [100.0]
    metrics = ServerMetrics("m", clock=lambda: now[0])
    metrics.on_request_start("r")
    now[0] = 100.5
    metrics.on_tokens("r", 1)  # first token: TTFT 0.5, no gap yet
    now[0] = 100.7
    metrics.on_tokens("r", 2)  # 0.2 s for two tokens: two gaps of 0.1
    now[0] = 101.0
    metrics.on_finish("r", num_prompt_tokens=7, finish_reason="length")
    metrics.on_finish("r", num_prompt_tokens=7, finish_reason="length")  # ignored
    metrics.on_tokens("unknown", 5)  # ignored
    s = _samples(metrics)
    label = "[('model_name', 'm')]"
    assert s["deepinfer:time_to_first_token_seconds_sum" + label] == pytest.approx(0.5)
    assert s["deepinfer:inter_token_latency_seconds_count" + label] == 2
    assert s["deepinfer:inter_token_latency_seconds_sum" + label] == pytest.approx(0.2)
    assert s["deepinfer:e2e_request_latency_seconds_sum" + label] == pytest.approx(1.0)
    assert s["deepinfer:generation_tokens_total" + label] == 3
    assert s["deepinfer:prompt_tokens_total" + label] == 7
    assert s["deepinfer:num_requests_in_flight" + label] == 0
    assert (
        s["deepinfer:request_success_total[('finished_reason', 'length'), ('model_name', 'm')]"]
        == 1
    )


def test_metrics_queue_time():
    now = [0.0]
    metrics = ServerMetrics("m", clock=lambda: now[0])
    metrics.on_request_start("r")
    metrics.on_scheduled("r", 0.25)
    metrics.on_scheduled("r", 0.5)  # reported once per request
    s = _samples(metrics)
    assert s["deepinfer:request_queue_time_seconds_count[('model_name', 'm')]"] == 1
    assert s["deepinfer:request_queue_time_seconds_sum[('model_name', 'm')]"] == 0.25


def test_two_recorders_do_not_clash():
    ServerMetrics("a")
    ServerMetrics("a")


def test_encode_json_is_compact_and_keeps_unicode():
    assert encode_json({"a": "é", "b": [1, 2]}) == '{"a":"é","b":[1,2]}'
    assert encode_json("[DONE]") == "[DONE]"


# Payloads whose framing has edge cases: line breaks of every kind (one `data:` line each),
# U+2028 (not a line break for SSE), non-ASCII, the empty string.
_PAYLOADS = ["a\nb", "a\r\nb\rc\n", "x\u2028y 東京", "", {"k": "v\n"}, "[DONE]"]


def test_sse_framing_is_sse_starlettes():
    """Both stream shapes frame each message byte for byte as sse-starlette's
    `ServerSentEvent(..., sep="\\n")` does (the framing clients were served before)."""

    async def items():
        for payload in _PAYLOADS:
            yield payload

    async def named():
        for i, payload in enumerate(_PAYLOADS):
            yield ("message" if i % 2 else "content_block_delta", payload)

    app = FastAPI()
    app.get("/data")(lambda: data_stream(items()))
    app.get("/named")(lambda: event_stream(named()))
    expected_data = b"".join(
        ServerSentEvent(data=encode_json(p), sep="\n").encode() for p in [*_PAYLOADS, "[DONE]"]
    )
    expected_named = b"".join(
        ServerSentEvent(data=encode_json(p), event=name, sep="\n").encode()
        for name, p in [
            ("message" if i % 2 else "content_block_delta", p) for i, p in enumerate(_PAYLOADS)
        ]
    )
    with TestClient(app) as client:
        assert client.get("/data").content == expected_data
        assert client.get("/named").content == expected_named


@pytest.mark.parametrize("stopped", [False, True], ids=["serving", "stopped"])
def test_a_stream_whose_source_fails_after_the_stop_ends_as_shutting_down(stopped: bool):
    """Once the drain has stopped the request, what the aborted source raises ends the stream
    as the stop does (a 503-kind "shutting down" event); before the stop it is an internal
    error. Both streaming shapes (Chat's data events, the named events)."""
    import asyncio
    import json

    from server import drain, sse

    async def chunks():
        yield {"n": 1}
        raise RuntimeError("the engine aborted the request")

    async def named():
        yield "delta", {"n": 1}
        raise RuntimeError("the engine aborted the request")

    async def frames(stream):
        return [frame async for frame in stream]

    async def run():
        controller = drain.DrainController(abort_all=lambda: None)
        token = drain._controller.set(controller)
        try:
            data = sse._data_events(chunks(), send_done=False)
            events = sse._named_events(named(), sse.responses_error_event)
            await anext(data), await anext(events)  # the first chunk of each, before any stop
            if stopped:
                controller.stopped.set()
            return await frames(data), await frames(events)
        finally:
            drain._controller.reset(token)

    data_rest, named_rest = asyncio.run(run())
    data_error = json.loads(data_rest[-1].decode().split("data: ", 1)[1])["error"]
    named_error = json.loads(named_rest[-1].decode().split("data: ", 1)[1])
    if stopped:
        assert "shutting down" in data_error["message"]
        assert "shutting down" in named_error["message"]
        assert named_error["code"] == "service_unavailable"
    else:
        assert data_error["message"] == "internal server error"
        assert named_error["message"] == "internal server error"
