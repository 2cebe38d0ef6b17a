"""DP request placement on a skewed synthetic decode trace: projected cost vs round-robin.

    python benchmarks/placement.py [--ranks 8] [--steps 3000] [--arrivals 0.6] [--seed 0]

Prints, per policy, the mean over steps of max/mean rank step cost (1.0 = balanced; lockstep
ranks wait for the slowest) and the efficiency Σ mean / Σ max. Costs use `DecodeCost`'s
placeholder constants (relative numbers, not calibrated).
"""

from __future__ import annotations

import argparse

from engine.distributed.placement import PLACEMENT_POLICIES, DPPlacer, PlacementConfig
from engine.distributed.placement_trace import simulate, skewed_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--arrivals", type=float, default=0.6, help="requests per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = skewed_trace(args.steps, args.arrivals, seed=args.seed)
    print(f"{len(trace)} requests over {args.steps} steps on {args.ranks} ranks")
    print(f"{'policy':<16} {'max/mean':>9} {'efficiency':>11}")
    for name in PLACEMENT_POLICIES:
        config = PlacementConfig(policy=name)
        result = simulate(DPPlacer(args.ranks, config), trace, args.steps, config.cost)
        print(f"{name:<16} {result.max_over_mean:>9.3f} {result.efficiency:>11.3f}")


if __name__ == "__main__":
    main()
