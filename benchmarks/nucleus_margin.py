"""Where the cut-off search kernel and the sorted rule leave the float64 rule: rows at known gaps.

    python3 benchmarks/nucleus_margin.py [--device cuda] [--vocab 129280] [--rows-per-gap 2]
        [--scales 4 1] [--out DIR]
    TRITON_INTERPRET=1 python3 benchmarks/nucleus_margin.py --device cpu   # the interpreter

For each distribution (`randn · scale`, one row) top_p is put at a float64 best-first mass plus
or minus a gap (1e-9 … 3e-6, at different boundary tokens), so the float64 rule's decision is
that far from top_p. Per row: the float64 boundary gap (`boundary_gaps`, after top_p's fp32
rounding) and how many tokens the kernel (`kernels.nucleus_cutoff`) and the sampler's sorted
rule (`sorted_top_k_top_p_cutoffs`) keep beyond the float64 set (0: the same set). Prints one
line per row and a summary; writes nucleus_margin.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine.sampler import sorted_top_k_top_p_cutoffs
from kernels.nucleus_cutoff import boundary_gaps, nucleus_cutoffs, nucleus_cutoffs_reference

GAPS = (1e-9, 1e-8, 1e-7, 1e-6, 3e-6)


def rows_at_gaps(scale: float, vocab: int, per_gap: int, device: str) -> list[dict]:
    g = torch.Generator().manual_seed(7 + int(scale))
    x = torch.randn(1, vocab, generator=g) * scale
    cum = x.double().softmax(-1).sort(descending=True).values[0].cumsum(0)
    # boundaries inside the top_p 0.9 nucleus, spread over distinct tokens
    base = int((cum < 0.9).sum()) // 2
    deltas = [d * s for d in GAPS for s in (1, -1) for _ in range(per_gap)]
    positions = [base + 37 * i for i in range(len(deltas))]
    top_p = torch.tensor([[cum[j].item() + d] for j, d in zip(positions, deltas, strict=True)])
    xs = x.expand(len(deltas), -1).contiguous().to(device)
    top_p = top_p.float().to(device)
    top_k = torch.zeros(len(deltas), 1, dtype=torch.int64, device=device)
    exact = (xs >= nucleus_cutoffs_reference(xs, top_k, top_p)).sum(-1)
    ours = (xs >= nucleus_cutoffs(xs, top_k, top_p)).sum(-1)
    rule = (xs >= sorted_top_k_top_p_cutoffs(xs, top_k, top_p)).sum(-1)
    gaps = boundary_gaps(xs, top_k, top_p)
    return [
        {
            "scale": scale,
            "gap": gaps[i].item(),
            "kernel_minus_float64": int(ours[i] - exact[i]),
            "sorted_minus_float64": int(rule[i] - exact[i]),
        }
        for i in range(len(deltas))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=129_280)
    parser.add_argument("--rows-per-gap", type=int, default=2)
    parser.add_argument("--scales", type=float, nargs="+", default=[4.0, 1.0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    results = []
    for scale in args.scales:
        for row in rows_at_gaps(scale, args.vocab, args.rows_per_gap, args.device):
            print(json.dumps(row))
            results.append(row)
    for name in ("kernel_minus_float64", "sorted_minus_float64"):
        off = [r for r in results if r[name]]
        largest = max((r["gap"] for r in off), default=0.0)
        print(f"{name}: {len(off)} of {len(results)} rows differ; largest gap {largest:.3g}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nucleus_margin.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
