"""Token-wise rejection vs block verification (`engine/speculative/acceptance.py`), synthetic.

    python -m benchmarks.acceptance_rules [--vocab 129280] [--requests 96] [--drafts 5]
                                          [--noise 0.5 1.0 2.0] [--trials 20] [--device cuda]

BENCHMARK MODE (no model): per request, `--drafts` target rows p_i = softmax(z_i) and draft rows
q_i = softmax(z_i + σ·ε_i) (a noisy oracle, σ = `--noise`; z ~ 3·N(0, 1)), drafts drawn from q
with position-keyed Gumbel noise as the engine draws them, then the product's `verify` with
`sampled_rule` `rejection` and `block` on the same rows and drafts. Reported per σ: mean
accepted drafts per request-step under each rule (over `--trials` seeds × `--requests`), and
the median wall time of one `verify` call (device-synchronised). The rows do not depend on the
drafts (a real model's do), so this measures the rule on fixed (p_i, q_i) chains; the gain on
DeepSeek-V4.1 needs real weights (random-weight drafts accept almost nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.sampler import NoisePurpose, counter_hash, gumbel_from_hash, noise_keys
from engine.speculative.acceptance import VerifyRows, verify


def _rows(args, sigma: float, trial: int) -> dict:
    g = torch.Generator().manual_seed(1000 * trial + int(100 * sigma))
    n, k, v = args.requests, args.drafts, args.vocab
    z = torch.randn(n, k + 1, v, generator=g) * 3.0
    zq = z[:, :k] + sigma * torch.randn(n, k, v, generator=g)
    dev = torch.device(args.device)
    z, zq = z.to(dev), zq.to(dev)
    seeds = torch.arange(n, device=dev) * 7919 + trial
    positions = 100 + torch.arange(1, k + 1, device=dev)
    keys = noise_keys(seeds.repeat_interleave(k), positions.repeat(n), NoisePurpose.DRAFT)
    noise = gumbel_from_hash(counter_hash(keys, torch.arange(v, device=dev))).view(n, k, v)
    drafts = (zq + noise).argmax(-1)
    row_seeds = seeds.repeat_interleave(k + 1)
    row_positions = (100 + torch.arange(1, k + 2, device=dev)).repeat(n)
    processed = z.reshape(n * (k + 1), v)
    sample_keys = noise_keys(row_seeds, row_positions, NoisePurpose.SAMPLE)
    targets = processed + gumbel_from_hash(counter_hash(sample_keys, torch.arange(v, device=dev)))
    draft_logits = torch.cat([zq, torch.zeros(n, 1, v, device=dev)], 1).reshape(-1, v)
    proposals = torch.cat([drafts, torch.full((n, 1), -1, device=dev)], 1).reshape(-1)
    return dict(
        processed=processed,
        targets=targets.argmax(-1),
        proposals=proposals,
        draft_logits=draft_logits,
        rejection=proposals >= 0,
        seeds=row_seeds,
        positions=row_positions,
        lengths=[k] * n,
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--drafts", type=int, default=5)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"vocab {args.vocab}, {args.requests} requests × {args.drafts} drafts, {args.device}")
    print("σ     accepted rejection  accepted block  gain    verify ms rejection / block")
    for sigma in args.noise:
        accepted = {"rejection": [], "block": []}
        times = {"rejection": [], "block": []}
        for trial in range(args.trials):
            rows = _rows(args, sigma, trial)
            for rule in accepted:
                _sync(args.device)
                start = time.perf_counter()
                verdict = verify(VerifyRows(**rows, sampled_rule=rule))
                _sync(args.device)
                times[rule].append(1e3 * (time.perf_counter() - start))
                accepted[rule] += verdict.accepted
        mean = {rule: statistics.fmean(a) for rule, a in accepted.items()}
        ms = {rule: statistics.median(t[1:] or t) for rule, t in times.items()}
        print(
            f"{sigma:<5} {mean['rejection']:<19.3f} {mean['block']:<15.3f} "
            f"{100 * (mean['block'] / mean['rejection'] - 1):+5.1f} %  "
            f"{ms['rejection']:.2f} / {ms['block']:.2f}"
        )


if __name__ == "__main__":
    main()
