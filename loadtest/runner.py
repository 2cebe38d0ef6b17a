"""Drive a workload against a base URL: open loop (Poisson arrivals) or closed loop (a fixed
number of concurrent sessions), bounded by a request count and a duration; stops by itself."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import multiprocessing
import random
import re
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from loadtest.client import RequestRecord, stream_chat
from loadtest.workloads import Reply, WorkloadConfig, session


@dataclass(frozen=True)
class RunConfig:
    """How hard and how long to drive the server.

    mode "open": sessions start at Poisson times, `rate` per second (requests per second for
    single-turn workloads), whatever the server's speed. mode "closed": `concurrency` sessions
    run at once, each starting its next request when the last one ends.
    The run issues at most `num_requests` requests and none after `duration_s`; requests still
    running `grace_s` after that are cancelled (counted, not timed). The server's process CPU
    time is read from its `/metrics` (`process_cpu_seconds_total`, plus deepinfer's engine
    processes) before and after, when published.
    processes > 1 drives the load from that many client processes (one Python process streams
    some 5,000 tokens/s before it, not the server, is the bound), each with its share of the
    concurrency, rate and request count and every N-th session index (process p runs sessions
    p, p + N, ...), started together; their records are merged into one result.
    """

    base_url: str = "http://127.0.0.1:8000"
    mode: str = "closed"
    rate: float = 1.0
    concurrency: int = 4
    num_requests: int = 100
    duration_s: float = 60.0
    grace_s: float = 30.0
    request_timeout_s: float = 300.0
    api_key: str | None = None
    progress: bool = True
    seed: int = 0
    processes: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be 'open' or 'closed', got {self.mode!r}")
        if self.rate <= 0 or self.concurrency < 1 or self.num_requests < 1:
            raise ValueError("rate must be > 0, concurrency and num_requests >= 1")
        if self.duration_s <= 0 or self.grace_s < 0:
            raise ValueError("duration_s must be > 0 and grace_s >= 0")
        if self.processes < 1:
            raise ValueError("processes must be >= 1")

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.mode == "open" else f"concurrency {self.concurrency}"


@dataclass
class RunResult:
    run: RunConfig
    workload: WorkloadConfig
    records: list[RequestRecord] = field(default_factory=list)
    cancelled: int = 0
    wall_s: float = 0.0
    server_cpu_s: float | None = None  # the server's process CPU time during the run, if published
    started_at: float = 0.0  # monotonic time of the run's start (shared by every process)

    def config_dict(self) -> dict:
        return {"run": asdict(self.run), "workload": asdict(self.workload)}


class _Budget:
    """Requests left to issue and the time after which none is issued."""

    def __init__(self, config: RunConfig) -> None:
        self.left = config.num_requests
        self.deadline = time.monotonic() + config.duration_s

    def take(self) -> bool:
        if self.left <= 0 or time.monotonic() >= self.deadline:
            return False
        self.left -= 1
        return True


@dataclass(frozen=True)
class _Shard:
    """One client process's part of a run: session indices offset, offset + count, ..."""

    offset: int = 0
    count: int = 1


async def run_load(run: RunConfig, workload: WorkloadConfig) -> RunResult:
    """Run `workload` against `run.base_url`; returns every finished request's record."""
    if run.processes > 1:
        return await _run_in_processes(run, workload)
    return await _run_shard(run, workload, _Shard())


