"""The app in process (Starlette's TestClient runs the lifespan): routes, envelopes, auth."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.app import create_app
from server.config import ServerConfig
from server.dependencies import get_tokenizer

from .conftest import ANTHROPIC_ROUTE, API_KEY, OPENAI_ROUTE, TINY_ENGINE

OPENAI_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_KEYS
    assert body["error"]["type"] == error_type
    return body["error"]


def assert_anthropic_error(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    return body["error"]


@pytest.fixture
def client(make_app):
    app, _ = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def test_health_follows_the_engine(make_app):
    app, _ = make_app()
    client = TestClient(app)
    assert client.get("/health").status_code == 503  # lifespan not started
    with client:
        assert client.get("/health").status_code == 200
    assert app.state.server.engine is not None
    assert client.get("/health").status_code == 503  # engine shut down


def test_models_list_has_openai_and_anthropic_fields(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["has_more"] is False
    (card,) = body["data"]
    assert card["id"] == "DeepSeek-V4.1-Flash" and card["object"] == "model"
    assert card["type"] == "model" and card["created_at"].endswith("Z")
    assert isinstance(card["created"], int) and card["owned_by"]
    assert client.get("/v1/models/DeepSeek-V4.1-Flash").json()["id"] == card["id"]
    error = assert_openai_error(client.get("/v1/models/gpt-4"), 404, "not_found_error")
    assert error["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(client):
    text = "tok5 tok6 Tok300 tok42"
    body = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert body["tokens"] == [5, 6, 1000, 42]
    assert body["count"] == 4 and body["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    strs = client.post("/tokenize", json={"prompt": "tok5", "return_token_strs": True}).json()
    assert strs["token_strs"][-1] == "tok5"


def test_detokenize_refuses_out_of_range_ids(client):
    for bad in ([1024], [-1], [5, 10**12]):
        error = assert_openai_error(
            client.post("/detokenize", json={"tokens": bad}), 400, "invalid_request_error"
        )
        assert "out of range" in error["message"] and error["param"].startswith("tokens[")


def test_tokenize_unknown_model_is_404(client):
    response = client.post("/tokenize", json={"prompt": "x", "model": "gpt-4"})
    assert assert_openai_error(response, 404, "not_found_error")["param"] == "model"


@pytest.mark.parametrize(
    ("path", "kwargs"),
    [
        ("/tokenize", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("/tokenize", {"json": {"prompt": 5}}),
        ("/tokenize", {"json": {"prompt": "x", "add_special_tokens": "yes"}}),
        ("/tokenize", {"json": {}}),
        ("/tokenize", {"json": {"prompt": "x", "surprise": 1}}),
        ("/detokenize", {"json": {"tokens": ["5"]}}),
        ("/detokenize", {"json": {"tokens": [1.5]}}),
        ("/detokenize", {"json": [1, 2]}),
        (OPENAI_ROUTE, {"content": b"\xff\xfe", "headers": {"content-type": "application/json"}}),
    ],
)
def test_bad_input_is_400_in_the_openai_envelope(client, path, kwargs):
    assert_openai_error(client.post(path, **kwargs), 400, "invalid_request_error")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"content": b'{"prompt": [1,', "headers": {"content-type": "application/json"}},
        {"json": {"prompt": "not a list"}},
        {"json": {"prompt": [1], "max_tokens": "4"}},
    ],
)
def test_bad_input_is_400_in_the_anthropic_envelope(client, kwargs):
    assert_anthropic_error(client.post(ANTHROPIC_ROUTE, **kwargs), 400, "invalid_request_error")


def test_unknown_routes_and_methods(client):
    assert_openai_error(client.get("/v1/nope"), 404, "not_found_error")
    assert_anthropic_error(client.post("/v1/messages/nope", json={}), 404, "not_found_error")
    assert_openai_error(client.get("/tokenize"), 405, "invalid_request_error")


def test_unexpected_errors_are_500_without_details(client):
    for path, check in (
        ("/v1/test-only/boom", lambda r: assert_openai_error(r, 500, "server_error")),
        ("/v1/messages/test-only/boom", lambda r: assert_anthropic_error(r, 500, "api_error")),
    ):
        response = client.get(path)
        assert "secret" not in response.text and "Traceback" not in response.text
        check(response)


def test_generation_route_and_metrics_move(client):
    tokens = "deepinfer:generation_tokens_total"
    prompt = "deepinfer:prompt_tokens_total"
    ttft = "deepinfer:time_to_first_token_seconds_count"
    before = {name: _metric(client, name) for name in (tokens, prompt, ttft)}
    response = client.post(OPENAI_ROUTE, json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert response.status_code == 200 and len(response.json()["tokens"]) == 3
    assert _metric(client, tokens) == before[tokens] + 3
    assert _metric(client, prompt) == before[prompt] + 3
    assert _metric(client, ttft) == before[ttft] + 1
    assert _metric(client, "deepinfer:request_success_total", finished_reason="length") == 1
    assert _metric(client, "deepinfer:num_requests_running") == 0
    assert _metric(client, "deepinfer:num_requests_in_flight") == 0
    assert _metric(client, "deepinfer:kv_cache_usage_perc") == 0
    client.app.state.server.engine.async_engine.core.scheduler.check_integrity()


def _metric(client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def test_full_admission_queue_is_429_and_529(make_app):
    app, _ = make_app(max_queued_requests=1)
    with TestClient(app) as client:
        slot = app.state.server.admission.acquire()
        try:
            body = {"prompt": [5], "max_tokens": 1}
            error = assert_openai_error(client.post(OPENAI_ROUTE, json=body), 429, "requests")
            assert error["code"] == "rate_limit_exceeded"
            assert_anthropic_error(client.post(ANTHROPIC_ROUTE, json=body), 529, "overloaded_error")
        finally:
            slot.release()
        assert client.post(OPENAI_ROUTE, json=body).status_code == 200
        assert app.state.server.admission.num_in_flight == 0


def test_api_key(make_app):
    app, _ = make_app(api_key=API_KEY)
    body = {"prompt": [5], "max_tokens": 1}
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert_openai_error(client.get("/v1/models"), 401, "authentication_error")
        assert client.get("/v1/models").headers["www-authenticate"].startswith("Bearer ")
        wrong = {"Authorization": "Bearer nope"}
        assert_openai_error(client.get("/v1/models", headers=wrong), 401, "authentication_error")
        assert_openai_error(  # the Messages header does not open OpenAI routes
            client.get("/v1/models", headers={"x-api-key": API_KEY}), 401, "authentication_error"
        )
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert client.get("/v1/models", headers=good).status_code == 200
        # auth comes before parsing: a bad body without a key is still a 401
        assert_openai_error(client.post("/tokenize", content=b"{"), 401, "authentication_error")
        assert_anthropic_error(client.post(ANTHROPIC_ROUTE, json=body), 401, "authentication_error")
        assert_anthropic_error(
            client.post(ANTHROPIC_ROUTE, json=body, headers={"x-api-key": "nope"}),
            401,
            "authentication_error",
        )
        ok = client.post(ANTHROPIC_ROUTE, json=body, headers={"x-api-key": API_KEY})
        assert ok.status_code == 200
        assert_anthropic_error(client.get("/v1/messages/nope"), 401, "authentication_error")


def test_named_events_stream(client):
    response = client.post("/v1/messages/test-only/events")
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text == (
        'event: message_start\ndata: {"type":"message_start"}\n\n'
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


def test_data_stream_ends_with_done(client):
    response = client.post("/v1/test-only/stream", json={"prompt": [5, 6], "max_tokens": 3})
    lines = [line for line in response.text.split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert sum(len(__import__("json").loads(line[6:])["tokens"]) for line in lines[:-1]) == 3


def test_tokenizer_dependency_can_be_swapped(make_app):
    class Fake:
        def encode_batch(self, texts, add_special_tokens=True):
            return [type("E", (), {"ids": [1, 2], "tokens": ["a", "b"]})() for _ in texts]

    app, _ = make_app()
    app.dependency_overrides[get_tokenizer] = Fake
    with TestClient(app) as client:
        assert client.post("/tokenize", json={"prompt": "zzz"}).json()["tokens"] == [1, 2]


def test_streams_report_failures_in_stream(client):
    text = client.post("/v1/test-only/stream-fails").text
    assert text == (
        'data: {"n":1}\n\n'
        'data: {"error":{"message":"internal server error","type":"server_error",'
        '"param":null,"code":null}}\n\n'
        "data: [DONE]\n\n"
    )
    text = client.post("/v1/messages/test-only/events-fail").text
    assert text.endswith(
        'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error",'
        '"message":"stop sequence too long"}}\n\n'
    )


def test_create_app_builds_its_own_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    app = create_app(ServerConfig(engine=TINY_ENGINE))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/tokenize", json={"prompt": "tok7"}).json()["count"] >= 1
