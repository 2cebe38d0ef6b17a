"""Mutation fuzzing of every POST route over HTTP: no body, however malformed, gets a 5xx.

Valid bodies of each protocol are mutated (keys dropped, values replaced by other JSON types,
junk nested in, numbers pushed out of range, strings made huge or odd); every answer must be a
non-5xx with a JSON error envelope of the route's protocol, or a normal response. Generation
lengths that survive validation are capped so the run stays fast. Deterministic by seed.

A second fuzzer, schemathesis, generates bodies (valid and invalid) from the request schemas
the server publishes in `/openapi.json` (`server/openapi.py`) for every route, and asserts the
same: no 5xx.
"""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from server.app import create_app
from server.config import ServerConfig

MODEL = "DeepSeek-V4.1-Flash"
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
]
SEEDS = {
    "/v1/chat/completions": [
        {"model": MODEL, "messages": USER, "max_tokens": 2},
        {
            "model": MODEL,
            "messages": USER,
            "max_tokens": 2,
            "stream": True,
            "tools": TOOLS,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": ["x"],
            "logprobs": True,
            "top_logprobs": 2,
            "n": 2,
            "seed": 3,
            "thinking": {"type": "disabled"},
        },
    ],
    "/v1/responses": [
        {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
        {
            "model": MODEL,
            "input": [{"role": "user", "content": "Hi"}],
            "max_output_tokens": 2,
            "stream": True,
            "reasoning": {"effort": "low"},
        },
    ],
    "/v1/messages": [
        {"model": MODEL, "max_tokens": 2, "messages": USER},
        {
            "model": MODEL,
            "max_tokens": 2,
            "messages": USER,
            "stream": True,
            "system": "s",
            "thinking": {"type": "disabled"},
            "stop_sequences": ["x"],
        },
    ],
    "/v1/messages/count_tokens": [{"model": MODEL, "messages": USER}],
    "/tokenize": [{"prompt": "Hello", "add_special_tokens": True}],
    "/detokenize": [{"tokens": [1, 2, 3]}],
}
ODD_VALUES = [
    None,
    True,
    -1,
    0,
    1,
    2**63,
    -(2**63),
    1e308,
    -1e-308,
    float("nan"),
    "",
    "x" * 5000,
    "\u0000\ud7ff\uffff",
    [],
    {},
    [None],
    {"": None},
    [[[[]]]],
    "<｜User｜>",
    0.5,
    "1",
]
LENGTH_KEYS = {"max_tokens", "max_output_tokens", "max_completion_tokens", "n"}
# The length field of each generating route: re-added when a mutation drops it, so a body that
# still validates never generates up to the context length.
LENGTH_KEY = {
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
}


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


def _set(body, path, value):
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _drop(body, path):
    target = body
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]


def _mutate(seed: dict, rng: random.Random, path: str):
    body = copy.deepcopy(seed)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths or rng.random() < 0.05:
            return rng.choice(ODD_VALUES + [[body], "not json"])
        where = rng.choice(paths)
        roll = rng.random()
        if roll < 0.3:
            _drop(body, where)
        elif roll < 0.8:
            _set(body, where, rng.choice(ODD_VALUES))
        else:
            _set(body, where, {"junk": rng.choice(ODD_VALUES)})
    if isinstance(body, dict) and path in LENGTH_KEY:
        body.setdefault(LENGTH_KEY[path], 2)
    for key in LENGTH_KEYS & set(body if isinstance(body, dict) else ()):
        value = body[key]
        if isinstance(value, int) and not isinstance(value, bool) and 2 < value < 10**6:
            body[key] = 2  # valid lengths stay short so generation is quick
    return body


def _check(response: httpx.Response, path: str) -> None:
    assert response.status_code < 500, f"{path}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and "message" in body["error"]
        else:
            assert "message" in body["error"] and "type" in body["error"]


@pytest.mark.parametrize("path", sorted(SEEDS))
def test_mutated_bodies_never_get_a_5xx(default_server, path: str) -> None:
    url = default_server[0]
    rng = random.Random(path)
    cases = 120 if path.startswith("/v1/") else 40
    statuses = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(cases):
            body = _mutate(SEEDS[path][i % len(SEEDS[path])], rng, path)
            raw = json.dumps(body, allow_nan=True) if body != "not json" else "{not json"
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            _check(response, path)
            statuses.append(response.status_code)
    # The fuzzer reaches past validation too, not only the error paths.
    assert any(status == 200 for status in statuses) and any(status == 400 for status in statuses)
    engine = default_server[2]
    scheduler = engine.core.scheduler
    scheduler.check_integrity()


# ---- schemathesis over the published OpenAPI document -------------------------------------------

SCHEMA_EXAMPLES = 30  # per operation and generation mode: the whole run stays well under a minute


# The document an app publishes (no engine is built before its lifespan starts); the live
# server publishes the same one (asserted below).
# Phases "examples" and "fuzzing" (valid and invalid bodies); the "coverage" phase enumerates
# every boundary case of every field (hundreds per route) and would take minutes.
SCHEMA_CONFIG = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_dict(create_app(ServerConfig()).openapi(), config=SCHEMA_CONFIG)


def test_the_live_server_publishes_the_fuzzed_document(default_server) -> None:
    assert httpx.get(default_server[0] + "/openapi.json").json() == schema.raw_schema


def _steer(body: object, path: str) -> None:
    """A generated `model` name becomes the served one (else nearly every body is a 404), and
    lengths stay short, so that bodies that validate generate few tokens (the fuzzer is after
    the server's answers, not after long generations)."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if path in LENGTH_KEY:
        body.setdefault(LENGTH_KEY[path], 2)
    for key in LENGTH_KEYS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[key] = 2


@schema.parametrize()
@settings(
    max_examples=SCHEMA_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@pytest.mark.slow  # every published operation, ~10 s
def test_published_schemas_never_get_a_5xx(case, default_server) -> None:
    _steer(case.body, case.path)
    response = case.call(base_url=default_server[0], timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        _check(httpx.Response(response.status_code, content=response.content), case.path)
