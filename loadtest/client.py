"""One streaming Chat Completions request, timed token by token."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.workloads import Reply


@dataclass
class RequestRecord:
    """The timing and accounting of one request (times in seconds on the monotonic clock).

    `token_times` are the arrival times of the chunks that carried output (content, reasoning or
    tool-call text): the first gives the time to first token, gaps between them the
    inter-token latencies. Token counts come from the final usage chunk.
    """

    session: int
    turn: int
    start: float
    end: float = 0.0
    status: str = "ok"  # "ok", an HTTP status code, "timeout", "connection", "protocol"
    error: str = ""
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """(end − first token) / (completion tokens − 1): time per output token after the first."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.completion_tokens - 1)


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], session: int, turn: int
) -> tuple[RequestRecord, Reply]:
    """POST `body` (a streaming chat request) to `url`; never raises for server or network
    failures: they become the record's `status` and `error`."""
    record = RequestRecord(session=session, turn=turn, start=time.monotonic())
    reply = Reply()
    calls: dict[int, dict[str, Any]] = {}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.status = str(response.status_code)
                record.error = (await response.aread()).decode(errors="replace")[:500]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    _absorb(json.loads(line[6:]), record, reply, calls, time.monotonic())
    except httpx.TimeoutException as exc:
        record.status, record.error = "timeout", repr(exc)
    except httpx.TransportError as exc:
        record.status, record.error = "connection", repr(exc)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        record.status, record.error = "protocol", repr(exc)
    record.end = time.monotonic()
    if record.ok and record.completion_tokens == 0 and record.token_times:
        record.status, record.error = "protocol", "the stream carried no usage chunk"
    reply.ok = record.ok
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    return record, reply


def _absorb(
    chunk: dict[str, Any],
    record: RequestRecord,
    reply: Reply,
    calls: dict[int, dict[str, Any]],
    now: float,
) -> None:
    if "error" in chunk:
        record.status, record.error = "stream-error", json.dumps(chunk["error"])[:500]
        return
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", 0)
        record.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens") or 0
    for choice in chunk.get("choices", []):
        delta = choice.get("delta") or {}
        carried = bool(delta.get("content") or delta.get("reasoning_content"))
        reply.text += delta.get("content") or ""
        reply.reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            carried = True
            empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            entry = calls.setdefault(call["index"], empty)
            entry["id"] = call.get("id") or entry["id"]
            function = call.get("function") or {}
            entry["function"]["name"] += function.get("name") or ""
            entry["function"]["arguments"] += function.get("arguments") or ""
        if carried:
            record.token_times.append(now)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
