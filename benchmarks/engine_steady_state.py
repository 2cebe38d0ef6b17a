"""Where a loaded engine's steps go: a closed loop of requests, every step recorded by kind.

    python benchmarks/engine_steady_state.py [--device cuda] [--concurrency 256]
        [--requests 768] [--system-len 1024] [--prompt-len 512] [--output-len 128]
        [--speculative off] [--async-scheduling on|off] [--cuda-graph-mode segments|step]
        [--torch-profile STEPS]

The in-process engine (`AsyncEngine.from_config`, the `default` model) under the load test's
fixed workload without HTTP: `--concurrency` workers each send greedy requests back to back
(`ignore_eos`), every prompt the shared system prefix and its own random tokens, until
`--requests` have been sent; worker i starts `i · ramp / concurrency` seconds in. So requests
finish and arrive in the middle of decoding, as they do behind the server, and steps mix
prefill chunks with decode rows.

Every `core.step` call is recorded: its scheduled decode rows and prefill tokens, its host time
(the call itself), its period (to the next call's start), its device time (the runner's timer,
as the step budget sees it) and whether a step graph replayed it. Printed for the steady window
(from the first round's last completion to the last request's start): output tokens/s, TPOT,
and per kind of step (decode replayed from a step graph, decode run otherwise, mixed) the count,
share of the window and mean times. `--torch-profile N` then traces N steps of the window with
`torch.profiler` and prints the kernels by device time per step; `--cprofile TOP` profiles the
window's `core.step` calls with cProfile (the engine thread's host work; the profiler slows them).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import statistics
import time
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams


@dataclass
class StepRecord:
    start: float
    end: float
    decode_rows: int
    prefill_tokens: int
    replayed: bool
    waiting: int  # requests waiting after the step was scheduled
    free_blocks: int  # KV blocks an allocation could take then
    device_ms: float | None = None

    @property
    def kind(self) -> str:
        if self.prefill_tokens:
            return "mixed" if self.decode_rows else "prefill"
        return "decode, step graph" if self.replayed else "decode, no step graph"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=768)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative", default="off", choices=["default", "off", "dspark"])
    parser.add_argument("--async-scheduling", choices=["on", "off"], default=None)
    parser.add_argument("--cuda-graph-mode", choices=["segments", "step"], default=None)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--ramp-s", type=float, default=6.0, help="workers' start spread")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="STEPS")
    parser.add_argument("--cprofile", type=int, default=0, metavar="TOP", help="host profile")
    args = parser.parse_args()

    started = time.perf_counter()
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=max(256, args.concurrency),
        speculative=None if args.speculative == "default" else args.speculative,
        async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on",
        cuda_graph_mode=args.cuda_graph_mode,
        **({"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}),
    )
    engine = AsyncEngine.from_config(config)
    core = engine.core
    step_graphs = getattr(core.runner, "step_graphs", None)
    print(f"built in {time.perf_counter() - started:.1f} s; core {type(core).__name__}, "
          f"step graphs {'on' if step_graphs is not None else 'off'}")  # fmt: skip

    records: list[StepRecord] = []
    device_ms: list[float] = []
    scheduled_shape: list[tuple[int, int, int, int]] = []
    scheduler = core.scheduler
    unrecorded_schedule, unrecorded_step = core.scheduler.schedule, core.step
    unrecorded_observe = core.scheduler.step_budget.observe
    window = {"start": None, "profile": None, "profiled": 0}

    def schedule():
        out = unrecorded_schedule()
        decode = sum(1 for c in out.chunks if len(c.token_ids) == 1 and c.sampling is not None)
        prefill = sum(len(c.token_ids) for c in out.chunks) - decode
        free = scheduler.kv_manager.num_free_blocks
        scheduled_shape.append((decode, prefill, scheduler.num_waiting, free))
        return out

    def observe(shape, seconds):
        device_ms.append(seconds * 1e3)
        return unrecorded_observe(shape, seconds)

    host_profile = cProfile.Profile()

    def step():
        replays = step_graphs.replays if step_graphs is not None else 0
        profiling = args.cprofile and window["start"] is not None
        start = time.perf_counter()
        try:
            if profiling:
                host_profile.enable()
            return unrecorded_step()
        finally:
            if profiling:
                host_profile.disable()
            shape = scheduled_shape[-1] if scheduled_shape else (0, 0, 0, 0)
            replayed = step_graphs is not None and step_graphs.replays > replays
            records.append(StepRecord(start, time.perf_counter(), shape[0], shape[1], replayed,
                                      *shape[2:]))  # fmt: skip
            _profile_step(window, args.torch_profile)

    core.scheduler.schedule = schedule
    core.scheduler.step_budget.observe = observe
    core.step = step  # looked up per call by the engine loop
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    top_id = min(100_000, core.runner.model.config.vocab_size)
    system = [1000 + i % (top_id - 1000) for i in range(args.system_len)]
    launches: list[float] = []
    finished: list[tuple[float, float, float, int]] = []  # start, first, end, tokens

    async def one(rid: str) -> None:
        prompt = system + [rng.randrange(1000, top_id) for _ in range(args.prompt_len)]
        start, first, count = time.perf_counter(), None, 0
        launches.append(start)
        async for delta in engine.generate(prompt, params, rid):
            if delta.error:
                raise RuntimeError(f"request {rid} failed: {delta.error}")
            count += len(delta.token_ids)
            first = first or time.perf_counter()
        finished.append((start, first or start, time.perf_counter(), count))
        if len(finished) == args.concurrency:
            window["start"] = time.perf_counter()

    async def worker(index: int, counter: list[int]) -> None:
        await asyncio.sleep(index * args.ramp_s / args.concurrency)
        while counter[0] < args.requests:
            counter[0] += 1
            await one(f"steady-{index}-{counter[0]}")

    async def run() -> None:
        await engine.start()
        try:
            counter = [0]
            await asyncio.gather(*(worker(i, counter) for i in range(args.concurrency)))
        finally:
            await engine.shutdown()

    began = time.perf_counter()
    asyncio.run(run())
    print(f"{len(finished)} requests in {time.perf_counter() - began:.1f} s")
    nonempty = [r for r, shape in zip(records, scheduled_shape, strict=False) if any(shape[:2])]
    for record, ms in zip(nonempty, device_ms, strict=False):
        record.device_ms = ms
    _report(records, finished, window["start"] or began, max(launches))
    if window["profile"] is not None:
        _print_profile(window["profile"], window["profiled"])
    if args.cprofile:
        text = io.StringIO()
        pstats.Stats(host_profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        pstats.Stats(host_profile, stream=text).sort_stats("cumulative").print_stats(args.cprofile)
        print(text.getvalue())


def _profile_step(window: dict, steps: int) -> None:
    """Start the torch profiler at the window's first step; stop it `steps` steps later."""
    if not steps or window["start"] is None or window["profiled"] >= steps:
        return
    import torch

    if window["profile"] is None:
        activities = [torch.profiler.ProfilerActivity.CUDA]
        window["profile"] = torch.profiler.profile(activities=activities)
        window["profile"].start()
        return
    window["profiled"] += 1
    if window["profiled"] == steps:
        window["profile"].stop()


