"""One CSA2 attention layer: the `TILES` choice against the two-pass shapes.

    python3 benchmarks/attention_passes.py [--sequences 64 256] [--prefill 4096]

The release layer of `kernel_speed --only attention` (64 heads × 512, window 128, 512 selected
FP4 rows, 8K context): one token per sequence (window in the MXFP8 ring), or one prefill chunk
of N tokens ending at 8K (window from bf16 rows); each shape timed alone (`do_bench` median,
µs) with its relative difference to the torch reference. A short run for a short device call:
`kernel_speed --only attention` times every candidate at every size.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_speed import _attention_traffic, _bench_us, _relative, attention_inputs
from kernels.sparse_mqa import CANDIDATES, choose_tiles, sparse_mqa, sparse_mqa_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[])
    args = parser.parse_args()
    device = torch.device("cuda")
    two_pass = [tiles for tiles in CANDIDATES if tiles.two_pass]
    print(f"{'T':>5} {'tiles':<26} {'µs':>8} {'GB/s':>7} {'TFLOP/s':>8} {'rel diff':>9}")
    launches = [(num_seqs, 1) for num_seqs in args.sequences] + [(1, n) for n in args.prefill]
    for num_seqs, new in launches:
        inputs, sources = attention_inputs(num_seqs, new, device)
        reference = sparse_mqa_reference(*inputs, **sources)
        moved, flops = _attention_traffic(num_seqs, new)
        num_tokens = num_seqs * new
        for tiles in [choose_tiles(num_tokens), *two_pass]:
            try:
                error = _relative(sparse_mqa(*inputs, **sources, tiles=tiles), reference)
                us = _bench_us(lambda t=tiles, a=inputs, s=sources: sparse_mqa(*a, **s, tiles=t))
            except Exception as failure:  # noqa: BLE001 - a sweep reports and goes on
                print(f"{num_tokens:>5} {tiles!s:<26} {type(failure).__name__}: {failure}"[:300])
                continue
            print(
                f"{num_tokens:>5} {tiles!s:<26} {us:>8.1f} {moved / us / 1e3:>7.0f} "
                f"{flops / us / 1e6:>8.1f} {error:>9.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
