"""One CSA2 attention layer: the `TILES` choice against the two-pass shapes.

    python3 benchmarks/attention_passes.py [--sequences 64 256] [--prefill 4096] [--rotate-back]
                                           [--rotate-q]

Each launch runs the `TILES` choice, the candidates that are that shape with the other
row decode (`MqaTiles.unpack_rows`), and every two-pass and Gluon (`MqaTiles.gluon`)
candidate, on the release layer of `kernel_speed --only attention` (64 heads × 512, window
128, 512 selected FP4 rows, 8K context): one token per sequence (window in the MXFP8 ring), or
one prefill chunk of N tokens ending at 8K (window from bf16 rows); each shape timed alone
(`do_bench` median, µs) with its relative difference to the torch reference. A short run for
a short device call: `kernel_speed --only attention` times every candidate at every size.

`--rotate-back`: instead, the model's output path at the `TILES` choice: the launch, a cast to
bf16 and the inverse RoPE of the 64-channel tail as its own launch (`kernels.rope`), against the
launch that rotates in its store (`sparse_mqa(..., rotate_back=freqs)`); both bit for bit the
same (checked here), µs of each.

`--rotate-q`: the model's whole call at the `TILES` choice: the queries' RoPE as its own launch
(`kernels.rope`), then the launch that rotates its output back (`rotate_back=freqs`, main's
call), against the launch that also rotates the queries as it loads them (`rotate_q=freqs` at
the same shape with `rotates_q` forced on; `TILES` gives it to the 16-head shapes only until
this says where it pays); bit for bit the same (checked here), µs of each.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.kernel_speed import _attention_traffic, _bench_us, _relative, attention_inputs
from kernels.rope import apply_rope
from kernels.sparse_mqa import CANDIDATES, choose_tiles, sparse_mqa, sparse_mqa_reference

ROPE_FREQS = 32  # the released qk_rope_head_dim 64: 32 rotated pairs of the 512 channels


def rotate_back_rows(launches: list[tuple[int, int]], device: torch.device) -> None:
    """`--rotate-back` (module docstring)."""
    freqs = 10000.0 ** (-torch.arange(ROPE_FREQS, device=device) / ROPE_FREQS)
    print(f"{'T':>5} {'tiles':<26} {'then rope µs':>12} {'rotating µs':>12} {'same bits':>9}")
    for num_seqs, new in launches:
        inputs, sources = attention_inputs(num_seqs, new, device)
        positions = inputs[2]
        tiles = choose_tiles(num_seqs * new)

        def separate(a=inputs, s=sources, p=positions, t=tiles):
            return apply_rope(sparse_mqa(*a, **s, tiles=t).bfloat16(), p, freqs, inverse=True)

        def fused(a=inputs, s=sources, t=tiles):
            return sparse_mqa(*a, **s, tiles=t, rotate_back=freqs)

        same = bool(torch.equal(separate(), fused()))
        print(f"{num_seqs * new:>5} {tiles!s:<26} {_bench_us(separate):>12.1f} "
              f"{_bench_us(fused):>12.1f} {same!s:>9}", flush=True)  # fmt: skip


def rotate_q_rows(launches: list[tuple[int, int]], device: torch.device) -> None:
    """`--rotate-q` (module docstring)."""
    freqs = 10000.0 ** (-torch.arange(ROPE_FREQS, device=device) / ROPE_FREQS)
    print(f"{'T':>5} {'tiles':<26} {'rope first µs':>13} {'rotating µs':>12} {'same bits':>9}")
    for num_seqs, new in launches:
        inputs, sources = attention_inputs(num_seqs, new, device)
        q, rest = inputs[0], inputs[1:]
        positions = inputs[2]
        tiles = choose_tiles(num_seqs * new)

        def separate(q=q, r=rest, s=sources, p=positions, t=tiles):
            rotated = apply_rope(q, p, freqs)
            return sparse_mqa(rotated, *r, **s, tiles=t, rotate_back=freqs)

        rotating = dataclasses.replace(tiles, rotates_q=True)

        def fused(q=q, r=rest, s=sources, t=rotating):
            return sparse_mqa(q, *r, **s, tiles=t, rotate_back=freqs, rotate_q=freqs)

        same = bool(torch.equal(separate(), fused()))
        print(f"{num_seqs * new:>5} {tiles!s:<26} {_bench_us(separate):>13.1f} "
              f"{_bench_us(fused):>12.1f} {same!s:>9}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[])
    parser.add_argument("--rotate-back", action="store_true", help="see the docstring")
    parser.add_argument("--rotate-q", action="store_true", help="see the docstring")
    args = parser.parse_args()
    device = torch.device("cuda")
    launches = [(num_seqs, 1) for num_seqs in args.sequences] + [(1, n) for n in args.prefill]
    if args.rotate_back:
        rotate_back_rows(launches, device)
        return
    if args.rotate_q:
        rotate_q_rows(launches, device)
        return
    every_launch = [tiles for tiles in CANDIDATES if tiles.two_pass or tiles.gluon]

    def variants_of(choice):  # the choice's shape with the candidates' other decode or stages
        def shape(tiles):
            return dataclasses.replace(tiles, unpack_rows=False, num_stages=1)

        return [t for t in CANDIDATES if t != choice and shape(t) == shape(choice)]

    print(f"{'T':>5} {'tiles':<26} {'µs':>8} {'GB/s':>7} {'TFLOP/s':>8} {'rel diff':>9}")
    for num_seqs, new in launches:
        inputs, sources = attention_inputs(num_seqs, new, device)
        reference = sparse_mqa_reference(*inputs, **sources)
        moved, flops = _attention_traffic(num_seqs, new)
        num_tokens = num_seqs * new
        choice = choose_tiles(num_tokens)
        shapes = [choice, *variants_of(choice)]
        for tiles in shapes + [t for t in every_launch if t not in shapes]:
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
