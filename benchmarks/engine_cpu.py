"""Engine throughput on the CPU: concurrent requests through `AsyncEngine`, one table.

    python benchmarks/engine_cpu.py [--model default] [--concurrency 1 8 32] [--prompt-len 512]
                                    [--output-len 128] [--async-scheduling on off]
                                    [--rounds 1] [--device cpu] [--dtype D]
                                    [--speculative off|dspark]

With `--device cuda` it compares the loops on the GPU as well (`--speculative dspark`: the
DSpark loop, `engine/speculative/overlap.py` against the synchronous speculative loop).

Every request has its own random prompt (no shared prefix) and generates exactly --output-len
tokens (ignore_eos). Reports output tokens/s, all tokens/s, median time to first token and the
number of engine steps and steps/s, with async scheduling on and off interleaved (the same
model; one engine each), so that both modes see the same machine load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import torch

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams


async def _one(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str):
    t0 = time.perf_counter()
    first = None
    count = 0
    async for delta in engine.generate(prompt, params, rid):
        if first is None and delta.token_ids:
            first = time.perf_counter() - t0
        count += len(delta.token_ids)
    return first, count


async def run(engine: AsyncEngine, concurrency: int, prompt_len: int, output_len: int) -> dict:
    g = torch.Generator().manual_seed(concurrency)
    vocab = engine.core.runner.model.config.vocab_size
    prompts = [
        [0] + torch.randint(3, min(vocab, 100000), (prompt_len - 1,), generator=g).tolist()
        for _ in range(concurrency)
    ]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps0 = engine.step_count
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(_one(engine, p, params, f"c{concurrency}-{i}") for i, p in enumerate(prompts))
    )
    elapsed = time.perf_counter() - t0
    generated = sum(c for _, c in results)
    return {
        "concurrency": concurrency,
        "seconds": elapsed,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + concurrency * prompt_len) / elapsed,
        "ttft_median_s": statistics.median(f for f, _ in results),
        "steps": engine.step_count - steps0,
        "steps_s": (engine.step_count - steps0) / elapsed,
    }


async def main_async(args: argparse.Namespace) -> None:
    config = EngineConfig(
        model=args.model,
        max_num_seqs=max(args.concurrency),
        kv_cache_tokens=max(args.concurrency) * (args.prompt_len + args.output_len + 256),
        max_model_len=args.prompt_len + args.output_len + 256,
        max_num_batched_tokens=args.max_batched_tokens,
        device=args.device,
        dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
        speculative=args.speculative,
    )
    first = AsyncEngine.from_config(dataclasses.replace(config, async_scheduling=True))
    model = first.core.runner.model
    engines = {"on": first}
    engines["off"] = AsyncEngine.from_model(
        model, dataclasses.replace(config, async_scheduling=False)
    )
    print(
        f"model {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"prompt {args.prompt_len}, output {args.output_len}, {args.rounds} round(s), "
        f"device {args.device}, core {type(first.core).__name__}, "
        "async scheduling on and off interleaved"
    )
    print(
        f"{'conc':>4} {'async':>5} {'seconds':>8} {'out tok/s':>10} {'all tok/s':>10} "
        f"{'TTFT p50 s':>11} {'steps':>6} {'steps/s':>8}"
    )
    for engine in engines.values():
        await engine.start()
    for c in args.concurrency:
        for _ in range(args.rounds):
            for mode in args.async_scheduling:
                r = await run(engines[mode], c, args.prompt_len, args.output_len)
                print(
                    f"{r['concurrency']:>4} {mode:>5} {r['seconds']:>8.1f} "
                    f"{r['output_tok_s']:>10.1f} {r['total_tok_s']:>10.1f} "
                    f"{r['ttft_median_s']:>11.2f} {r['steps']:>6} {r['steps_s']:>8.2f}"
                )
    for engine in engines.values():
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=32768)
    parser.add_argument(
        "--async-scheduling",
        nargs="+",
        choices=["on", "off"],
        default=["on", "off"],
        help="modes to run, interleaved per round (the same model, one engine each)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="repetitions per concurrency")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, else bfloat16")
    parser.add_argument(
        "--speculative",
        choices=["off", "dspark"],
        default=None,
        help="speculative decoding (default: the engine's, dspark on CUDA)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
