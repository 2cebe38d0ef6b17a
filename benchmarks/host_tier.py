"""Host-tier copies of the prefix cache: GPU → host saves and host → GPU restores of canonical
block payloads (`cache.md` §1.3, §2.3), one table.

    python benchmarks/host_tier.py [--device cuda] [--blocks 1 8 64 512] [--rounds 20]
    python benchmarks/host_tier.py --engine [--model default] [--device cpu] [--prompt-len 1100]

Pools of the released shapes (sources 2, 8, 14 at ratio 2, 20 at ratio 1; FP4 rows: 113,920
payload bytes per block) and a `HostBlockPool` of pinned slots. Per batch size: the engine
thread's time per call (`save` / `restore` issue, which must not wait on the device), the
device time until the copies are done (copy bandwidth), and the CRC-32 time per block that
`poll` spends on the host once a save has landed.

`--engine`: TTFT of one prompt whose blocks two other prompts evicted from a GPU pool of twice
the prompt (`--swa-replay bounded`), with the host tier on and off (one engine each, the same
model): first run (uncached), then the re-run (host hits, or a recompute without the tier).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import zlib

import torch

from engine.kv_cache.host import DONE, HostBlockPool, HostPoolConfig
from engine.model_runner import RunnerBlockPayloads
from engine.models.deepseek_v41.block_layout import BlockLayout
from engine.models.deepseek_v41.kv_formats import make_codec
from engine.models.deepseek_v41.state import ModelState


def released_state(num_blocks: int, device: str) -> tuple[ModelState, BlockLayout]:
    main, index = make_codec("global_fp4", 512), make_codec("index_fp4", 128)
    rows = {2: 64, 8: 64, 14: 64, 20: 128}

    def pool(n: int, width: int) -> torch.Tensor:
        return torch.randint(0, 256, (num_blocks, n, width), dtype=torch.uint8, device=device)

    state = ModelState(
        swa=[],
        global_kv={s: pool(n, main.row_width) for s, n in rows.items()},
        index_keys={s: pool(n, index.row_width) for s, n in rows.items()},
        pending={},
        tokens=torch.zeros(1, 16, dtype=torch.long, device=device),
    )
    return state, BlockLayout.of(state, main, index)


def engine_ttft(model_name: str, device: str, prompt_len: int) -> None:
    from engine.async_engine import AsyncEngine, EngineConfig
    from engine.sampling_params import SamplingParams

    pool_tokens = -(-2 * prompt_len // 128) * 128
    model = None
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = [
        torch.randint(3, 1000, (prompt_len,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in range(3)
    ]
    print(f"{model_name} on {device}: prompt {prompt_len} tokens, GPU pool {pool_tokens} tokens")
    print("host tier | first TTFT s | re-run TTFT s | re-run cached tokens | host hit tokens")
    for host_bytes in (1 << 30, 0):
        config = EngineConfig(
            model=model_name,
            device=device,
            max_num_seqs=1,
            kv_cache_tokens=pool_tokens,
            max_model_len=pool_tokens,
            host_kv_cache_bytes=host_bytes,
        )
        if model is None:
            engine = AsyncEngine.from_config(config)
            model = engine.core.runner.model
        else:
            engine = AsyncEngine.from_model(model, config)

        async def run(engine=engine) -> list[tuple[float, int]]:
            await engine.start()
            try:
                out = []
                for i, prompt in enumerate([*prompts, prompts[0]]):
                    t0 = time.perf_counter()
                    async for delta in engine.generate(prompt, params, f"r{i}"):
                        cached = delta.num_cached_tokens
                    out.append((time.perf_counter() - t0, cached))
                return out
            finally:
                await engine.shutdown()

        times = asyncio.run(run())
        host = engine.core.scheduler.prefix_reuse.stats().hit_tokens_by_tier.get("host", 0)
        print(
            f"{'on' if host_bytes else 'off':9} | {times[0][0]:12.2f} | {times[-1][0]:13.2f} | "
            f"{times[-1][1]:20d} | {host:15d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-len", type=int, default=1100)
    args = parser.parse_args()
    if args.engine:
        engine_ttft(args.model, args.device, args.prompt_len)
        return
    num_pool = max(args.blocks) * 2
    state, layout = released_state(num_pool, args.device)
    payloads = RunnerBlockPayloads(state, layout)
    slots_needed = max(args.blocks)
    pool = HostBlockPool(
        HostPoolConfig(
            slots_needed * 4 * 114_688, layout.payload_len, pin_memory=args.device == "cuda"
        )
    )
    pool.put([i.to_bytes(32, "little") for i in range(slots_needed)], lambda _, s: DONE, "gpu")
    views = pool.read([i.to_bytes(32, "little") for i in range(slots_needed)])
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"device {args.device}, payload {layout.payload_len} B per block")
    print("blocks | save issue us | save GB/s | restore issue us | restore GB/s | crc us/block")
    for num in args.blocks:
        blocks = list(range(num))
        row = [num]
        for op in ("save", "restore"):
            issue = total = 0.0
            for _ in range(args.rounds):
                sync()
                t0 = time.perf_counter()
                if op == "save":
                    handle = payloads.save(blocks, views[:num])
                else:
                    handle = payloads.restore(views[:num], [num + b for b in blocks])
                t1 = time.perf_counter()
                handle.wait()
                sync()
                issue += t1 - t0
                total += time.perf_counter() - t0
            row += [issue / args.rounds * 1e6, num * layout.payload_len * args.rounds / total / 1e9]
        t0 = time.perf_counter()
        for view in views[:num]:
            zlib.crc32(view.numpy())
        row.append((time.perf_counter() - t0) / num * 1e6)
        print("{:6d} | {:13.1f} | {:9.2f} | {:16.1f} | {:12.2f} | {:12.1f}".format(*row))


if __name__ == "__main__":
    main()
