"""The dense projections at decode sizes: the engine's bf16 path (`dense.dense_matmul` /
`grouped_matmul` on the loader's bf16 weights, cuBLAS) against `kernels.fp8_weight_gemm` on the
checkpoint's FP8 weights (half the bytes, the same products).

    python3 benchmarks/fp8_weight_gemm.py [--tokens 16 64 256] [--all]

Shapes: `kernel_speed.DENSE_GEMMS` (the released model's FP8 dense linears). For each token
count M: µs of each (`kernel_speed._bench_us`, median), the weights' GB/s (FP8 codes and scales
for ours, bf16 for cuBLAS), the relative difference to the reference, the fastest tiles (and the
table's time where it is not the table's), and the step's share (ms): each shape times its
launches per step (`CALLS_PER_STEP`), at the fastest tiles. Default: the `choose_tiles` shape at
2, 3 and 4 pipeline stages; `--all`: every candidate of `CANDIDATES` with M's token tile.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.kernel_speed import DENSE_GEMMS, _bench_us, _relative
from engine.models.deepseek_v41.dense import dense_matmul, grouped_matmul
from engine.models.deepseek_v41.weight_formats import fp8_block_quantize
from kernels.fp8_block_gemm import dequantize_weight_reference
from kernels.fp8_weight_gemm import (
    CANDIDATES,
    choose_tiles,
    fp8_weight_gemm,
    fp8_weight_gemm_reference,
)

LAYERS = 40
# launches per decode step where a shape is not one per layer: the indexer's queries in the 8
# index-source layers, the shared expert's w1 and w3 (one shape) two per layer
CALLS_PER_STEP = {"indexer.wq_b": 8, "shared w1 (= w3)": 2 * LAYERS}


def _bf16_path(x: torch.Tensor, weight: torch.Tensor, groups: int):
    if groups == 1:
        return lambda: dense_matmul(x, weight)
    return lambda: grouped_matmul(x, weight, groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"{'M':>4} {'shape':<21} {'cuBLAS µs':>10} {'GB/s':>6} {'fp8 µs':>8} {'GB/s':>6} "
          f"{'rel diff':>9}  best tiles")  # fmt: skip
    for m in args.tokens:
        table = choose_tiles(m)
        if args.all:
            tiles_list = [table] + [
                t for t in CANDIDATES if t.block_m == table.block_m and t != table
            ]
        else:
            tiles_list = [table] + [
                dataclasses.replace(table, num_stages=s) for s in (2, 3, 4) if s != table.num_stages
            ]
        totals = [0.0, 0.0]
        for name, group_n, k, groups in DENSE_GEMMS:
            n = group_n * groups
            w = torch.randn(n, k, device=device, generator=generator) * k**-0.5
            weight, scale = fp8_block_quantize(w, 32)
            w_bf16 = dequantize_weight_reference(weight, scale, 32).bfloat16()  # the loader's
            x = torch.randn(m, groups * k, device=device, generator=generator).bfloat16()
            reference = fp8_weight_gemm_reference(x, weight, scale, groups)
            cublas_us = _bench_us(_bf16_path(x, w_bf16, groups))
            timed = {}
            for tiles in tiles_list:
                error = _relative(fp8_weight_gemm(x, weight, scale, groups=groups, tiles=tiles),
                                  reference)  # fmt: skip

                def run(tiles=tiles, x=x, weight=weight, scale=scale, groups=groups):
                    return fp8_weight_gemm(x, weight, scale, groups=groups, tiles=tiles)

                timed[tiles] = (_bench_us(run), error)
            best = min(timed, key=lambda t: timed[t][0])
            us, error = timed[best]
            fp8_bytes = n * k + scale.numel()
            print(
                f"{m:>4} {name:<21} {cublas_us:>10.1f} {2 * n * k / cublas_us / 1e3:>6.0f} "
                f"{us:>8.1f} {fp8_bytes / us / 1e3:>6.0f} {error:>9.1e}  {best}"
                + ("" if best == tiles_list[0] else f" (table {timed[tiles_list[0]][0]:.1f})"),
                flush=True,
            )
            calls = CALLS_PER_STEP.get(name, LAYERS)
            totals[0] += cublas_us * calls
            totals[1] += us * calls
        print(
            f"{m:>4} {'step':<21} {totals[0] / 1e3:>9.2f}ms {'':>6} {totals[1] / 1e3:>7.2f}ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
