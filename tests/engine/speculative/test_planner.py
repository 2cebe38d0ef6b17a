"""The verification planner (`dspark.md` §3): budget from lagged survivals, tiers, allocation."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch

from engine.speculative.planner import (
    FixedPlanner,
    PlanRow,
    ScheduledPlanner,
    ScheduledPlannerConfig,
    SurvivalHistory,
    allocate,
)
from engine.speculative.step_times import StepTimeTable, graph_tiers

G = 5


def linear_table(tiers, fixed_ms, per_row_ms, per_request_ms=0.0) -> StepTimeTable:
    """A table whose verify time is fixed + per_row·tier (cost of the padded size)."""
    tiers = tuple(tiers)
    return StepTimeTable(
        draft_buckets=(1,),
        draft_ms=(0.0,),
        verify_tiers=tiers,
        verify_ms=tuple(fixed_ms + per_row_ms * m for m in tiers),
        alpha_ms=per_request_ms,
    )


def cumprod(rows):
    return torch.tensor(rows, dtype=torch.float64).cumprod(1)


LAGGED = [
    [0.95, 0.92, 0.90, 0.88, 0.85],
    [0.75, 0.65, 0.60, 0.55, 0.50],
    [0.45, 0.40, 0.35, 0.30, 0.30],
]
CURRENT = [
    [0.93, 0.90, 0.88, 0.85, 0.80],
    [0.40, 0.50, 0.50, 0.50, 0.50],
    [0.90, 0.90, 0.85, 0.80, 0.80],
]


def rows_of(survivals, caps=None):
    caps = caps or [G] * len(survivals)
    pairs = zip(caps, survivals.tolist(), strict=True)
    return [PlanRow(cap=c, survivals=tuple(s)) for c, s in pairs]


@pytest.mark.parametrize(
    "tiers", [tuple(range(1, 19)), (6, 9, 12, 15, 18)], ids=["linear", "tiered"]
)
def test_worked_example_of_the_design_chooses_nine_drafts(tiers):
    """§3.8: T(M) = 10 + 0.3·M, three requests → B* = 9 (12 verify rows instead of 18), and the
    current confidences allocate drafts (5, 0, 4)."""
    planner = ScheduledPlanner(linear_table(tiers, 10.0, 0.3), G)
    decision = planner.plan(rows_of(cumprod(LAGGED)), prefill_rows=0)
    assert (decision.budget, decision.is_verify_all, decision.tier) == (9, False, 12)
    assert decision.predicted_ms == pytest.approx(13.6)
    lengths = allocate(cumprod(CURRENT), torch.tensor([G] * 3), decision.budget)
    assert lengths.tolist() == [5, 0, 4]


def padded_theta(table, rows, prefill_rows, b, cand):
    n = len(rows)
    return (n + sum(cand[:b])) / table.step_ms(n, prefill_rows + n + b)


def test_the_budget_is_the_global_argmax_over_every_budget_with_padded_costs():
    """Evaluating Θ only at tier edges loses nothing: no budget beats the planner's choice."""
    rng = random.Random(0)
    tiers = graph_tiers(600)
    for _ in range(200):
        n = rng.randint(1, 96)
        table = linear_table(tiers, rng.uniform(2, 20), rng.uniform(0.002, 0.2))
        rows = []
        for _ in range(n):
            conf = [rng.uniform(0.05, 1.0) for _ in range(G)]
            surv = torch.tensor(conf).cumprod(0).tolist()
            rows.append(PlanRow(cap=rng.randint(0, G), survivals=tuple(surv)))
        prefill = rng.choice([0, 0, 17, 100])
        decision = ScheduledPlanner(table, G).plan(rows, prefill)
        cand = sorted((s for r in rows for s in r.survivals[: r.cap] if s >= 1e-6), reverse=True)
        chosen = min(decision.budget, len(cand))
        best = max(padded_theta(table, rows, prefill, b, cand) for b in range(len(cand) + 1))
        assert padded_theta(table, rows, prefill, chosen, cand) == pytest.approx(best, rel=1e-12)
        if not decision.is_verify_all:  # the tier is filled
            assert decision.budget == decision.tier - prefill - n


