"""What `do_not_specialize` costs: the step-varying kernels as shipped against copies of
themselves compiled with every integer specialised (Triton's default: a value of 1 and
divisibility by 16 are compile-time facts, one variant per combination met).

    python3 benchmarks/kernel_specialisation.py [--sequences 16 64 256]

sparse_mqa: one ratio-2 CSA2 layer at 8K context, S decode tokens, the window in the MXFP8
ring (`kernel_speed.attention_inputs`, 64 heads x 512, 512 selected rows). index_scores: one
ratio-2 indexer, 64 heads x 128, J = 2048 compressed positions, S decode tokens. Each launch
timed alone (`triton.testing.do_bench`, median µs); both versions' outputs compared (they must
be equal: only the compiled code differs). A ratio near 1.0 means the shipped kernel lost
nothing by serving every step from one compiled variant.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_speed import _bench_us, attention_inputs  # noqa: E402

import kernels.index_scores as index_scores_module  # noqa: E402
import kernels.sparse_mqa as sparse_mqa_module  # noqa: E402


@contextlib.contextmanager
def specialised(module, name: str, only: str | None = None):
    """`module.name` (a JITFunction) replaced by a copy that specialises every integer, or only
    the shipped unspecialised argument `only`."""
    shipped = getattr(module, name)
    kept = unspecialised(shipped) if only else []
    copy = triton.jit(shipped.fn, do_not_specialize=[n for n in kept if n != only])
    setattr(module, name, copy)
    try:
        yield
    finally:
        setattr(module, name, shipped)


def unspecialised(jit) -> list[str]:
    """The names in a JITFunction's `do_not_specialize` (Triton keeps names or indices)."""
    return [n if isinstance(n, str) else jit.arg_names[n] for n in jit.do_not_specialize]


def index_inputs(num_seqs: int, device: torch.device) -> tuple:
    from engine.models.deepseek_v41.kv_formats import index_fp4_quantize, index_fp4_round_trip

    heads, dim, ratio, num_j = 64, 128, 2, 2048
    per_block, context = 128 // ratio, num_j * ratio
    generator = torch.Generator(device=device).manual_seed(num_seqs)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    blocks_per_seq = context // 128
    pool = index_fp4_quantize(randn(num_seqs * blocks_per_seq, per_block, dim))
    tables = torch.randperm(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1)
    iq = index_fp4_round_trip(randn(num_seqs, heads, dim))
    hw = randn(num_seqs, heads) * (dim**-0.5 * heads**-0.5)
    positions = torch.full((num_seqs,), context - 1, device=device)
    pad_index = torch.arange(num_seqs, device=device).view(num_seqs, 1)
    return iq, hw, pool, tables, ratio, pad_index, positions, num_j


def cases(sequences: list[int], device: torch.device):
    """(kernel label, module, JITFunction name, sequences, launch) per measured shape."""
    for num_seqs in sequences:
        args, sources = attention_inputs(num_seqs, 1, device)
        yield (
            "sparse_mqa (decode, ring)",
            sparse_mqa_module,
            "_sparse_mqa_kernel",
            num_seqs,
            lambda a=args, s=sources: sparse_mqa_module.sparse_mqa(*a, **s),
        )
    for num_seqs in sequences:
        args = index_inputs(num_seqs, device)
        yield (
            "index_scores (decode)",
            index_scores_module,
            "_index_scores_kernel",
            num_seqs,
            lambda a=args: index_scores_module.index_scores(*a),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument(
        "--per-argument", action="store_true", help="also each unspecialised argument alone"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    print("| kernel | sequences | shipped µs | specialised µs | shipped / specialised | equal |")
    print("|---|---|---|---|---|---|")
    for label, module, name, num_seqs, launch in cases(args.sequences, device):
        shipped_out = launch()
        shipped_us = _bench_us(launch)
        with specialised(module, name):
            specialised_out = launch()
            specialised_us = _bench_us(launch)
        equal = torch.equal(shipped_out, specialised_out)
        print(
            f"| {label} | {num_seqs} | {shipped_us:.1f} | {specialised_us:.1f} | "
            f"{shipped_us / specialised_us:.2f} | {equal} |",
            flush=True,
        )
        if not args.per_argument:
            continue
        jit = getattr(module, name)
        for only in unspecialised(jit):
            with specialised(module, name, only):
                launch()
                only_us = _bench_us(launch)
            print(f"|   only `{only}` specialised | {num_seqs} | {shipped_us:.1f} | "
                  f"{only_us:.1f} | {shipped_us / only_us:.2f} | |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
