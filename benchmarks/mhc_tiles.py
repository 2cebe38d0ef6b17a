"""Launch-1 configurations of `kernels.mhc_triplet` (precision × token tile × split × warps) at
the released width (N = 4 streams, D = 5120, fp32 residual, mix 24), against the torch path.

    python3 benchmarks/mhc_tiles.py [--tokens 16 64 256 4096] [--precision bf16x6] [--block-t 16]

Per T: each candidate's median µs for the whole site (both launches; CUDA events,
`triton.testing.do_bench`), the GB/s of the residual and fn bytes over it, and the worst
relative norm error of pre / post / comb against a float64 evaluation and against the torch fp32
path (the tests allow 5e-6 against the latter; `docs/model.md` quotes ~2e-6). "*" marks the
launcher's current choice (`CONFIGS`). Ends with the fastest candidate per T within 2e-6 of the
torch path: what to write into `kernels/mhc_triplet.CONFIGS`.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from kernels.mhc_mix import mhc_mix_reference
from kernels.mhc_triplet import (
    PRECISIONS,
    TripletConfig,
    config_for,
    mhc_logits_reference,
    mhc_triplet,
    mhc_triplet_reference,
)

N, D, NORM_EPS, HC_EPS, ITERS = 4, 5120, 1e-6, 1e-6, 20
DEVICE = "cuda"
BOUND = 2e-6
CANDIDATES = [
    TripletConfig("ieee", 16, 512, 4),  # the first kernel's shape
    *(TripletConfig("tf32x3", t, s, w) for t, s, w in ((16, 512, 4), (64, 512, 4),
                                                       (64, 2048, 4), (128, 4096, 8))),
    *(TripletConfig("bf16x6", t, s, w) for t, s, w in ((16, 256, 4), (16, 512, 4), (16, 1024, 4),
                                                       (64, 256, 4), (64, 512, 4), (64, 1024, 4),
                                                       (64, 2048, 4), (64, 4096, 4), (128, 2048, 8),
                                                       (128, 4096, 8), (128, 8192, 8))),
    # several BLOCK_K chunks per loop step (the same bits as one), and narrower splits
    *(TripletConfig("bf16x6", t, s, 4, c) for t, s, c in (
        (16, 128, 1), (16, 128, 2), (16, 256, 2), (16, 256, 4), (16, 512, 2), (16, 512, 4),
        (16, 1024, 2), (16, 1024, 4), (64, 512, 2), (64, 1024, 2), (64, 1024, 4))),
]  # fmt: skip


def site_inputs(num_tokens: int) -> list[torch.Tensor]:
    """One site's residual (fp32), fn, base, scale at the model's scales."""
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    mix = 2 * N + N * N
    residual = torch.randn(num_tokens, N, D, device=DEVICE, generator=g)
    fn = torch.randn(mix, N * D, device=DEVICE, generator=g) * (2 / (N * D) ** 0.5)
    base = torch.randn(mix, device=DEVICE, generator=g)
    scale = torch.rand(3, device=DEVICE, generator=g) + 0.5
    return [residual, fn, base, scale]


def float64_site(residual, fn, base, scale) -> tuple[torch.Tensor, ...]:
    """The site evaluated in float64 throughout (`mhc_triplet_reference` rounds z to fp32)."""
    z = residual.flatten(1).double()
    mix = (z @ fn.double().t()) * torch.rsqrt(z.square().mean(-1, keepdim=True) + NORM_EPS)
    logits = mhc_logits_reference(mix, base.double(), scale.double(), N)
    return mhc_mix_reference(logits, N, HC_EPS, ITERS)


def worst_relative(ours, reference) -> float:
    return max(
        float((a.double() - b.double()).norm() / b.double().norm())
        for a, b in zip(ours, reference, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256, 4096])
    parser.add_argument("--precision", choices=PRECISIONS, help="only this precision's candidates")
    parser.add_argument("--block-t", type=int, help="only candidates with this token tile")
    args = parser.parse_args()
    candidates = [
        config
        for config in CANDIDATES
        if args.precision in (None, config.precision) and args.block_t in (None, config.block_t)
    ]
    best: dict[int, tuple[float, TripletConfig]] = {}
    for num_tokens in args.tokens:
        inputs = site_inputs(num_tokens)
        with torch.inference_mode():
            exact = float64_site(*inputs)
            torch_fp32 = mhc_triplet_reference(*inputs, NORM_EPS, HC_EPS, ITERS)
            torch_us = 1e3 * triton.testing.do_bench(
                lambda a=inputs: mhc_triplet_reference(*a, NORM_EPS, HC_EPS, ITERS),
                warmup=5, rep=20, return_mode="median",
            )  # fmt: skip
            moved = inputs[0].numel() * 4 + inputs[1].numel() * 4
            print(f"T={num_tokens}: torch path {torch_us:8.1f} µs, vs float64 "
                  f"{worst_relative(torch_fp32, exact):.2e}", flush=True)  # fmt: skip
            for config in candidates:

                def run(a=inputs, c=config):
                    return mhc_triplet(*a, NORM_EPS, HC_EPS, ITERS, config=c)

                out = run()
                us = 1e3 * triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")
                vs_torch = worst_relative(out, torch_fp32)
                mark = "*" if config == config_for(num_tokens) else " "
                print(
                    f" {mark} {config.precision:<7} tile {config.block_t:>4} split "
                    f"{config.split_cols:>5} warps {config.num_warps:>2} chunks {config.chunks}: "
                    f"{us:8.1f} µs "
                    f"{moved / us / 1e3:7.0f} GB/s  vs float64 {worst_relative(out, exact):.2e}"
                    f"  vs torch {vs_torch:.2e}",
                    flush=True,
                )
                if vs_torch <= BOUND and us < best.get(num_tokens, (float("inf"),))[0]:
                    best[num_tokens] = (us, config)
    print(f"\nfastest within {BOUND:g} of the torch path (for kernels/mhc_triplet.CONFIGS):")
    for num_tokens, (us, config) in best.items():
        print(f"    T <= {num_tokens:>5}: {us:8.1f} µs  {config!r}")


if __name__ == "__main__":
    main()