def test_low_load_verifies_all_on_the_fixed_path_and_high_load_schedules():
    """With a large fixed step cost every draft pays for itself (verify-all → fixed path); with
    an expensive row cost the same confidences are trimmed to a tier."""
    surv = cumprod([[0.8, 0.8, 0.8, 0.8, 0.8]] * 16)
    cheap_rows = ScheduledPlanner(linear_table(graph_tiers(600), 10.0, 0.001), G)
    decision = cheap_rows.plan(rows_of(surv), 0)
    assert decision.is_verify_all and decision.budget == 16 * G and decision.tier is None
    assert decision.reason == "verify_all"
    assert cheap_rows.is_verify_all(rows_of(surv), 0)
    costly_rows = ScheduledPlanner(linear_table(graph_tiers(600), 10.0, 0.2), G)
    decision = costly_rows.plan(rows_of(surv), 0)
    assert not decision.is_verify_all and decision.reason == "scheduled"
    assert 0 < decision.budget < 16 * G


def test_without_a_table_every_step_verifies_all_with_one_warning(caplog):
    planner = ScheduledPlanner(None, G)
    rows = [PlanRow(cap=3, survivals=None), PlanRow(cap=5, survivals=(0.1,) * 5)]
    with caplog.at_level(logging.WARNING):
        decisions = [planner.plan(rows, 0) for _ in range(3)]
    assert all(d.is_verify_all and d.budget == 8 and d.reason == "no_table" for d in decisions)
    assert sum("no step-time table" in r.message for r in caplog.records) == 1
    assert FixedPlanner().plan(rows, 0).is_verify_all


def test_base_rows_above_the_largest_tier_run_eagerly_with_a_clamped_choice():
    table = linear_table((8, 16), 1.0, 0.1)
    rows = rows_of(cumprod([[0.9] * G] * 20))
    decision = ScheduledPlanner(table, G).plan(rows, 0)
    assert decision.reason == "eager" and decision.tier is None


def test_hysteresis_keeps_the_last_tier_unless_another_wins_clearly():
    """One request, tiers (2, 3, 4): Θ(tier 2) = 1 + s1, Θ(tier 3) = (1 + s1 + s2) / 1.4. With
    5 % hysteresis a planner on tier 3 stays there while tier 2 wins by < 5 % and leaves once it
    wins by more; without hysteresis it follows the better tier."""
    table = StepTimeTable((1,), (0.0,), (2, 3, 4), (1.0, 1.4, 2.0))

    def rows(s2):
        return [PlanRow(cap=3, survivals=(0.9, s2, 0.1))]

    sticky = ScheduledPlanner(table, 3, ScheduledPlannerConfig(hysteresis=0.05))
    plain = ScheduledPlanner(table, 3)
    assert sticky.plan(rows(0.8), 0).tier == plain.plan(rows(0.8), 0).tier == 3
    assert plain.plan(rows(0.75), 0).tier == 2  # 1.900 vs 1.893
    assert sticky.plan(rows(0.75), 0).tier == 3
    assert sticky.plan(rows(0.3), 0).tier == 2  # 1.900 vs 1.571


# ---------------------------------------------------------------- losslessness (§3.2)


def test_the_budget_never_depends_on_the_current_or_previous_step():
    """Two trajectories that agree up to step t−2 and differ arbitrarily at t−1 and t (different
    drafts → different survivals) get the same budget for step t."""
    table = linear_table(graph_tiers(600), 10.0, 0.05)
    gen = torch.Generator().manual_seed(3)
    ids = [f"r{i}" for i in range(24)]
    caps = [G] * 12 + [2] * 12
    shared = [torch.rand(24, G, generator=gen).cumprod(1) for _ in range(6)]

    def rows(history, step):
        return [PlanRow(c, history.lagged(step, r, 0)) for r, c in zip(ids, caps, strict=True)]

    def record(history, step, surv):
        for r, row in zip(ids, surv.tolist(), strict=True):
            history.record(step, r, 0, row)

    budgets = []
    for variant in range(4):
        history, planner = SurvivalHistory(lag=2), ScheduledPlanner(table, G)
        for step, surv in enumerate(shared):
            planner.plan(rows(history, step), 0)
            record(history, step, surv)
            planner.observe(surv, len(ids))
        t = len(shared) + 1
        other = torch.rand(24, G, generator=torch.Generator().manual_seed(variant)).cumprod(1)
        planner.plan(rows(history, t - 1), 0)
        record(history, t - 1, other)  # step t−1's survivals
        budgets.append(planner.plan(rows(history, t), 0).budget)  # before step t
    assert len(set(budgets)) == 1