def _report(records: list[StepRecord], finished: list, window_start: float, window_end: float):
    if window_end <= window_start:
        window_start, window_end = records[0].start, records[-1].end
    seen = [r for r in records if window_start <= r.start < window_end]
    periods = [b.start - a.start for a, b in zip(seen, seen[1:], strict=False)]
    tokens = sum(r.decode_rows for r in seen)
    span = window_end - window_start
    done = [f for f in finished if f[0] >= window_start]
    tpot = [(end - first) / max(1, n - 1) * 1e3 for _, first, end, n in done]
    ttft = [(first - start) * 1e3 for start, first, _, _ in done]
    print(f"window {span:.1f} s, {len(seen)} steps, ~{tokens / span:.0f} decode tokens/s; "
          f"requests started in it {len(done)}: TTFT p50 {_p50(ttft):.1f} ms, "
          f"TPOT p50 {_p50(tpot):.2f} ms")  # fmt: skip
    print("| step kind | steps | share of window | period ms | host ms | device ms | "
          "decode rows | prefill tokens | waiting | free KV blocks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    kinds = sorted({r.kind for r in seen})
    for kind in kinds:
        mine = [(r, p) for r, p in zip(seen, periods, strict=False) if r.kind == kind]
        if not mine:
            continue
        steps = [r for r, _ in mine]
        share = sum(p for _, p in mine) / span
        device = [r.device_ms for r in steps if r.device_ms is not None]
        period = statistics.fmean(p for _, p in mine) * 1e3
        print(
            f"| {kind} | {len(steps)} | {share:.0%} | {period:.1f} "
            f"| {statistics.fmean(r.end - r.start for r in steps) * 1e3:.1f} "
            f"| {statistics.fmean(device) if device else float('nan'):.1f} "
            f"| {statistics.fmean(r.decode_rows for r in steps):.0f} "
            f"| {statistics.fmean(r.prefill_tokens for r in steps):.0f} "
            f"| {statistics.fmean(r.waiting for r in steps):.0f} "
            f"| {statistics.fmean(r.free_blocks for r in steps):.0f} |"
        )


def _print_profile(profile, steps: int) -> None:
    events = profile.key_averages()

    def device_us(event) -> float:
        return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)

    kernels = sorted((e for e in events if device_us(e) > 0), key=device_us, reverse=True)
    total = sum(device_us(e) for e in kernels)
    calls = sum(e.count for e in kernels)
    print(f"traced {steps} steps: {total / 1e3 / steps:.2f} ms of device time and "
          f"{calls / steps:.0f} device activities per step")  # fmt: skip
    print("| device ms per step | calls per step | name |")
    print("|---|---|---|")
    for event in kernels[:30]:
        print(f"| {device_us(event) / 1e3 / steps:.3f} | {event.count / steps:.1f} | "
              f"{event.key[:90]} |")  # fmt: skip


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


if __name__ == "__main__":
    main()