async def _run_shard(
    run: RunConfig, workload: WorkloadConfig, shard: _Shard, barrier=None
) -> RunResult:
    """The run in this process; with a `barrier` (one shard of several), it starts when every
    shard's process is ready and leaves the server's CPU to the parent."""
    result = RunResult(run=run, workload=workload)
    alone = barrier is None
    in_flight = 0
    headers = {"Authorization": f"Bearer {run.api_key}"} if run.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(run.request_timeout_s, connect=30.0)
    url = run.base_url.rstrip("/") + "/v1/chat/completions"
    bar = tqdm(total=run.num_requests, desc=run.label, unit="req", disable=not run.progress or None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        cpu_before = await _server_cpu_seconds(client, run.base_url) if alone else None
        if not alone:
            await asyncio.to_thread(barrier.wait)
        budget = _Budget(run)
        start = result.started_at = time.monotonic()

        async def one_session(index: int) -> None:
            nonlocal in_flight
            turns = session(workload, index)
            reply: Reply | None = None
            for turn in itertools.count():
                try:
                    body = turns.send(reply) if reply is not None else next(turns)
                except StopIteration:
                    return
                if not budget.take():
                    return
                in_flight += 1
                try:
                    record, reply = await stream_chat(client, url, body, index, turn)
                finally:
                    in_flight -= 1
                result.records.append(record)
                bar.update()
                if not record.ok:
                    return

        loop = _open_loop if run.mode == "open" else _closed_loop
        sessions = asyncio.ensure_future(loop(run, budget, one_session, shard))
        try:
            remaining = budget.deadline + run.grace_s - time.monotonic()
            await asyncio.wait_for(asyncio.shield(sessions), max(0.0, remaining))
        except TimeoutError:
            result.cancelled = in_flight
            sessions.cancel()
            await asyncio.gather(sessions, return_exceptions=True)
        result.wall_s = time.monotonic() - start
        cpu_after = await _server_cpu_seconds(client, run.base_url) if alone else None
    bar.close()
    if cpu_before is not None and cpu_after is not None:
        result.server_cpu_s = cpu_after - cpu_before
    return result


_PROCESS_CPU = re.compile(r"^process_cpu_seconds_total(?:\{[^}]*\})? (\S+)$", re.MULTILINE)
_ENGINE_CPU = re.compile(r"^deepinfer:engine_process_cpu_seconds\{[^}]*\} (\S+)$", re.MULTILINE)


async def _server_cpu_seconds(client: httpx.AsyncClient, base_url: str) -> float | None:
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return server_cpu_seconds(response.text) if response.status_code == 200 else None


def server_cpu_seconds(metrics_text: str) -> float | None:
    """The server's CPU seconds from its Prometheus text: `process_cpu_seconds_total` plus the
    CPU of engine ranks in processes of their own (deepinfer's `engine_process_cpu_seconds`
    gauges), so that the figure covers the whole server. None without the process metric."""
    match = _PROCESS_CPU.search(metrics_text)
    if match is None:
        return None
    return float(match.group(1)) + sum(float(v) for v in _ENGINE_CPU.findall(metrics_text))


async def _run_in_processes(run: RunConfig, workload: WorkloadConfig) -> RunResult:
    """`run` split over `run.processes` client processes (spawned, started together by a
    barrier); the server's CPU is read here, before the barrier and after the last shard."""
    count = min(run.processes, run.num_requests)
    if run.mode == "closed":
        count = min(count, run.concurrency)
    if count == 1:
        return await _run_shard(run, workload, _Shard())
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(count + 1), context.Queue()
    shards = [
        dataclasses.replace(
            run,
            processes=1,
            progress=False,
            rate=run.rate / count,
            concurrency=_share(run.concurrency, index, count),
            num_requests=_share(run.num_requests, index, count),
        )
        for index in range(count)
    ]
    procs = [
        context.Process(
            target=_shard_process,
            args=(shard, workload, _Shard(index, count), barrier, results),
            daemon=True,
        )
        for index, shard in enumerate(shards)
    ]
    for proc in procs:
        proc.start()
    limit_s = 120.0 + run.duration_s + run.grace_s + run.request_timeout_s
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            cpu_before = await _server_cpu_seconds(client, run.base_url)
            try:
                await asyncio.to_thread(barrier.wait, 120.0)
            except threading.BrokenBarrierError:
                error = await asyncio.to_thread(results.get, True, 10.0)
                raise RuntimeError(f"a load-test process failed to start: {error}") from None
            parts = [await asyncio.to_thread(results.get, True, limit_s) for _ in procs]
            cpu_after = await _server_cpu_seconds(client, run.base_url)
    finally:
        for proc in procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
    failed = [part for part in parts if isinstance(part, str)]
    if failed:
        raise RuntimeError(f"a load-test process failed: {failed[0]}")
    result = RunResult(run=run, workload=workload)
    result.started_at = min(part.started_at for part in parts)
    result.wall_s = max(part.started_at + part.wall_s for part in parts) - result.started_at
    result.records = sorted((r for part in parts for r in part.records), key=lambda r: r.start)
    result.cancelled = sum(part.cancelled for part in parts)
    if cpu_before is not None and cpu_after is not None:
        result.server_cpu_s = cpu_after - cpu_before
    return result


def _share(total: int, index: int, count: int) -> int:
    return total // count + (1 if index < total % count else 0)


def _shard_process(run: RunConfig, workload: WorkloadConfig, shard: _Shard, barrier, results):
    """A client process's body: its shard's result (or the error's text) onto `results`."""
    try:
        results.put(asyncio.run(_run_shard(run, workload, shard, barrier)))
    except BaseException as exc:  # the parent reports it; it must not wait for a result
        results.put(f"shard {shard.offset}: {type(exc).__name__}: {exc}")
        barrier.abort()


async def _open_loop(run: RunConfig, budget: _Budget, one_session, shard: _Shard) -> None:
    seed = f"{run.seed}:arrivals" if shard.count == 1 else f"{run.seed}:arrivals:{shard.offset}"
    rng = random.Random(seed)
    tasks: list[asyncio.Task] = []
    try:
        for index in itertools.count(shard.offset, shard.count):
            if budget.left <= 0 or time.monotonic() >= budget.deadline:
                break
            tasks.append(asyncio.create_task(one_session(index)))
            await asyncio.sleep(rng.expovariate(run.rate))
        await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _closed_loop(run: RunConfig, budget: _Budget, one_session, shard: _Shard) -> None:
    indices = itertools.count(shard.offset, shard.count)

    async def worker() -> None:
        while budget.left > 0 and time.monotonic() < budget.deadline:
            await one_session(next(indices))

    tasks = [asyncio.create_task(worker()) for _ in range(run.concurrency)]
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the unfinished tasks (a run past its grace time) and wait until they are gone."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
