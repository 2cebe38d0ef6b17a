"""Event-loop CPU per streamed output token of the API path, through the real app over HTTP.

What it measures: the CPU time of the server's event-loop thread (`time.thread_time()` read
in that thread) divided by the output tokens streamed, for Chat Completions, Responses and
Messages streams, at 1 and 64 concurrent streams. Everything between the engine and the socket
is the real code: the real app (`server.app.create_app`: middleware, routes, `Recipe.prepare`,
`ResponseBridge` over the `deepseek-recipe` stream processor, `server.sse`, sse-starlette)
under a real uvicorn, read by real HTTP clients in another process (their CPU is not counted).
Only the engine is replaced: `ReplayEngine` yields one `Delta` per token (one token per step,
as the engine sends without speculation) of a fixed token script, handing the loop back
between tokens (`asyncio.sleep(0)`), with no model and no engine thread. The request's own
cost (HTTP parsing, prompt rendering and tokenizing, connection set-up) is included,
amortised over its tokens; the engine's own loop-side delivery (`AsyncEngine`'s queues) is
not. Scripts (real ids of the V4.1 tokenizer):

* `text`: 128 tokens of plain answer text, ending on the output limit (`length`);
* `reason+tool`: reasoning text, `</think>`, a short answer, one DSML tool call with two
  arguments, EOS (`stop`), 128 tokens in all, with the request's `tools`.

With `--step-ms P` the replay runs on an engine's clock instead: a thread makes one step
every P ms, a token for every open stream, and hands the step's deltas to the loop with one
`call_soon_threadsafe` (as `MultiProcessEngine`'s reader thread does with a rank's step);
each stream reads them through the engines' own `engine.choices.stream_choices`. The loop then
has P ms per step for every stream's token: where it needs more, deltas queue up, and the row's
tok/s falls below `streams × 1000 / P` (its ceiling, printed). This is the API process of
`--engine-process` under 256 streams, the engine replaced by its step clock.

A row streams batches of 64 requests (`concurrency` at a time) and shows the best batch of
`--rounds` (the least disturbed by other processes: the number is for comparisons on one
machine) and the best wall-clock output tokens/s. Each row also prints a digest of the bytes
every stream of its last round returned (the random ids and times masked), so a change of the
API path can be checked to leave every response byte unchanged: same digest before and after.

    python benchmarks/api_stream_host.py                 # the table (a few minutes)
    python benchmarks/api_stream_host.py --protocols chat --concurrency 64 --rounds 5
    python benchmarks/api_stream_host.py --gil-thread    # with an engine-like GIL holder
    python benchmarks/api_stream_host.py --step-ms 14.5 --concurrency 256 --protocols chat

The server runs in a child process (`--serve PORT`, started by the benchmark itself).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

NUM_OUTPUT_TOKENS = 128
BATCH_STREAMS = 64  # streams per measured batch (sequential rounds of `concurrency` streams)
PROTOCOLS = ("chat", "responses", "messages")
KINDS = ("text", "reason+tool")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
_TEXT = (
    "The committee met on Tuesday to review the quarterly figures, and after a long "
    "discussion of the shipping delays it agreed to move the warehouse to the north side "
    "of the river, where the new rail spur will cut the average delivery time by a third. "
)
_REASONING = "The user wants the forecast, so I should call the weather tool for the city. "


# ----------------------------------------------------------------------------- server side


def _scripts(tokenizer) -> dict[str, list[int]]:
    """The token ids of each kind's output, `NUM_OUTPUT_TOKENS` long."""
    import deepseek_recipe as dr

    plain = tokenizer.plain.encode
    text = plain(_TEXT * 8).ids[:NUM_OUTPUT_TOKENS]
    call = dr.ToolCall("c0", "get_weather", json.dumps({"city": "Zürich", "days": 3}))
    conversation = dr.Conversation(
        [dr.UserMessage("x"), dr.AssistantMessage("", tool_calls=[call])], thinking_mode=False
    )
    encoding = dr.DeepseekV41Encoding().with_special_tokens(tokenizer.special_tokens)
    ids = tokenizer.encode_prompt(encoding.render_conversation(conversation))
    end_think, dsml = tokenizer.thinking_end_token_id, tokenizer.dsml_token_id
    # ... <｜Assistant｜></think> [the DSML block the model writes] <｜end▁of▁sentence｜> ...
    assistant = tokenizer.special_ids[tokenizer.special_tokens.token(dr.SpecialToken.Assistant)]
    start = ids.index(end_think, ids.index(assistant)) + 1
    block = ids[start : ids.index(tokenizer.eos_token_id, start)]
    assert dsml in block
    tail = [end_think, *plain("Let me check.").ids, *block, tokenizer.eos_token_id]
    reasoning = plain(_REASONING * 8).ids[: NUM_OUTPUT_TOKENS - len(tail)]
    return {"text": text, "reason+tool": reasoning + tail}


