"""Issue 13 through the live `default` server: body limits, nesting, keep-alive after errors,
request ids, media types, stop limits, health, OpenAPI schemas, and responsiveness while a
large request is prepared."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from server.limits import DEFAULT_MAX_REQUEST_BYTES, MAX_JSON_DEPTH

from .conftest import live_server

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Hi"}]
GOOD = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": USER},
}
POST_ROUTES = [*GOOD, "/tokenize", "/detokenize"]


def nested(depth: int) -> object:
    value: object = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def assert_envelope(response: httpx.Response, path: str, status: int) -> dict:
    assert response.status_code == status, (path, response.status_code, response.text[:300])
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


# ---- item 4: body limit ------------------------------------------------------------------------


@pytest.mark.parametrize("path", POST_ROUTES)
def test_declared_oversize_body_is_413_before_it_is_read(default_server, path):
    host, port = host_port(default_server[0])
    with socket.create_connection((host, port), timeout=10) as sock:
        # Only the headers are sent: the answer must come without reading the body.
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {DEFAULT_MAX_REQUEST_BYTES + 1}\r\n\r\n".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):  # the server closes the connection after the 413
            reply += chunk
        reply = reply.decode()
    head, _, body = reply.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert "connection: close" in head.lower()
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["error"]["type"] == "request_too_large"
    else:
        assert error["error"]["type"] == "invalid_request_error"


def test_chunked_oversize_body_is_413(default_server):
    def chunks():
        piece = b" " * (1024 * 1024)
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [], "pad": "'
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // len(piece) + 2):
            yield piece

    with httpx.Client(base_url=default_server[0], timeout=30) as client:
        for path in ("/v1/chat/completions", "/v1/messages"):
            response = client.post(
                path, content=chunks(), headers={"content-type": "application/json"}
            )
            assert "content-length" not in response.request.headers  # really chunked
            assert_envelope(response, path, 413)


@pytest.mark.parametrize(
    ("path", "status"),
    [("/v1/chat/completions", 400), ("/tokenize", 200)],
)
def test_health_answers_while_a_large_request_is_prepared(default_server, path, status):
    url = default_server[0]
    # ~2.4 MB of text: allowed by size, ~800k tokens to encode (seconds on the CPU); a chat
    # request then gets a 400 for the context length. Meanwhile /health must keep answering.
    body: dict = {"model": MODEL, "prompt": "hi " * 800_000, "return_token_strs": True}
    if path != "/tokenize":
        body = {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi " * 800_000}],
        }
    result: dict = {}

    def big() -> None:
        started = time.monotonic()
        response = httpx.post(url + path, json=body, timeout=120)
        result["status"], result["took"] = response.status_code, time.monotonic() - started

    worker = threading.Thread(target=big)
    worker.start()
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        time.sleep(0.3)  # the upload is done, preparation under way
        while worker.is_alive():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    worker.join()
    assert result["status"] == status, result
    # A blocked event loop answers /health once, after the preparation: too few answers.
    assert len(latencies) >= 5, f"/health answered {len(latencies)} time(s): {latencies}"
    # (the Rust-to-Python list of 800k ids holds the GIL for a few hundred ms on a busy machine)
    assert max(latencies) < min(1.0, result["took"] / 4), (max(latencies), result["took"])


# ---- item 5: nesting, keep-alive after errors, request ids, one log line per error -----------


@pytest.mark.parametrize("path", POST_ROUTES)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200, 100_000])
def test_deep_nesting_is_400_and_the_connection_stays_usable(default_server, path, depth):
    host, port = host_port(default_server[0])
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        # Built as text: json.dumps itself recurses and cannot write 100,000 levels.
        prefix = json.dumps({"model": MODEL, "messages": USER})[:-1]
        body = prefix + ', "metadata": ' + "[" * depth + "]" * depth + "}"
        conn.request("POST", path, body, {"content-type": "application/json"})
        response = conn.getresponse()
        payload = json.loads(response.read())
        assert response.status == 400, payload
        assert response.getheader("connection") != "close"
        assert response.getheader("x-request-id", "").startswith("req_")
        message = payload["error"]["message"]
        assert f"deeper than {MAX_JSON_DEPTH}" in message
        local = conn.sock.getsockname()
        # The same keep-alive connection serves the next request.
        conn.request("GET", "/health")
        again = conn.getresponse()
        assert again.status == 200 and json.loads(again.read()) == {"status": "ok"}
        assert conn.sock.getsockname() == local
    finally:
        conn.close()


def test_nesting_at_the_limit_is_not_refused_for_depth(default_server):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "examples": [nested(MAX_JSON_DEPTH - 6)]},
        },
    }
    body = {**GOOD["/v1/chat/completions"], "tools": [tool]}
    assert _depth_of(body) == MAX_JSON_DEPTH
    response = httpx.post(default_server[0] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]


def _depth_of(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth_of(v) for v in value), default=0)
    return 0


def test_a_500_is_one_log_line_with_the_request_id_and_keeps_the_connection(make_app, caplog):
    app, _ = make_app()
    with live_server(app) as url, caplog.at_level(logging.INFO):
        host, port = host_port(url)
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/v1/test-only/boom")
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 500 and body["error"]["message"] == "internal server error"
        assert response.getheader("connection") != "close"
        request_id = response.getheader("x-request-id")
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    (record,) = errors
    assert request_id in record.getMessage() and "RuntimeError" in record.getMessage()
    assert record.exc_info is None and "\n" not in record.getMessage()


def test_every_response_has_a_distinct_request_id(default_server):
    with httpx.Client(base_url=default_server[0]) as client:
        ids = {client.get("/health").headers["x-request-id"] for _ in range(3)}
        ids.add(client.get("/nope").headers["x-request-id"])
    assert len(ids) == 4 and all(i.startswith("req_") for i in ids)


# ---- item 10: smaller ones ----------------------------------------------------------------------


def test_client_leaving_mid_upload_is_logged_without_traceback(default_server, caplog):
    host, port = host_port(default_server[0])
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"model":'
            )
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
            "during the upload" in r.getMessage() for r in caplog.records
        ):
            time.sleep(0.05)
    (record,) = [r for r in caplog.records if "during the upload" in r.getMessage()]
    assert record.levelno == logging.INFO and record.exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_non_json_content_type_is_415(default_server, path):
    body = json.dumps(GOOD.get(path, {"prompt": "x"}))
    for content_type in ("text/plain", "multipart/form-data; boundary=x", "application/xml"):
        response = httpx.post(
            default_server[0] + path, content=body, headers={"content-type": content_type}
        )
        assert_envelope(response, path, 415)


def test_lenient_content_types_are_read_as_json(default_server):
    url = default_server[0] + "/v1/chat/completions"
    body = json.dumps(GOOD["/v1/chat/completions"]).encode()
    for headers in (
        {},  # no Content-Type at all
        {"content-type": "application/x-www-form-urlencoded"},  # curl -d
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "application/vnd.api+json"},
    ):
        with httpx.Client(timeout=60) as client:
            request = client.build_request("POST", url, content=body, headers=headers)
            assert ("content-type" in request.headers) == bool(headers)
            response = client.send(request)
        assert response.status_code == 200, (headers, response.text[:200])


def test_chat_refuses_more_than_four_stop_sequences(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, stop=["a", "b", "c", "d", "e"]
        )
    assert info.value.body["param"] == "stop"
    out = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, stop=list("abcd"))
    assert out.choices[0].finish_reason is not None


def test_health_is_json(default_server):
    response = httpx.get(default_server[0] + "/health")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"status": "ok"}


def test_openapi_publishes_request_schemas_and_errors(default_server):
    document = httpx.get(default_server[0] + "/openapi.json").json()
    for path in GOOD:
        operation = document["paths"][path]["post"]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["required"]
        for status in ("400", "413", "415"):
            assert status in operation["responses"], (path, status)
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"429", "503"} <= set(chat["responses"])
    assert "529" in document["paths"]["/v1/messages"]["post"]["responses"]
    assert "503" in document["paths"]["/health"]["get"]["responses"]


def test_openapi_error_envelopes_are_published_once_and_referenced(default_server):
    document = httpx.get(default_server[0] + "/openapi.json").json()
    schemas = document["components"]["schemas"]
    assert schemas["OpenAIError"]["required"] == ["error"]
    assert schemas["AnthropicError"]["properties"]["type"]["const"] == "error"
    anthropic = {"/v1/messages", "/v1/messages/count_tokens"}
    referenced = set()
    for path, operations in document["paths"].items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if status < "400" or status == "422" or "content" not in response:
                    continue  # 422: FastAPI's own HTTPValidationError
                ref = response["content"]["application/json"]["schema"].get("$ref")
                name = "AnthropicError" if path in anthropic else "OpenAIError"
                assert ref == f"#/components/schemas/{name}", (path, status)
                referenced.add(name)
    assert referenced == {"OpenAIError", "AnthropicError"}
