"""A logging reverse proxy for running coding-agent CLIs against the server (scripts/agents_e2e.sh).

    python scripts/agents_proxy.py --upstream http://127.0.0.1:8000 --port 8100 --log out.jsonl

Every exchange is forwarded as is (streams stay streams) and summarised as one JSON line:
method, path, query, status, the request's top-level fields and the protocol-relevant headers,
and for the answer either the SSE event names (with any error event) or the JSON error.
Request bodies are not logged: they carry the client's prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

_HEADERS_LOGGED = ("anthropic-beta", "anthropic-version", "accept", "accept-encoding", "user-agent")
_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding"}


def build_app(upstream: str, log_path: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(900.0))
    counter = iter(range(1_000_000))

    async def forward(request: Request) -> StreamingResponse:
        raw = await request.body()
        entry: dict = {
            "n": next(counter),
            "t": round(time.time(), 3),
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": {k: request.headers[k] for k in _HEADERS_LOGGED if k in request.headers},
        }
        try:
            body = json.loads(raw) if raw else None
            if isinstance(body, dict):
                entry["fields"] = sorted(body)
                entry["num_tools"] = len(body.get("tools") or ())
        except ValueError:
            entry["fields"] = "not JSON"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=raw
        )
        response = await client.send(upstream_request, stream=True)
        entry["status"] = response.status_code

        async def relay():
            chunks, events, errors = [], [], []
            try:
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            finally:
                await response.aclose()
                text = b"".join(chunks).decode("utf-8", "replace")
                if "text/event-stream" in response.headers.get("content-type", ""):
                    for line in text.splitlines():
                        if line.startswith("event: "):
                            events.append(line[7:])
                        elif line.startswith("data: ") and '"error"' in line[:40]:
                            errors.append(line[6:300])
                    entry["events"] = _squeeze(events)
                    entry["stream_errors"] = errors
                elif response.status_code >= 400:
                    entry["error"] = text[:500]
                entry["elapsed_s"] = round(time.time() - entry["t"], 2)
                with log_path.open("a") as log:
                    log.write(json.dumps(entry) + "\n")

        passed = {
            k: v
            for k, v in response.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        }
        return StreamingResponse(relay(), status_code=response.status_code, headers=passed)

    methods = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def _squeeze(names: list[str]) -> list[str]:
    """Event names with runs collapsed: ["a", "b x12", "c"]."""
    out: list[str] = []
    for name in names:
        if out and out[-1].split(" x")[0] == name:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    app = build_app(args.upstream, args.log)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
