"""DP request placement: DeepSeek's decode rule, capacity, bursts, affinity, skewed traces."""

from __future__ import annotations

import pytest

from engine.distributed.placement import (
    DecodeCost,
    DPPlacer,
    PlacementConfig,
    PlacementRequest,
    RankLoad,
)
from engine.distributed.placement_trace import simulate, skewed_trace

COST = DecodeCost(a=5.0, b=0.02, c=2e-6)  # one sequence costs as much as 10K KV tokens


def _placer(loads: list[RankLoad], **config) -> DPPlacer:
    placer = DPPlacer(len(loads), PlacementConfig(cost=COST, **config))
    placer.update(loads)
    return placer


def test_count_and_kv_length_are_balanced_together() -> None:
    """Neither fewest-requests nor least-KV alone: the projected step cost decides."""
    for context_len in (500, 200_000):
        request = PlacementRequest(context_len)
        # Few sequences with long caches (cost 0.9) vs many short ones (0.68): the KV term wins.
        long_kv = [RankLoad(num_seqs=4, kv_tokens=400_000), RankLoad(num_seqs=30, kv_tokens=30_000)]
        assert _placer(long_kv).place(request) == 1
        # Few sequences with longer caches (0.3) vs many short ones (0.68): the count term wins.
        few = [RankLoad(num_seqs=4, kv_tokens=100_000), RankLoad(num_seqs=30, kv_tokens=30_000)]
        assert _placer(few).place(request) == 0


def test_a_long_prompt_goes_where_kv_has_room() -> None:
    loads = [
        RankLoad(num_seqs=2, kv_tokens=300_000, kv_capacity_tokens=400_000),  # cost 0.66
        RankLoad(num_seqs=60, kv_tokens=100_000, kv_capacity_tokens=1_000_000),  # cost 1.42
    ]
    assert _placer(loads).place(PlacementRequest(1_000)) == 0
    assert _placer(loads).place(PlacementRequest(300_000)) == 1


def test_capacity_is_respected_and_overflow_goes_to_the_cheapest_rank() -> None:
    loads = [
        RankLoad(num_seqs=1, kv_tokens=0, kv_capacity_tokens=1_000),
        RankLoad(num_seqs=9, kv_tokens=0, max_seqs=10),
        RankLoad(num_seqs=50, kv_tokens=0),
    ]
    assert _placer(loads).place(PlacementRequest(5_000)) == 1  # rank 0 lacks KV room
    full = [RankLoad(2, 0, 1_000), RankLoad(1, 0, 1_000)]
    assert _placer(full).place(PlacementRequest(5_000)) == 1  # none fits: cheapest


def test_a_burst_between_snapshots_spreads_over_ranks() -> None:
    placer = _placer([RankLoad() for _ in range(4)])
    ranks = [placer.place(PlacementRequest(1_000)) for _ in range(8)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert placer.loads[0].num_seqs == 2  # the view counts its own placements


def test_affinity_pins_a_session_while_its_rank_is_not_much_costlier() -> None:
    placer = _placer([RankLoad(), RankLoad()], affinity_slack=0.5)
    first = placer.place(PlacementRequest(1_000, affinity_key="chat-1"))
    for _ in range(3):  # the same session stays, though the other rank is now lighter
        assert placer.place(PlacementRequest(1_000, affinity_key="chat-1")) == first
    other = 1 - first
    placer.update([RankLoad(200, 2_000_000) if g == first else RankLoad() for g in range(2)])
    assert placer.place(PlacementRequest(1_000, affinity_key="chat-1")) == other  # load wins
    placer.update([RankLoad(), RankLoad()])
    assert placer.place(PlacementRequest(1_000, affinity_key="chat-1")) == other  # key moved


def test_affinity_keys_are_bounded() -> None:
    placer = _placer([RankLoad(), RankLoad()], max_affinity_keys=2, affinity_slack=10.0)
    placer.place(PlacementRequest(10, affinity_key="a"))  # → rank 0
    placer.place(PlacementRequest(10, affinity_key="b"))
    placer.place(PlacementRequest(10, affinity_key="c"))  # forgets "a"
    placer.update([RankLoad(), RankLoad(num_seqs=0, kv_tokens=0)])
    placer.update([RankLoad(num_seqs=1), RankLoad()])
    assert placer.place(PlacementRequest(10, affinity_key="a")) == 1  # not pinned any more


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown placement policy"):
        PlacementConfig(policy="random")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_projected_cost_beats_round_robin_on_a_skewed_trace(seed: int) -> None:
    steps, ranks = 1500, 8
    trace = skewed_trace(steps, arrivals_per_step=0.6, seed=seed)
    results = {}
    for policy in ("round_robin", "projected_cost"):
        config = PlacementConfig(policy=policy, cost=COST)
        results[policy] = simulate(DPPlacer(ranks, config), trace, steps, COST)
    rr, joint = results["round_robin"], results["projected_cost"]
    print(
        f"seed {seed}: max/mean round-robin {rr.max_over_mean:.3f}, joint {joint.max_over_mean:.3f}"
    )
    assert joint.max_over_mean < rr.max_over_mean - 0.05
    assert joint.efficiency > rr.efficiency + 0.03
