"""Request streams shaped like chat and agent traffic, deterministic by seed.

A workload hands out sessions. A session is a generator of Chat Completions request bodies: it
yields a body, receives the `Reply` to it, and yields the next body or stops. Single-turn
workloads have one-request sessions; the agent workload's sessions resend the whole history plus
a tool result each turn, so consecutive turns share a growing prefix.

    fixed   a prompt of about `input_tokens` random words, exactly `output_tokens` out
            (`ignore_eos`), nothing shared between requests
    chat    one long system prompt shared by every request + a short distinct question
    agent   `turns` turns per session: system prompt and tools (shared), a task, then per turn
            the assistant's reply (its tool calls when it made any) and a tool result; every
            turn but the last asks for a tool call (`tool_choice: "required"`), the last `auto`

`tool_share` / `json_share` make that fraction of single-turn requests carry tools with
`tool_choice: "required"` / a `json_schema` response format. Word lists are drawn from one
seeded generator per session, so a session's bodies depend only on (seed, session index).
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
)
WORDS = tuple(_WORD_TEXT.split())

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_files",
            "description": "Search the repository for a pattern.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 200},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


@dataclass
class Reply:
    """What a session sees of the answer to its last request."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = True


Session = Generator[dict[str, Any], Reply, None]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shapes of the generated requests (token counts are approximate: one word ≈ one token)."""

    kind: str = "fixed"  # fixed | chat | agent
    input_tokens: int = 256
    output_tokens: int = 64
    system_tokens: int = 1024  # chat and agent: the shared system prompt
    turns: int = 4  # agent
    tool_result_tokens: int = 128  # agent
    tool_share: float = 0.0
    json_share: float = 0.0
    ignore_eos: bool = True  # fixed: exactly output_tokens out (vLLM/SGLang extension)
    model: str = "default"
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose from {sorted(WORKLOADS)}")
        if min(self.input_tokens, self.output_tokens, self.system_tokens, self.turns) < 1:
            raise ValueError("token counts and turns must be >= 1")
        if not (0 <= self.tool_share <= 1 and 0 <= self.json_share <= 1):
            raise ValueError("tool_share and json_share must lie in [0, 1]")
        if self.tool_share + self.json_share > 1:
            raise ValueError("tool_share + json_share must not exceed 1")


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _body(config: WorkloadConfig, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": config.model,
        "messages": messages,
        "max_tokens": config.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **config.extra_body,
        **extra,
    }


def _mix(config: WorkloadConfig, rng: random.Random) -> dict[str, Any]:
    """Tool or JSON-schema fields for the `tool_share` / `json_share` fraction of requests."""
    draw = rng.random()
    if draw < config.tool_share:
        return {"tools": TOOLS, "tool_choice": "required"}
    if draw < config.tool_share + config.json_share:
        schema = {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    return {}


def _fixed(config: WorkloadConfig, rng: random.Random) -> Session:
    messages = [{"role": "user", "content": _words(rng, config.input_tokens)}]
    mix = _mix(config, rng)
    # A grammar (tools, JSON) ends the output at EOS: ignore_eos is a 400 with one.
    eos = {"ignore_eos": True} if config.ignore_eos and not mix else {}
    yield _body(config, messages, **eos, **mix)


def _shared_system_prompt(config: WorkloadConfig) -> str:
    return "You are a helpful assistant. " + _words(
        random.Random(f"{config.seed}:system"), config.system_tokens
    )


def _chat(config: WorkloadConfig, rng: random.Random) -> Session:
    messages = [
        {"role": "system", "content": _shared_system_prompt(config)},
        {"role": "user", "content": _words(rng, config.input_tokens)},
    ]
    yield _body(config, messages, **_mix(config, rng))


def _agent(config: WorkloadConfig, rng: random.Random) -> Session:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _shared_system_prompt(config)},
        {"role": "user", "content": "Task: " + _words(rng, config.input_tokens)},
    ]
    for turn in range(config.turns):
        last = turn == config.turns - 1
        tools = {"tools": TOOLS, "tool_choice": "auto" if last else "required"}
        reply = yield _body(config, list(messages), **tools)
        if last:
            return
        result = "Result: " + _words(rng, config.tool_result_tokens)
        if reply.tool_calls:
            messages.append({"role": "assistant", "content": reply.text or None,
                             "tool_calls": reply.tool_calls})  # fmt: skip
            messages += [
                {"role": "tool", "tool_call_id": call["id"], "content": result}
                for call in reply.tool_calls
            ]
        else:  # no complete call (cut by max_tokens): the result comes as a user message
            messages.append({"role": "assistant", "content": reply.text or "(no answer)"})
            messages.append({"role": "user", "content": result})


WORKLOADS = {"fixed": _fixed, "chat": _chat, "agent": _agent}


def session(config: WorkloadConfig, index: int) -> Session:
    """Session number `index` of the workload (the same bodies for the same seed and index)."""
    return WORKLOADS[config.kind](config, random.Random(f"{config.seed}:{index}"))