def test_a_drafts_admission_never_depends_on_itself():
    """Role 2 (§3.2): whether (r, k) is admitted depends only on slots ranked above it; changing
    anything d_k influences (S_{r,j} for j > k, kept non-increasing) never changes it."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        conf = torch.rand(n, G, generator=gen).clamp(min=0.05)
        conf[conf > 0.7] = 1.0  # plateaus: ties between positions and requests
        surv = conf.cumprod(1)
        caps = torch.randint(0, G + 1, (n,), generator=gen)
        budget = int(torch.randint(0, n * G + 1, (1,), generator=gen))
        lengths = allocate(surv, caps, budget)
        r = int(torch.randint(0, n, (1,), generator=gen))
        k = int(torch.randint(0, G, (1,), generator=gen))
        changed = surv.clone()
        changed[r, k + 1 :] = (
            surv[r, k] * torch.rand(G - k - 1, generator=gen).sort(descending=True).values
        )
        again = allocate(changed, caps, budget)
        assert (lengths[r] > k) == (again[r] > k)


def first_token_distribution(budget_for) -> list[float]:
    """Exact output distribution of the first committed token of one request (vocabulary {0,1})
    with target p = (0.7, 0.3), draft q = (0.5, 0.5), rejection sampling, and a confidence for
    draft 2 that depends on draft 1 (c2 = 1 after token 0, 0 after token 1)."""
    p, q = (0.7, 0.3), (0.5, 0.5)
    out = [0.0, 0.0]
    for d1 in (0, 1):
        current = torch.tensor([[0.5, 0.5 * (1.0 if d1 == 0 else 0.0)]], dtype=torch.float64)
        budget = budget_for(current)
        verified = int(allocate(current, torch.tensor([2]), budget)[0])
        if verified == 0:  # the bonus row samples from the target
            out[0] += q[d1] * p[0]
            out[1] += q[d1] * p[1]
            continue
        accept = min(1.0, p[d1] / q[d1])
        out[d1] += q[d1] * accept
        residual = [max(p[i] - q[i], 0.0) for i in range(2)]
        for y in range(2):
            out[y] += q[d1] * (1 - accept) * residual[y] / sum(residual)
    return out


def test_a_lagged_budget_is_lossless_where_the_current_one_is_not():
    """The design's counterexample (App. A of the paper): a budget computed from the current
    survivals verifies draft 1 only when draft 1 made draft 2 look good, turning p = (0.7, 0.3)
    into (0.85, 0.15). The same planner fed lagged survivals keeps p for every history."""
    table = StepTimeTable((1,), (0.0,), (1, 3), (1.0, 1.75))
    planner = ScheduledPlanner(table, 2)

    def from_current(current):
        return planner.budget([PlanRow(cap=2, survivals=tuple(current[0].tolist()))], 0)

    assert first_token_distribution(from_current) == pytest.approx([0.85, 0.15])
    for lagged in itertools.product([0.0, 0.3, 0.5, 1.0], repeat=2):
        surv = tuple(torch.tensor(lagged).cumprod(0).tolist())
        budget = planner.budget([PlanRow(cap=2, survivals=surv)], 0)
        assert first_token_distribution(lambda _current, b=budget: b) == pytest.approx([0.7, 0.3])


# ---------------------------------------------------------------- history and prior (§3.3.1)


def test_history_returns_survivals_two_steps_old_of_the_same_generation_only():
    history = SurvivalHistory(lag=2)
    for step in range(4):  # each step is planned before its survivals are recorded
        if step == 1:
            assert history.lagged(step, "a", 0) is None  # nothing two steps old yet
        if step == 3:
            assert history.lagged(step, "a", 0) == pytest.approx((0.2,) * G)  # from step 1
        for request_id in ("a", "b"):
            history.record(step, request_id, 0, (0.1 * (step + 1),) * G)
    assert history.lagged(4, "a", 0) == pytest.approx((0.3,) * G)  # recorded at step 2
    assert history.lagged(4, "b", 1) is None  # b resumed after a preemption: the prior
    history.record(4, "b", 1, (0.9,) * G)
    assert history.lagged(6, "b", 1) == pytest.approx((0.9,) * G)
    history.forget("a")
    assert history.lagged(4, "a", 0) is None
    with pytest.raises(ValueError):
        SurvivalHistory(lag=0)


def test_requests_without_history_plan_with_the_population_prior():
    """Before any observation the prior is 1 (every draft looks certain); after observing, a
    request without history is planned with the running mean, as if it had that history."""
    table = linear_table(graph_tiers(600), 10.0, 0.05)
    planner = ScheduledPlanner(table, G)
    assert planner.prior == (1.0,) * G
    surv = cumprod([[0.9, 0.8, 0.6, 0.5, 0.4], [0.7, 0.6, 0.5, 0.5, 0.5]])
    planner.observe(surv, 2)
    assert planner.prior == pytest.approx(tuple(surv.mean(0).tolist()))
    mean_rows = [PlanRow(cap=G, survivals=planner.prior)] * 30
    fresh_rows = [PlanRow(cap=G, survivals=None)] * 30
    assert planner.plan(fresh_rows, 0) == planner.plan(mean_rows, 0)
    assert planner.metrics.no_history_rows == 30 and planner.metrics.rows_total == 60


# ---------------------------------------------------------------- allocation (role 2)


def test_allocate_takes_the_top_slots_and_every_request_gets_a_prefix():
    """The admitted set equals the first `budget` slots in (−S, k, r) order, and for every
    request it is {k < L_r}, also with ties; caps and the 1e-6 floor are respected."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        conf = torch.rand(n, G, generator=gen)
        conf[conf > 0.6] = 1.0
        conf[conf < 0.02] = 1e-7
        surv = conf.cumprod(1)
        caps = torch.randint(0, G + 1, (n,), generator=gen)
        budget = int(torch.randint(0, n * G + 2, (1,), generator=gen))
        lengths = allocate(surv, caps, budget)
        slots = sorted(
            (-float(surv[r, k]), k, r)
            for r in range(n)
            for k in range(int(caps[r]))
            if surv[r, k] >= 1e-6
        )[:budget]
        taken = {(r, k) for _, k, r in slots}
        assert taken == {(r, k) for r in range(n) for k in range(int(lengths[r]))}
        assert (lengths <= caps).all()


def test_metrics_count_decisions_tiers_and_cost_model_error():
    table = linear_table(graph_tiers(600), 10.0, 0.2)
    planner = ScheduledPlanner(table, G)
    rows = rows_of(cumprod([[0.8] * G] * 16))
    decision = planner.plan(rows, 0)
    planner.record_step_time(decision, decision.predicted_ms * 1.2)
    planner.plan(rows_of(cumprod([[1.0] * G] * 2)), 0)
    metrics = planner.metrics
    assert metrics.steps_by_reason == {"scheduled": 1, "verify_all": 1}
    assert metrics.steps_by_tier == {decision.tier: 1}
    assert metrics.budget_total == decision.budget + 2 * G
    assert metrics.step_time.ratios[decision.tier] == pytest.approx(1.2)
    assert metrics.cpu_us_total > 0
    for _ in range(30):
        planner.record_step_time(decision, decision.predicted_ms * 1.2)
    assert metrics.step_time.drifted() == [decision.tier]
