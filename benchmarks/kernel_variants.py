"""Compiled Triton variants per kernel after the engine's start (graph capture + warm-up) and
after a serving run (issue 17: serving must compile nothing).

    python3 benchmarks/kernel_variants.py [--speculative off|dspark] [--max-num-seqs 64]

Builds the engine as the server does (`AsyncEngine.from_config`, the `default` model on CUDA),
counts each `@triton.jit` kernel's in-memory variants (`JITFunction.device_caches`), runs
requests of 1, 17, 130, 600 and 2,000 prompt tokens (50 output tokens each) alone, together and
16 at once, counts again, and prints one row per kernel with a variant, plus every compile the
serving run made (Triton's post-compile hook: kernel and specialisation).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import pkgutil
import time

import triton
from triton.runtime.jit import JITFunction

import kernels
from engine.async_engine import AsyncEngine, EngineConfig
from tests.engine.test_no_compile_gpu import _jobs, _serve, recorded_compiles


def compiled_variants() -> dict[str, int]:
    """`module.kernel` -> compiled variants held in memory, over every kernels.* module."""
    counts = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                caches = getattr(value, "device_caches", {})
                counts[f"{info.name}.{name}"] = sum(len(entry[0]) for entry in caches.values())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculative", default="off", choices=["off", "dspark"])
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig().max_num_seqs)
    args = parser.parse_args()
    start = time.perf_counter()
    config = EngineConfig(
        model="default",
        device="cuda",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(EngineConfig().max_num_batched_tokens, args.max_num_seqs),
        speculative=args.speculative,
    )
    engine = AsyncEngine.from_config(config)
    warmed = compiled_variants()
    print(f"triton {triton.__version__}; engine ready in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    with recorded_compiles() as compiles:
        asyncio.run(_serve(engine, _jobs(engine.core.runner.model.config.vocab_size)))
    served = compiled_variants()
    print(f"served in {time.perf_counter() - start:.1f} s")
    print(f"{'kernel':<55} {'after warm-up':>14} {'after serving':>14}")
    for name in sorted(served):
        if served[name] or warmed.get(name):
            print(f"{name:<55} {warmed.get(name, 0):>14} {served[name]:>14}")
    print(f"{len(compiles)} compiles while serving")
    for line in compiles:
        print("  ", line)


if __name__ == "__main__":
    main()
