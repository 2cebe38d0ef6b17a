"""The dense projections of one layer at decode sizes: cuBLAS on the loader's bf16 weights (what
the engine runs now) against `kernels.fp8_weight_gemm` on the checkpoint's FP8 weights (half the
bytes, the same products).

    python3 benchmarks/fp8_weight_gemm.py [--tokens 16 64 256] [--all]

Shapes (N, K, groups): wq_a, wkv, wq_b, wo_a (8 groups), wo_b, the shared expert's w1|w3 and
w2. For each token count M: µs of each (`do_bench` median), the weights' GB/s (FP8 codes and
scales for ours, bf16 for cuBLAS), the relative difference to the reference, the fastest
tiles (and the table's time where it is not the table's), and the sum over the seven (× 40
layers: the step's share, ms, at the fastest tiles). Default: the `choose_tiles` shape at 2, 3
and 4 pipeline stages; `--all`: every candidate of `CANDIDATES` with M's token tile.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton.testing

from engine.models.deepseek_v41.weight_formats import fp8_block_quantize
from kernels.fp8_block_gemm import dequantize_weight_reference
from kernels.fp8_weight_gemm import (
    CANDIDATES,
    choose_tiles,
    fp8_weight_gemm,
    fp8_weight_gemm_reference,
)

SHAPES = {  # name: (N, K, groups) at the released widths
    "wq_a": (1280, 5120, 1),
    "wkv": (512, 5120, 1),
    "wq_b": (32768, 1280, 1),
    "wo_a": (8192, 4096, 8),
    "wo_b": (5120, 8192, 1),
    "shared w1|w3": (4608, 5120, 1),
    "shared w2": (5120, 2304, 1),
}
LAYERS = 40


def _cublas(x, weight_bf16, groups):
    if groups == 1:
        return lambda: torch.nn.functional.linear(x, weight_bf16)
    per_group = weight_bf16.view(groups, -1, weight_bf16.shape[1])
    rows = x.view(x.shape[0], groups, -1).transpose(0, 1)
    return lambda: torch.bmm(rows, per_group.transpose(1, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"{'M':>4} {'shape':<13} {'cuBLAS µs':>10} {'GB/s':>6} {'fp8 µs':>8} {'GB/s':>6} "
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
        for name, (n, k, groups) in SHAPES.items():
            w = torch.randn(n, k, device=device, generator=generator) * k**-0.5
            weight, scale = fp8_block_quantize(w, 32)
            w_bf16 = dequantize_weight_reference(weight, scale, 32).bfloat16()  # the loader's
            x = torch.randn(m, groups * k, device=device, generator=generator).bfloat16()
            reference = fp8_weight_gemm_reference(x, weight, scale, groups)
            cublas_us = triton.testing.do_bench(_cublas(x, w_bf16, groups)) * 1e3
            timed = {}
            for tiles in tiles_list:
                ours = fp8_weight_gemm(x, weight, scale, groups=groups, tiles=tiles)
                error = float((ours.float() - reference).norm() / reference.norm())

                def run(tiles=tiles, x=x, weight=weight, scale=scale, groups=groups):
                    return fp8_weight_gemm(x, weight, scale, groups=groups, tiles=tiles)

                timed[tiles] = (triton.testing.do_bench(run) * 1e3, error)
            best = min(timed, key=lambda t: timed[t][0])
            us, error = timed[best]
            fp8_bytes = n * k + scale.numel()
            print(
                f"{m:>4} {name:<13} {cublas_us:>10.1f} {2 * n * k / cublas_us / 1e3:>6.0f} "
                f"{us:>8.1f} {fp8_bytes / us / 1e3:>6.0f} {error:>9.1e}  {best}"
                + ("" if best == tiles_list[0] else f" (table {timed[tiles_list[0]][0]:.1f})"),
                flush=True,
            )
            totals[0] += cublas_us
            totals[1] += us
        print(
            f"{m:>4} {'step (x40)':<13} {totals[0] * LAYERS / 1e3:>9.2f}ms {'':>6} "
            f"{totals[1] * LAYERS / 1e3:>7.2f}ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
