"""Soak test: mixed routes, streaming and not, cancels, for a bounded time; prints RSS and errors.

    .venv/bin/python scripts/soak.py --duration 1800 --concurrency 4            # starts a server
    .venv/bin/python scripts/soak.py --base-url http://127.0.0.1:8000 --duration 600  # uses one

Each worker loops over a seeded mix of requests: Chat Completions, Responses and Messages, each
streaming and not; streams cancelled after a few events; `/tokenize`, `/v1/models`, `/health`;
and requests that must be refused (4xx). An error is a 5xx, a connection failure, a timeout, a
4xx where a success was expected, a success where a 4xx was expected, or a stream that ends
without its protocol's final event (`[DONE]`; `response.completed` or `response.incomplete`;
`message_stop`). The server's resident memory is read from its `/metrics`
(`process_resident_memory_bytes`) at the start, every minute and at the end. Exit code 1 when
any error occurred.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL = "DeepSeek-V4.1-Flash"
NO_THINKING = {"thinking": {"type": "disabled"}}
FINAL_EVENTS = {
    "chat": ("[DONE]",),
    "responses": ('"type":"response.completed"', '"type":"response.incomplete"'),
    "messages": ('"type":"message_stop"',),
}


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[(kind, outcome)] += 1
        if outcome == "error":
            self.errors.append(f"{kind}: {detail}"[:300])


def _text(rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "delta", "soak", "test", "tokens", "cache", "hello"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))


def _body(kind: str, rng: random.Random, stream: bool) -> tuple[str, dict]:
    max_tokens = rng.randint(1, 24)
    text = _text(rng)
    if kind == "chat":
        return "/v1/chat/completions", {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
            **(NO_THINKING if rng.random() < 0.5 else {}),
        }
    if kind == "responses":
        return "/v1/responses", {
            "model": MODEL,
            "input": text,
            "max_output_tokens": max_tokens,
            "stream": stream,
            "store": False,
        }
    return "/v1/messages", {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }


async def _generation(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(["chat", "responses", "messages"])
    stream = rng.random() < 0.6
    cancel_after = rng.randint(1, 4) if stream and rng.random() < 0.3 else None
    path, body = _body(kind, rng, stream)
    label = f"{kind}{'-stream' if stream else ''}{'-cancel' if cancel_after else ''}"
    if not stream:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            tally.record(label, "error", f"{response.status_code} {response.text[:200]}")
        else:
            tally.record(label, "ok")
        return
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            tally.record(label, "error", f"{response.status_code} {response.text[:200]}")
            return
        events, final_seen = 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            compact = line.replace(" ", "")
            final_seen = final_seen or any(final in compact for final in FINAL_EVENTS[kind])
            if '"type":"error"' in compact or compact.startswith('data:{"error"'):
                tally.record(label, "error", line[:200])
                return
            if cancel_after is not None and events >= cancel_after:
                tally.record(label, "ok")
                return  # leaving the context manager closes the connection: a cancel
        if final_seen:
            tally.record(label, "ok")
        else:
            tally.record(label, "error", f"stream of {events} events without its final event")


async def _auxiliary(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    choice = rng.choice(["tokenize", "models", "health", "bad-chat", "bad-messages", "unknown"])
    if choice == "tokenize":
        response = await client.post("/tokenize", json={"model": MODEL, "prompt": _text(rng)})
        expect_ok = True
    elif choice == "models":
        response = await client.get("/v1/models")
        expect_ok = True
    elif choice == "health":
        response = await client.get("/health")
        expect_ok = True
    elif choice == "bad-chat":
        response = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": "not a list"}
        )
        expect_ok = False
    elif choice == "bad-messages":
        response = await client.post(
            "/v1/messages", json={"model": MODEL, "max_tokens": -1, "messages": []}
        )
        expect_ok = False
    else:
        response = await client.post(
            "/v1/chat/completions", json={"model": "no-such-model", "messages": []}
        )
        expect_ok = False
    ok = response.status_code == 200 if expect_ok else 400 <= response.status_code < 500
    tally.record(choice, "ok" if ok else "error", f"{response.status_code} {response.text[:200]}")


async def _worker(seed: int, base_url: str, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        while time.monotonic() < deadline:
            try:
                if rng.random() < 0.75:
                    await _generation(client, rng, tally)
                else:
                    await _auxiliary(client, rng, tally)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                tally.record("transport", "error", repr(exc))


async def _rss_mb(base_url: str) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes"):
            return float(line.split()[-1]) / 2**20
    return float("nan")


async def _monitor(base_url: str, start: float, deadline: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        await asyncio.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
        tally.rss_mb.append((time.monotonic() - start, await _rss_mb(base_url)))


async def soak(base_url: str, duration: float, concurrency: int, seed: int) -> Tally:
    tally = Tally()
    start = time.monotonic()
    tally.rss_mb.append((0.0, await _rss_mb(base_url)))
    deadline = start + duration
    await asyncio.gather(
        _monitor(base_url, start, deadline, tally),
        *(_worker(seed * 1000 + i, base_url, deadline, tally) for i in range(concurrency)),
    )
    tally.rss_mb.append((time.monotonic() - start, await _rss_mb(base_url)))
    return tally


def _start_server(port: int) -> subprocess.Popen:
    server = Path(sys.executable).with_name("deepinfer-server")
    process = subprocess.Popen([str(server), "--port", str(port)])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        time.sleep(1)
    process.terminate()
    raise SystemExit("server did not start within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--port", type=int, default=8123, help="port of the started server")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    process = None if args.base_url else _start_server(args.port)
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    try:
        tally = asyncio.run(soak(base_url, args.duration, args.concurrency, args.seed))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=120)
    total = sum(tally.counts.values())
    print(f"{total} requests in {args.duration:.0f} s at concurrency {args.concurrency}")
    for (kind, outcome), count in sorted(tally.counts.items()):
        print(f"  {kind:28s} {outcome:6s} {count}")
    print("RSS MiB over time: " + ", ".join(f"{t:.0f}s={mb:.0f}" for t, mb in tally.rss_mb))
    print(f"errors: {len(tally.errors)}")
    for error in tally.errors[:20]:
        print("  " + error)
    sys.exit(1 if tally.errors else 0)


if __name__ == "__main__":
    main()
