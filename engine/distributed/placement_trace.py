"""Synthetic decode traces and a lockstep simulation to compare placement policies (tests,
`benchmarks/placement.py`). Pure Python; deterministic for a seed.

Each simulated step every rank decodes one token per running sequence; the step of the engine
costs the MAX over ranks of `DecodeCost.step_ms` (lockstep). Reported: the mean over steps of
max/mean rank cost (1.0 = perfectly balanced) and efficiency = Σ mean / Σ max.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.distributed.placement import DecodeCost, DPPlacer, PlacementRequest, RankLoad


@dataclass(frozen=True)
class TraceRequest:
    arrival_step: int
    context_len: int
    output_len: int
    affinity_key: str | None = None


def skewed_trace(
    num_steps: int, arrivals_per_step: float, seed: int = 0, long_fraction: float = 0.05
) -> list[TraceRequest]:
    """Many short chats (lognormal around 2K tokens) and a few very long prompts (100K–400K),
    outputs lognormal around 400 tokens; Poisson arrivals."""
    rng = random.Random(seed)
    trace = []
    for step in range(num_steps):
        for _ in range(_poisson(rng, arrivals_per_step)):
            if rng.random() < long_fraction:
                context = rng.randint(100_000, 400_000)
            else:
                context = min(int(rng.lognormvariate(7.6, 1.0)), 64_000)
            output = max(1, int(rng.lognormvariate(6.0, 0.8)))
            trace.append(TraceRequest(step, context, output))
    return trace


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


@dataclass(frozen=True)
class SimResult:
    max_over_mean: float
    efficiency: float


def simulate(
    placer: DPPlacer, trace: list[TraceRequest], num_steps: int, cost: DecodeCost
) -> SimResult:
    """Run `trace` through `placer` on lockstep ranks; snapshots are pushed every step."""
    num_ranks = len(placer.loads)
    running: list[list[list[int]]] = [[] for _ in range(num_ranks)]  # [context, remaining]
    by_step: dict[int, list[TraceRequest]] = {}
    for req in trace:
        by_step.setdefault(req.arrival_step, []).append(req)
    ratio_sum, total_max, total_mean, counted = 0.0, 0.0, 0.0, 0
    for step in range(num_steps):
        placer.update([RankLoad(len(r), sum(s[0] for s in r)) for r in running])
        for req in by_step.get(step, ()):
            rank = placer.place(PlacementRequest(req.context_len, req.affinity_key))
            running[rank].append([req.context_len, req.output_len])
        costs = [cost.step_ms(len(r), sum(s[0] for s in r)) for r in running]
        mean = sum(costs) / num_ranks
        ratio_sum += max(costs) / mean
        total_max += max(costs)
        total_mean += mean
        counted += 1
        for r in running:
            for seq in r:
                seq[0] += 1
                seq[1] -= 1
            r[:] = [seq for seq in r if seq[1] > 0]
    return SimResult(ratio_sum / counted, total_mean / total_max)
