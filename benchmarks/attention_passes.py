"""One CSA2 attention layer at decode sizes: the `TILES` choice against the two-pass shapes.

    python3 benchmarks/attention_passes.py [--sequences 64 256]

The release layer of `kernel_speed --only attention` (64 heads × 512, window 128 in the MXFP8
ring, 512 selected FP4 rows, 8K context), one token per sequence; each shape timed alone
(`do_bench` median, µs) with its relative difference to the torch reference. A short run for a
short device call: `kernel_speed --only attention` times every candidate at every size.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernel_speed import _attention_traffic, _bench_us, _relative, attention_inputs
from kernels.sparse_mqa import CANDIDATES, choose_tiles, sparse_mqa, sparse_mqa_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="*", default=[64, 256])
    args = parser.parse_args()
    device = torch.device("cuda")
    two_pass = [tiles for tiles in CANDIDATES if tiles.two_pass]
    print(f"{'T':>5} {'tiles':<26} {'µs':>8} {'GB/s':>7} {'TFLOP/s':>8} {'rel diff':>9}")
    for num_seqs in args.sequences:
        inputs, sources = attention_inputs(num_seqs, 1, device)
        reference = sparse_mqa_reference(*inputs, **sources)
        moved, flops = _attention_traffic(num_seqs, 1)
        for tiles in [choose_tiles(num_seqs), *two_pass]:
            try:
                error = _relative(sparse_mqa(*inputs, **sources, tiles=tiles), reference)
                us = _bench_us(lambda t=tiles, a=inputs, s=sources: sparse_mqa(*a, **s, tiles=t))
            except Exception as failure:  # noqa: BLE001 - a sweep reports and goes on
                print(f"{num_seqs:>5} {tiles!s:<26} {type(failure).__name__}: {failure}"[:300])
                continue
            print(
                f"{num_seqs:>5} {tiles!s:<26} {us:>8.1f} {moved / us / 1e3:>7.0f} "
                f"{flops / us / 1e6:>8.1f} {error:>9.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
