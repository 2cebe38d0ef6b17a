"""Host time of the engine's steps: `cProfile` on the engine thread's `step`.

    python benchmarks/engine_step_profile.py [--device cuda] [--speculative default|off|dspark]
                                             [--async-scheduling on|off] [--requests 3]
                                             [--concurrency 1] [--prompt-len 512]
                                             [--output-len 128] [--top 35]
                                             [--cuda-graph-mode segments|step]

Builds the engine as the server does (`AsyncEngine.from_config`, the `default` model), sends
`--requests` rounds of `--concurrency` greedy requests (distinct prompts), one round after the
other, and profiles every `core.step` call of all but the first (warm-up) round on the thread
that runs it. Prints each request's TTFT and TPOT (both
inflated by the profiler), the mean step time, then the functions by own time and by
cumulative time: where a step's host time goes when the GPU is not the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import time

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--speculative", default="default", choices=["default", "off", "dspark"])
    parser.add_argument("--async-scheduling", choices=["on", "off"], default=None)
    parser.add_argument("--requests", type=int, default=3, help="rounds")
    parser.add_argument("--concurrency", type=int, default=1, help="requests per round")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--cuda-graph-mode", choices=["segments", "step"], default="segments")
    args = parser.parse_args()

    started = time.perf_counter()
    config = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=256,
        speculative=None if args.speculative == "default" else args.speculative,
        async_scheduling=None if args.async_scheduling is None else args.async_scheduling == "on",
        cuda_graph_mode=args.cuda_graph_mode,
    )
    engine = AsyncEngine.from_config(config)
    core = engine.core
    print(f"built in {time.perf_counter() - started:.1f} s; core {type(core).__name__}")

    profiler = cProfile.Profile()
    step_seconds: list[float] = []
    profiling = False
    unprofiled_step = core.step

    def profiled_step():
        if not profiling:
            return unprofiled_step()
        profiler.enable()
        start = time.perf_counter()
        try:
            return unprofiled_step()
        finally:
            step_seconds.append(time.perf_counter() - start)
            profiler.disable()

    core.step = profiled_step  # looked up per call by the engine loop
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    async def one(rid: str, prompt: list[int]) -> tuple[float, float, int]:
        start, first, count = time.perf_counter(), None, 0
        async for delta in engine.generate(prompt, params, rid):
            count += len(delta.token_ids)
            first = first or time.perf_counter()
        return start, first, count, time.perf_counter()

    async def run() -> None:
        nonlocal profiling
        await engine.start()
        try:
            for i in range(args.requests):
                profiling = i > 0
                prompts = [
                    [1000 + c, *range(1000, 1000 + args.prompt_len - 1)]
                    for c in range(args.concurrency)
                ]
                done = await asyncio.gather(
                    *(one(f"profile-{i}-{c}", p) for c, p in enumerate(prompts))
                )
                ttft = sorted(first - start for start, first, _, _ in done)[len(done) // 2]
                tpot = sorted((end - first) / max(1, n - 1) for _, first, n, end in done)
                tokens = sum(n for *_, n, _ in done)
                print(f"round {i}: {len(done)} requests, {tokens} tokens, TTFT p50 "
                      f"{ttft * 1e3:.1f} ms, TPOT p50 {tpot[len(tpot) // 2] * 1e3:.2f} ms"
                      f"{' (profiled)' if profiling else ''}")  # fmt: skip
        finally:
            await engine.shutdown()

    asyncio.run(run())
    if step_seconds:
        mean_ms = sum(step_seconds) / len(step_seconds) * 1e3
        print(f"profiled steps {len(step_seconds)}, mean {mean_ms:.2f} ms")
    step_graphs = core.runner.step_graphs
    if step_graphs is not None:
        print(
            f"step graphs: {step_graphs.replays} replays, shapes {sorted(step_graphs.graphs)}, "
            f"failed captures {step_graphs.graph_failures() or 'none'}"
        )
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
