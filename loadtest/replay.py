"""Replay a seeded trace (`loadtest.traces`) against one or several live servers: sessions start
at their arrival times, each turn after the previous reply plus the trace's think time (both
divided by `time_scale`, think times capped), with the whole history re-sent as a client does.

History is fed back the way real agents feed it: the assistant message as the server returned
it (`content`, `reasoning_content`, `tool_calls`), then the tool result (a `tool` message for
each call, else a user message: random weights rarely call tools). The server re-renders that
history and retokenizes it; where the result differs from the tokens it generated (the random
model's text does not survive detokenise → re-render → retokenise), sharing breaks inside the
previous answer. `sharing_breaks` reports where, per turn, from the usage alone: a token-exact
history would need a completions endpoint taking prompt ids, which the Chat API is not.

Several servers (`base_urls`): `route` "session" keeps a session on one server (affinity),
"turn" sends turn i of session s to server (s + i) mod n (no affinity: every later turn lands
on another server, so only a shared KV directory can serve its history). The servers' per-tier
hit tokens (`deepinfer:prefix_cache_hit_tokens_total{tier}`) are read before and after.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from loadtest.client import stream_chat
from loadtest.traces import TraceSession, Turn
from loadtest.workloads import TOOLS

BLOCK_TOKENS = 128
_HIT_TOKENS = re.compile(
    r'^deepinfer:prefix_cache_hit_tokens_total\{[^}]*tier="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE
)


@dataclass(frozen=True)
class ReplayConfig:
    """base_urls: servers (requests routed by `route`: "session" or "turn").
    time_scale: trace seconds per real second; max_think_s: real seconds a pause may last
    (chat revisits of days become this). max_output_tokens caps each turn's `max_tokens`.
    num_requests / duration_s bound the run; extra_body is merged into every request."""

    base_urls: tuple[str, ...] = ("http://127.0.0.1:8000",)
    route: str = "session"
    model: str = "DeepSeek-V4.1-Flash"
    time_scale: float = 1.0
    max_think_s: float = 5.0
    max_output_tokens: int = 32
    num_requests: int = 100
    duration_s: float = 600.0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    extra_body: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.base_urls or self.route not in ("session", "turn"):
            raise ValueError("need at least one base URL; route is 'session' or 'turn'")
        if not self.time_scale > 0 or self.max_think_s < 0 or self.max_output_tokens < 1:
            raise ValueError("time_scale > 0, max_think_s >= 0, max_output_tokens >= 1")


@dataclass
class TraceRecord:
    """One replayed request (times in seconds from the run's start)."""

    session: int
    kind: str
    turn: int
    server: int
    start: float
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: str = "ok"
    error: str = ""
    edit: str | None = None
    revisit: bool = False


class _Conversation:
    """The Chat messages of one session, as its client keeps them."""

    def __init__(self, session: TraceSession) -> None:
        self.session = session
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": session.system.words()}
        ]
        self.pending_calls: list[dict[str, Any]] = []

    def add(self, turn: Turn) -> None:
        texts = [segment.words() for segment in turn.add]
        if turn.edit == "compact":
            self.messages = [self.messages[0], _user(texts[0])]
            return
        if turn.edit == "edit":
            self.messages[1] = _user(texts[0])
            texts = texts[1:]
        for text in texts:
            if self.pending_calls:  # the tool result answers the calls of the last reply
                for call in self.pending_calls:
                    self.messages.append(
                        {"role": "tool", "tool_call_id": call["id"], "content": text}
                    )
                self.pending_calls = []
            else:
                self.messages.append(_user(text))

    def reply(self, text: str, reasoning: str, tool_calls: list[dict[str, Any]]) -> None:
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reasoning and self.session.tools:  # with tools, history keeps the reasoning
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        elif not text:
            message["content"] = ""
        self.messages.append(message)
        self.pending_calls = list(tool_calls)

    def body(self, turn: Turn, config: ReplayConfig) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": config.model,
            "messages": list(self.messages),
            "max_tokens": min(turn.output_tokens, config.max_output_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.session.tools:
            body["tools"] = TOOLS
        effort = self.session.effort
        if effort is None:
            body["thinking"] = {"type": "disabled"}
        else:
            body["reasoning_effort"] = effort
        return {**body, **dict(config.extra_body)}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def replay(
    sessions: list[TraceSession], config: ReplayConfig
) -> tuple[list[TraceRecord], dict[str, float]]:
    """Replay `sessions`; returns the records (in completion order) and the hit tokens by tier
    the servers counted during the run (empty when they publish none)."""
    records: list[TraceRecord] = []
    left = [config.num_requests]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        before = await _tier_hits(client, config.base_urls)
        start = time.monotonic()
        deadline = start + config.duration_s

        async def run_session(session: TraceSession) -> None:
            await asyncio.sleep(max(0.0, session.start_s / config.time_scale))
            conversation = _Conversation(session)
            for index, turn in enumerate(session.turns):
                if index:
                    await asyncio.sleep(min(config.max_think_s, turn.think_s / config.time_scale))
                if left[0] <= 0 or time.monotonic() >= deadline:
                    return
                left[0] -= 1
                conversation.add(turn)
                server = _route(config, session.index, index)
                url = config.base_urls[server].rstrip("/") + "/v1/chat/completions"
                body = conversation.body(turn, config)
                record, reply = await stream_chat(client, url, body, session.index, index)
                records.append(
                    TraceRecord(
                        session=session.index,
                        kind=session.kind,
                        turn=index,
                        server=server,
                        start=record.start - start,
                        ttft=record.ttft,
                        e2e=record.e2e,
                        prompt_tokens=record.prompt_tokens,
                        cached_tokens=record.cached_tokens,
                        completion_tokens=record.completion_tokens,
                        status=record.status,
                        error=record.error,
                        edit=turn.edit,
                        revisit=turn.revisit,
                    )
                )
                if not record.ok:
                    return
                conversation.reply(reply.text, reply.reasoning, reply.tool_calls)

        await asyncio.gather(*(run_session(s) for s in sessions))
        after = await _tier_hits(client, config.base_urls)
    tiers = {tier: after.get(tier, 0.0) - before.get(tier, 0.0) for tier in after}
    return records, tiers


def _route(config: ReplayConfig, session: int, turn: int) -> int:
    offset = turn if config.route == "turn" else 0
    return (session + offset) % len(config.base_urls)


async def _tier_hits(client: httpx.AsyncClient, urls: tuple[str, ...]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for url in urls:
        try:
            response = await client.get(url.rstrip("/") + "/metrics", timeout=10.0)
        except httpx.HTTPError:
            continue
        for tier, value in _HIT_TOKENS.findall(response.text):
            totals[tier] += float(value)
    return dict(totals)


# ---------------------------------------------------------------------------- reports


def by_turn(records: list[TraceRecord]) -> list[dict[str, Any]]:
    """Per turn index: requests, mean prompt tokens, cached share, TTFT p50 / p90 (ms)."""
    groups: dict[int, list[TraceRecord]] = defaultdict(list)
    for record in records:
        if record.status == "ok":
            groups[record.turn].append(record)
    rows = []
    for turn in sorted(groups):
        group = groups[turn]
        prompt = sum(r.prompt_tokens for r in group)
        ttfts = [r.ttft * 1e3 for r in group if r.ttft is not None]
        rows.append(
            {
                "turn": turn + 1,
                "requests": len(group),
                "prompt_tokens": prompt / len(group),
                "cached_share": sum(r.cached_tokens for r in group) / prompt if prompt else 0.0,
                "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
                "ttft_p90_ms": float(np.percentile(ttfts, 90)) if ttfts else None,
            }
        )
    return rows


def summary(records: list[TraceRecord]) -> dict[str, Any]:
    """Totals over the successful requests. effective prefill tokens/s = Σ prompt tokens /
    Σ TTFT, computed tokens/s = Σ (prompt − cached) / Σ TTFT: client-side figures, meaningful
    when requests rarely overlap (TTFT ≈ the request's prefill)."""
    ok = [r for r in records if r.status == "ok" and r.ttft is not None]
    later = [r for r in ok if r.turn > 0]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = sum(r.ttft for r in ok)
    later_prompt = sum(r.prompt_tokens for r in later)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len([r for r in records if r.status == "ok"]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "cached_share_after_turn_1": (
            sum(r.cached_tokens for r in later) / later_prompt if later_prompt else 0.0
        ),
        "ttft_p50_ms": float(np.percentile([r.ttft * 1e3 for r in ok], 50)) if ok else None,
        "effective_prefill_tokens_per_s": prompt / ttft if ttft else 0.0,
        "computed_prefill_tokens_per_s": (prompt - cached) / ttft if ttft else 0.0,
    }


def sharing_breaks(records: list[TraceRecord]) -> dict[str, Any]:
    """Where each later turn's reuse stopped, from the usage alone (`cached_tokens` counts
    whole 128-token blocks up to where the re-sent history first differs from the cache, or the
    whole previous sequence when a resume slot restores it).

    For turn k+1 of a session (no edit or compaction in between), the reusable prefix R is the
    previous prompt P plus, for agents, its output O (reasoning and call stay in history with
    tools; chat history drops the reasoning, so R = P − 1: `<think>` becomes `</think>`).
    Categories: "full" (cached ≥ the full blocks of R), "in previous answer" (agents: cached
    ≥ the full blocks of P but not of R: the re-rendered answer differs from the generated
    one), "before previous answer" (the history changed earlier, blocks were evicted, or
    another server lacks them). Token sums: `reusable` Σ R, `cached` Σ min(cached, R),
    `not_cached` Σ (full blocks of R − cached)⁺ (a divergence, an eviction, no cache),
    `lost_to_rounding` Σ the uncached part of R's partial last block (R mod 128 unless a resume
    slot restored it), so `cached + not_cached + lost_to_rounding = reusable`.
    """
    by_session: dict[tuple[str, int], list[TraceRecord]] = defaultdict(list)
    for record in records:
        if record.status == "ok":
            by_session[(record.kind, record.session)].append(record)
    out = {"full": 0, "in previous answer": 0, "before previous answer": 0, "reusable": 0,
           "cached": 0, "not_cached": 0, "lost_to_rounding": 0}  # fmt: skip
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, cur in zip(turns, turns[1:], strict=False):
            if cur.turn != prev.turn + 1 or cur.edit is not None:
                continue
            is_agent = cur.kind == "agent"
            reusable = (
                prev.prompt_tokens + prev.completion_tokens if is_agent else prev.prompt_tokens - 1
            )
            full = reusable // BLOCK_TOKENS * BLOCK_TOKENS
            if cur.cached_tokens >= full:
                out["full"] += 1
            elif (
                is_agent and cur.cached_tokens >= prev.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
            ):
                out["in previous answer"] += 1
            else:
                out["before previous answer"] += 1
            out["reusable"] += reusable
            cached = min(cur.cached_tokens, reusable)
            out["cached"] += cached
            out["not_cached"] += max(0, full - cached)
            out["lost_to_rounding"] += reusable - max(full, cached)
    return out


def format_report(records: list[TraceRecord], tiers: dict[str, float], label: str = "") -> str:
    """The tables `loadtest --workload agent-trace|chat-trace` prints."""
    lines = [f"trace replay {label}".rstrip()]
    lines.append(f"{'turn':>4} {'reqs':>5} {'prompt':>8} {'cached':>7} {'TTFT p50 ms':>12} "
                 f"{'p90 ms':>8}")  # fmt: skip
    for row in by_turn(records):
        p50 = "-" if row["ttft_p50_ms"] is None else f"{row['ttft_p50_ms']:.0f}"
        p90 = "-" if row["ttft_p90_ms"] is None else f"{row['ttft_p90_ms']:.0f}"
        lines.append(
            f"{row['turn']:>4} {row['requests']:>5} {row['prompt_tokens']:>8.0f} "
            f"{row['cached_share']:>7.1%} {p50:>12} {p90:>8}"
        )
    s = summary(records)
    lines.append(
        f"requests {s['ok']}/{s['requests']} ok, cached share {s['cached_share']:.1%} "
        f"({s['cached_share_after_turn_1']:.1%} after turn 1), prompt tokens "
        f"{s['prompt_tokens']}, effective prefill {s['effective_prefill_tokens_per_s']:.0f} "
        f"tokens/s (computed {s['computed_prefill_tokens_per_s']:.0f})"
    )
    b = sharing_breaks(records)
    lines.append(
        f"sharing with the previous turn: full {b['full']}, breaks in the previous answer "
        f"{b['in previous answer']}, before it {b['before previous answer']}; of "
        f"{b['reusable']} reusable tokens {b['cached']} cached, {b['not_cached']} not (history "
        f"changed, evicted, or no cache), {b['lost_to_rounding']} in partial last blocks"
    )
    if tiers:
        total = sum(tiers.values()) or 1.0
        parts = ", ".join(f"{t} {v:.0f} ({v / total:.0%})" for t, v in sorted(tiers.items()))
        lines.append(f"hit tokens by tier (server counters): {parts}")
    return "\n".join(lines)