class ReplayEngine:
    """An `EngineClient` that streams the current script, one token per delta."""

    def __init__(self, checkpoint_path: str) -> None:
        from engine.client import EngineInfo

        self.info = EngineInfo(
            max_model_len=65536, vocab_size=129280, eos_token_id=1, checkpoint_path=checkpoint_path
        )
        self.is_running = True
        self.failure = None
        self.script: list[int] = []

    async def start(self) -> None:
        pass

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        pass

    def check_request(self, prompt_token_ids, params, constraint=None) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    def resume_slot_payload(self, slot_id: int, generation: int) -> bytes | None:
        return None

    async def generate(
        self, prompt_token_ids, params, request_id, constraint=None, **_
    ) -> AsyncIterator:
        from engine.outputs import Delta
        from engine.request import FinishReason

        script = self.script
        finish = FinishReason.STOP if script[-1] == self.info.eos_token_id else FinishReason.LENGTH
        for i, token_id in enumerate(script):
            await asyncio.sleep(0)  # one engine step: every other stream gets its token
            yield Delta(
                request_id,
                0,
                [token_id],
                None,
                len(prompt_token_ids),
                i + 1,
                finish if i == len(script) - 1 else None,
                queue_time_s=0.0 if i == 0 else None,
            )


class SteppedReplayEngine(ReplayEngine):
    """A `ReplayEngine` on an engine's clock: every `step_s` a thread appends the next script
    token of every open stream to one step and hands the step to the loop at once."""

    def __init__(self, checkpoint_path: str, step_s: float) -> None:
        super().__init__(checkpoint_path)
        self.step_s = step_s
        self._streams: dict[str, tuple[asyncio.Queue, list[int]]] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._clock, name="replay-steps", daemon=True).start()

    async def generate(
        self, prompt_token_ids, params, request_id, constraint=None, **_
    ) -> AsyncIterator:
        from engine.choices import Choice, stream_choices

        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request_id] = (queue, [len(prompt_token_ids), 0])

        def release() -> None:
            with self._lock:
                self._streams.pop(request_id, None)

        choices = (Choice(request_id, 0, 0),)
        async for delta in stream_choices(choices, queue, lambda _: None, release):
            yield delta

    def _clock(self) -> None:
        next_step = time.perf_counter()
        while True:
            next_step += self.step_s
            time.sleep(max(0.0, next_step - time.perf_counter()))
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, self._step())

    def _step(self) -> list:
        from engine.outputs import Delta
        from engine.request import FinishReason

        script = self.script
        step = []
        with self._lock:
            if not self._streams:
                return step
            eos = script[-1] == self.info.eos_token_id
            finish = FinishReason.STOP if eos else FinishReason.LENGTH
            for request_id, (queue, counts) in list(self._streams.items()):
                num_prompt, done = counts
                if done == len(script):
                    continue
                counts[1] = done + 1
                ending = finish if done + 1 == len(script) else None
                delta = Delta(request_id, 0, [script[done]], None, num_prompt, done + 1, ending)
                step.append((queue, delta))
        return step

    @staticmethod
    def _deliver(step: list) -> None:
        for queue, delta in step:
            queue.put_nowait(delta)


def _hold_the_gil() -> None:
    """Pure-Python work forever: the engine thread's scheduling and launches, which hold the
    GIL except where a native call releases it."""
    count = 0
    while True:
        count += 1


def serve(
    port: int, gil_thread: bool, switch_interval_s: float | None, step_ms: float | None
) -> None:
    """The child: the real app over `ReplayEngine` (`SteppedReplayEngine` with a step time),
    plus `/_bench/{kind}`, which selects the script and answers the loop thread's CPU seconds
    so far."""
    import uvicorn

    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    if gil_thread:
        threading.Thread(target=_hold_the_gil, name="gil-holder", daemon=True).start()

    from engine.models.deepseek_v41.tokenizer_files import write_v41_tokenizer
    from recipe import load_tokenizer
    from server.app import create_app
    from server.config import ServerConfig

    folder = Path(tempfile.mkdtemp(prefix="api_stream_host_"))
    write_v41_tokenizer(folder)
    scripts = _scripts(load_tokenizer(folder))
    engine = (
        ReplayEngine(str(folder))
        if step_ms is None
        else SteppedReplayEngine(str(folder), step_ms / 1000)
    )
    app = create_app(ServerConfig(default_thinking=False), engine=engine)

    @app.get("/_bench/{kind}")
    async def select(kind: str) -> dict:
        engine.script = scripts[kind.replace("_", "+")]
        return {"cpu_s": time.thread_time()}

    # idle keep-alive connections stay open between rounds (the pool reuses them)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=600)


# ----------------------------------------------------------------------------- client side

_TOOLS = {
    "chat": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}],
    "responses": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
    "messages": [{"name": "get_weather", "input_schema": SCHEMA}],
}
_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
_MASK = re.compile(rb"(chatcmpl-|resp_|msg_|rs_|fc_|call_|toolu_|ctc_|msg|item)[0-9a-zA-Z_]{8,}")
_CREATED = re.compile(rb'"(created|created_at|completed_at)":\d+')


