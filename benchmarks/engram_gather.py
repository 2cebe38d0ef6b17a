"""Host-resident Engram tables: gather + copy-to-device throughput per step (`HostEngramTable`).

    python benchmarks/engram_gather.py [--device cuda] [--rows 8000000] [--model PATH]
                                       [--tokens 128 1024 4096 16384] [--repeats 20]
                                       [--threads N]

Per step and Engram layer a token needs 24 rows of 256 FP8 bytes + 8 scale bytes (264 B,
`scaleout.md` §1.1). For each token count this times `prefetch` (host gather into the staging
buffer, pinned on CUDA, then the copy on a side stream) until the rows are on the device
(CPU: the gather alone), for both Engram layers of a step, and prints µs per step and GB/s of
row bytes. Row ids are uniform over the table, like the n-gram hash.

The table is the checkpoint's own (mapped, as served) with `--model`; else a random table of
`--rows` rows per layer in process memory (the released tables have 384 M rows; a random-access
gather from a table larger than the CPU caches costs about the same per row at any size).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.models.deepseek_v41.engram import HostEngramTable

LOOKUPS = 24
DIM = 256


def _tables(args) -> list[HostEngramTable]:
    if args.model:
        from engine.models.deepseek_v41.checkpoint_loader import read_config
        from engine.models.deepseek_v41.engram_store import map_engram_tables
        from engine.models.embedded import resolve_model_source

        path = resolve_model_source(args.model)
        mapped = map_engram_tables(path, read_config(path))
        return [HostEngramTable(*parts) for parts in mapped.values()]
    gen = torch.Generator().manual_seed(0)
    return [
        HostEngramTable(
            torch.randint(0, 256, (args.rows, DIM), dtype=torch.uint8, generator=gen),
            torch.randint(120, 130, (args.rows, DIM // 32), dtype=torch.uint8, generator=gen),
        )
        for _ in range(2)
    ]


def _wait(tables: list[HostEngramTable], ids: list[torch.Tensor], device: torch.device) -> None:
    for table, layer_ids in zip(tables, ids, strict=True):
        table.prefetch(layer_ids, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=8_000_000)
    parser.add_argument("--model", default=None, help="a checkpoint folder or preset to map")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (host gather)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tables = _tables(args)
    row_bytes = tables[0].host_weight.shape[1] + tables[0].host_scale.shape[1]
    print(
        f"device {device}, {len(tables)} tables of {tables[0].host_weight.shape[0]:,} rows × "
        f"{row_bytes} B, torch threads {torch.get_num_threads()}"
    )
    print("tokens | rows/step | MB/step | µs/step (median) | GB/s")
    for num_tokens in args.tokens:
        gen = torch.Generator().manual_seed(num_tokens)
        times = []
        for repeat in range(args.repeats + 2):
            ids = [
                torch.randint(0, t.host_weight.shape[0], (num_tokens, LOOKUPS), generator=gen)
                for t in tables
            ]
            start = time.perf_counter()
            _wait(tables, ids, device)
            if repeat >= 2:  # the first two grow the staging buffers
                times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        rows = num_tokens * LOOKUPS * len(tables)
        moved = rows * row_bytes
        print(
            f"{num_tokens} | {rows:,} | {moved / 1e6:.2f} | {median * 1e6:,.0f} | "
            f"{moved / median / 1e9:.2f}"
        )


if __name__ == "__main__":
    main()
