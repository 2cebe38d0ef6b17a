"""Host-tier copies of the prefix cache: GPU → host saves and host → GPU restores of canonical
block payloads (`cache.md` §1.3, §2.3), one table.

    python benchmarks/host_tier.py [--device cuda] [--blocks 1 8 64 512] [--rounds 20]

Pools of the released shapes (sources 2, 8, 14 at ratio 2, 20 at ratio 1; FP4 rows: 113,920
payload bytes per block) and a `HostBlockPool` of pinned slots. Per batch size: the engine
thread's time per call (`save` / `restore` issue, which must not wait on the device), the
device time until the copies are done (copy bandwidth), and the CRC-32 time per block that
`poll` spends on the host once a save has landed.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
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