def _body(protocol: str, kind: str) -> dict:
    messages = [{"role": "user", "content": "What is the weather in Zürich this week?"}]
    body: dict = {"model": "DeepSeek-V4.1-Flash", "stream": True}
    if protocol == "chat":
        body |= {"messages": messages, "max_tokens": NUM_OUTPUT_TOKENS}
    elif protocol == "responses":
        body |= {"input": messages[0]["content"], "max_output_tokens": NUM_OUTPUT_TOKENS}
    else:
        body |= {"messages": messages, "max_tokens": 2048}
    if kind == "reason+tool":
        body["tools"] = _TOOLS[protocol]
        if protocol == "chat":
            body["chat_template_kwargs"] = {"thinking": True}
        elif protocol == "responses":
            body["reasoning"] = {"effort": "high"}
        else:
            body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return body


async def _round(client, base: str, protocol: str, kind: str, concurrency: int) -> list[bytes]:
    body = _body(protocol, kind)

    async def one() -> bytes:
        async with client.stream("POST", base + _PATHS[protocol], json=body) as response:
            data = b"".join([chunk async for chunk in response.aiter_bytes()])
        if response.status_code != 200:
            raise RuntimeError(f"{protocol} {kind}: HTTP {response.status_code}: {data[:300]!r}")
        return data

    return await asyncio.gather(*(one() for _ in range(concurrency)))


async def _cpu(client, base: str, kind: str) -> float:
    response = await client.get(f"{base}/_bench/{kind.replace('+', '_')}")
    return response.json()["cpu_s"]


async def measure(
    base: str, concurrency: list[int], rounds: int, protocols: list[str]
) -> list[tuple]:
    import httpx

    rows = []
    limits = httpx.Limits(max_connections=max(concurrency) + 1)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for protocol in protocols:
            for kind in KINDS:
                for n in concurrency:
                    await _cpu(client, base, kind)
                    await _round(client, base, protocol, kind, n)  # warm-up (connections too)
                    # every batch streams BATCH_STREAMS x 128 tokens, `n` at a time
                    num_tokens = -(-BATCH_STREAMS // n) * n * NUM_OUTPUT_TOKENS
                    us, rate = float("inf"), 0.0
                    for _ in range(rounds):
                        before, start = await _cpu(client, base, kind), time.perf_counter()
                        for _ in range(-(-BATCH_STREAMS // n)):
                            bodies = await _round(client, base, protocol, kind, n)
                        after = await _cpu(client, base, kind)
                        wall_s = time.perf_counter() - start
                        us = min(us, (after - before) / num_tokens * 1e6)
                        rate = max(rate, num_tokens / wall_s)
                    digest = hashlib.sha256()
                    for data in bodies:
                        digest.update(_CREATED.sub(rb'"\1":0', _MASK.sub(rb"\1X", data)))
                    events = sum(data.count(b"data: ") for data in bodies) / len(bodies)
                    rows.append((protocol, kind, n, us, rate, events, digest.hexdigest()[:12]))
                    print(
                        f"  {protocol:<9} {kind:<11} {n:>3} streams: {us:6.1f} us/token", flush=True
                    )
    return rows


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--rounds", type=int, default=3, help="measured batches per row (the best is shown)"
    )
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument(
        "--gil-thread",
        action="store_true",
        help="a server thread that runs Python all the time, as the engine thread does",
    )
    parser.add_argument(
        "--switch-interval", type=float, help="the server's sys.setswitchinterval (seconds)"
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        help="deliver one token per open stream every STEP_MS, from a thread (an engine's clock)",
    )
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--base", help="measure a server already started with --serve PORT")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.gil_thread, args.switch_interval, args.step_ms)
        return
    if args.base is not None:
        rows = asyncio.run(measure(args.base, args.concurrency, args.rounds, args.protocols))
        _print(rows, args.step_ms)
        return
    from engine.distributed.groups import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, __file__, "--serve", str(port)]
    if args.gil_thread:
        command.append("--gil-thread")
    if args.switch_interval is not None:
        command += ["--switch-interval", str(args.switch_interval)]
    if args.step_ms is not None:
        command += ["--step-ms", str(args.step_ms)]
    process = subprocess.Popen(command)
    try:
        _wait_ready(base + "/health", process)
        rows = asyncio.run(measure(base, args.concurrency, args.rounds, args.protocols))
    finally:
        process.terminate()
        process.wait(timeout=30)
    _print(rows, args.step_ms)


def _print(rows: list[tuple], step_ms: float | None) -> None:
    """The table; with a step clock, each row's ceiling (every stream a token every step) and
    no digest (how many steps a stream's events merge depends on the loop's lag)."""
    print(f"\nevent-loop CPU per streamed output token ({NUM_OUTPUT_TOKENS} tokens per stream)")
    last = "digest" if step_ms is None else f"ceiling at {step_ms:g} ms/step"
    print(
        f"{'protocol':<10} {'stream':<12} {'streams':>7} {'us/token':>9} {'tok/s':>7} "
        f"{'events':>7}  {last}"
    )
    for protocol, kind, n, us, rate, events, digest in rows:
        tail = digest if step_ms is None else f"{n * 1000 / step_ms:.0f}"
        print(f"{protocol:<10} {kind:<12} {n:>7} {us:>9.1f} {rate:>7.0f} {events:>7.0f}  {tail}")


if __name__ == "__main__":
    main()
