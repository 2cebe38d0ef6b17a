"""How many drafts a step verifies, and which (`dspark.md` §3).

Two roles, split so that verification stays lossless (§3.2):

* `VerifyPlanner.budget` (CPU, while step t−1 runs): the number B of draft tokens step t
  verifies, from survivals at least two steps old. It never sees the drafts it admits.
* `allocate` (device, step t, after drafting): which B (request, position) slots, ranked by the
  current step's survivals; every request's admitted set is a prefix of its drafts.

`FixedPlanner` verifies every draft up to each request's cap (the `fixed` mode and every fallback
of §3.6). `ScheduledPlanner` maximises expected committed tokens per millisecond over a
profiled `StepTimeTable`, evaluated at CUDA-graph tier edges (§3.3, §3.5); `plan` also says
whether the step is verify-all (routed to the fixed-shape path) and which tier it pads to.
`SurvivalHistory` keeps each request's survivals for the step two later, with the request's
generation (preemption count) so a new or resumed request gets the prior (§3.3.1).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the scheduler imports this module: it stays torch-free
    import torch

from engine.speculative.step_times import StepTimeTable

log = logging.getLogger(__name__)

MIN_SURVIVAL = 1e-6  # candidates below it are never verified (§3.1)


@dataclass(frozen=True)
class PlanRow:
    """One request that samples in the planned step.

    cap: the most drafts it may verify (`min(num_speculative_tokens, remaining_tokens − 1,
        grammar cap)`, ≥ 0).
    survivals: its lagged survivals S_1..S_L (non-increasing, from confidences of step t−2),
        or None when it has no history (new, just prefilled, resumed): the planner's prior.
    """

    cap: int
    survivals: tuple[float, ...] | None


@dataclass(frozen=True)
class BudgetDecision:
    """Role 1's answer for one step.

    budget: B, the drafts to verify (0 ≤ B ≤ Σ cap).
    is_verify_all: B = Σ cap; the step runs the fixed-shape path (uniform rows, no ranking).
    tier: the verify-graph row tier the scheduled step pads to (None: verify-all, or eager
        because the base rows exceed the largest tier).
    predicted_ms: the table's step time for the decision (None without a table).
    reason: "scheduled", "verify_all", "eager", "no_table" or "fixed" (`FixedPlanner`).
    """

    budget: int
    is_verify_all: bool
    tier: int | None = None
    predicted_ms: float | None = None
    reason: str = "verify_all"


class VerifyPlanner(Protocol):
    def budget(self, rows: Sequence[PlanRow], prefill_rows: int) -> int:
        """Total drafts B to verify in the step (0 ≤ B ≤ Σ cap)."""
        ...

    def plan(self, rows: Sequence[PlanRow], prefill_rows: int) -> BudgetDecision:
        """B with the path it runs on (`budget` is `plan(...).budget`)."""
        ...

    def observe(self, survivals: torch.Tensor, request_count: int) -> None:
        """The step's calibrated survivals [N, L] (host copy), for the population prior."""
        ...

    def record_step_time(self, decision: BudgetDecision, measured_ms: float) -> None:
        """The measured time of the step `decision` planned (the cost model's online check)."""
        ...

    @property
    def metrics(self) -> PlannerMetrics:
        """The planner's counters (§5.1)."""
        ...


class FixedPlanner:
    """Verify all: B = Σ cap (reason `fixed`)."""

    def __init__(self) -> None:
        self.metrics = PlannerMetrics()

    def budget(self, rows: Sequence[PlanRow], prefill_rows: int) -> int:
        return sum(row.cap for row in rows)

    def plan(self, rows: Sequence[PlanRow], prefill_rows: int) -> BudgetDecision:
        start = time.perf_counter()
        decision = BudgetDecision(
            budget=self.budget(rows, prefill_rows), is_verify_all=True, reason="fixed"
        )
        self.metrics.count(decision, rows, (time.perf_counter() - start) * 1e6)
        return decision

    def observe(self, survivals: torch.Tensor, request_count: int) -> None:
        return None

    def record_step_time(self, decision: BudgetDecision, measured_ms: float) -> None:
        return None  # no cost model to check


def allocate(survivals: torch.Tensor, caps: torch.Tensor, budget: int) -> torch.Tensor:
    """Verify lengths L_r [N] (int64): the top-`budget` slots (r, k), k < caps[r].

    survivals: [N, L] non-increasing along k. Order: survival descending, then k ascending, then
    r ascending (a tie-break that never looks at values), so each request's slots are a prefix.
    Slots with survival below 1e-6 are never taken.
    """
    import torch

    rows, width = survivals.shape
    if rows == 0 or budget <= 0:
        return torch.zeros(rows, dtype=torch.long, device=survivals.device)
    k = torch.arange(width, device=survivals.device)
    eligible = (k[None, :] < caps[:, None]) & (survivals >= 1e-6)
    score = torch.where(eligible, survivals.float(), torch.full_like(survivals.float(), -1.0))
    # stable sort on (−score, k, r): flatten k-major so equal scores keep (k, r) order
    k_major = score.t().flatten()
    order = torch.sort(-k_major, stable=True).indices[: min(budget, k_major.numel())]
    taken = k_major[order] >= 0
    r_index = order % rows
    lengths = torch.zeros(rows, dtype=torch.long, device=survivals.device)
    lengths.index_add_(0, r_index[taken], torch.ones_like(r_index[taken]))
    return lengths


# ---------------------------------------------------------------- lagged survivals


class SurvivalHistory:
    """Each request's calibrated survivals of recent steps, for planning `lag` steps later
    (§3.2), keyed by request id.

    Each entry carries the request's generation (its preemption count): survivals recorded
    under another generation are never returned, so a resumed request plans with the prior
    (§3.3.1), as a new one does. `lag` entries per request suffice: entries are recorded at
    distinct steps before the planned one, and at most lag − 1 of them are newer than
    step − lag. Not thread-safe; one owner (the scheduler's `DraftScheduling`).
    """

    def __init__(self, lag: int = 2) -> None:
        if lag < 1:
            raise ValueError("the lag must be ≥ 1: a budget from the current drafts is lossy")
        self.lag = lag
        self._entries: dict[str, deque[tuple[int, int, tuple[float, ...]]]] = {}

    def record(
        self, step: int, request_id: str, generation: int, survivals: Sequence[float]
    ) -> None:
        """Survivals S_1..S_L the request's drafts had in `step` (after its draft)."""
        entries = self._entries.setdefault(request_id, deque(maxlen=self.lag))
        entries.append((step, generation, tuple(float(s) for s in survivals)))

    def lagged(self, step: int, request_id: str, generation: int) -> tuple[float, ...] | None:
        """The newest survivals of this generation of the request recorded at or before
        `step − lag`, or None (no such history: the planner's prior)."""
        for recorded, gen, row in reversed(self._entries.get(request_id, ())):
            if recorded <= step - self.lag and gen == generation:
                return row
        return None

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


# ---------------------------------------------------------------- metrics


@dataclass
class StepTimeMonitor:
    """EMA of measured / predicted step time per tier (§3.4 online check, §5.1)."""

    decay: float = 0.95
    drift_limit: float = 0.10
    ratios: dict[int | str, float] = field(default_factory=dict)
    counts: dict[int | str, int] = field(default_factory=dict)

    def observe(self, tier: int | str, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms <= 0:
            return
        ratio = measured_ms / predicted_ms
        count = self.counts.get(tier, 0)
        old = self.ratios.get(tier, ratio)
        self.ratios[tier] = ratio if count == 0 else self.decay * old + (1 - self.decay) * ratio
        self.counts[tier] = count + 1

    def drifted(self, min_count: int = 20) -> list[int | str]:
        """Tiers whose EMA ratio is off by more than `drift_limit` (re-profile them)."""
        return [
            tier
            for tier, ratio in self.ratios.items()
            if self.counts[tier] >= min_count and abs(ratio - 1) > self.drift_limit
        ]


@dataclass
class PlannerMetrics:
    """Plain counters the engine exports (§5.1; names without the `deepinfer:` prefix).

    steps_by_reason: planner decisions per `BudgetDecision.reason`.
    steps_by_tier: scheduled steps per chosen verify tier.
    steps_by_budget: planner decisions per budget B (the budget histogram).
    budget_total / rows_total / no_history_rows: Σ B, Σ planned requests, Σ requests planned
        with the prior (`spec_planner_no_history_fraction` = no_history_rows / rows_total).
    cpu_us_total: Σ role-1 time on the host.
    step_time: measured / predicted step time per tier ("fixed" for verify-all steps).
    """

    steps_by_reason: dict[str, int] = field(default_factory=dict)
    steps_by_tier: dict[int, int] = field(default_factory=dict)
    steps_by_budget: dict[int, int] = field(default_factory=dict)
    budget_total: int = 0
    rows_total: int = 0
    no_history_rows: int = 0
    cpu_us_total: float = 0.0
    step_time: StepTimeMonitor = field(default_factory=StepTimeMonitor)

    def copy(self) -> PlannerMetrics:
        """An independent copy (for snapshots read while steps run)."""
        return copy.deepcopy(self)

    @property
    def no_history_fraction(self) -> float:
        return self.no_history_rows / self.rows_total if self.rows_total else 0.0

    def count(self, decision: BudgetDecision, rows: Sequence[PlanRow], cpu_us: float) -> None:
        self.steps_by_reason[decision.reason] = self.steps_by_reason.get(decision.reason, 0) + 1
        if decision.tier is not None and not decision.is_verify_all:
            self.steps_by_tier[decision.tier] = self.steps_by_tier.get(decision.tier, 0) + 1
        self.steps_by_budget[decision.budget] = self.steps_by_budget.get(decision.budget, 0) + 1
        self.budget_total += decision.budget
        self.rows_total += len(rows)
        self.no_history_rows += sum(row.survivals is None for row in rows)
        self.cpu_us_total += cpu_us


# ---------------------------------------------------------------- the scheduled planner


@dataclass(frozen=True)
class ScheduledPlannerConfig:
    """hysteresis: keep the last tier unless another wins by more than this fraction (0 = off;
        §3.3 suggests 0.05 against graph flapping; never needed for correctness).
    prior_decay: weight of the newest step in the population prior (running mean per position).
    """

    hysteresis: float = 0.0
    prior_decay: float = 0.01

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1:
            raise ValueError("hysteresis must be in [0, 1)")
        if not 0 < self.prior_decay <= 1:
            raise ValueError("prior_decay must be in (0, 1]")


class ScheduledPlanner:
    """Role 1 of §3.3: B = argmax over tier edges of τ(B) / T(N, M₀ + N + B).

    Inputs are lagged only (`PlanRow.survivals` two steps old, or the population prior), so B
    never depends on the drafts it admits; `observe` must be called with a step's survivals
    only after that step's budget was planned (the engine plans step t before drafting it).

    N = len(rows) requests draft and sample; M₀ = `prefill_rows`, target rows of prefill chunks
    other than the rows the `PlanRow`s sample from (a last prefill chunk of c rows that samples
    passes c − 1 rows here and one `PlanRow` with cap 0). Candidates are the lagged survivals
    s_{r,k} ≥ 1e-6 with k ≤ cap_r, best first; the tier a step pads to is filled with the
    next-best candidates (padding costs what real rows cost). When the best edge takes every
    candidate the step is verify-all: B = Σ cap on the fixed-shape path. Without a table every
    step is verify-all (one warning). Base rows above the largest tier: every B is evaluated
    on the table's extrapolation and the step runs eagerly (tier None).
    """

    def __init__(
        self,
        table: StepTimeTable | None,
        num_speculative_tokens: int,
        config: ScheduledPlannerConfig | None = None,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be ≥ 1")
        self.table = table
        self.num_speculative_tokens = num_speculative_tokens
        self.config = config or ScheduledPlannerConfig()
        self.metrics = PlannerMetrics()
        self._prior: list[float] | None = None
        self._last_tier: int | None = None
        self._warned = False

    # ---- the population prior (§3.3.1)

    @property
    def prior(self) -> tuple[float, ...]:
        """Running mean calibrated survival per position (1.0 before any observation)."""
        if self._prior is None:
            return (1.0,) * self.num_speculative_tokens
        return tuple(self._prior)

    def observe(self, survivals: torch.Tensor, request_count: int) -> None:
        """Fold the first `request_count` rows of a step's survivals [N, L] into the prior."""
        if request_count <= 0:
            return
        import torch

        rows = survivals[:request_count].detach().to("cpu", torch.float64)
        width = min(rows.shape[1], self.num_speculative_tokens)
        mean = rows[:, :width].mean(0).tolist()
        mean += [0.0] * (self.num_speculative_tokens - width)
        if self._prior is None:
            self._prior = mean
            return
        w = self.config.prior_decay
        self._prior = [(1 - w) * old + w * new for old, new in zip(self._prior, mean, strict=True)]

    # ---- role 1

    def budget(self, rows: Sequence[PlanRow], prefill_rows: int) -> int:
        return self.plan(rows, prefill_rows).budget

    def is_verify_all(self, rows: Sequence[PlanRow], prefill_rows: int) -> bool:
        return self.plan(rows, prefill_rows).is_verify_all

    def plan(self, rows: Sequence[PlanRow], prefill_rows: int) -> BudgetDecision:
        start = time.perf_counter()
        decision = self._decide(rows, prefill_rows)
        self.metrics.count(decision, rows, (time.perf_counter() - start) * 1e6)
        return decision

    def record_step_time(self, decision: BudgetDecision, measured_ms: float) -> None:
        """The measured time of the step `decision` planned (for the cost-model EMA)."""
        if decision.predicted_ms is not None:
            tier = "fixed" if decision.is_verify_all else (decision.tier or "eager")
            self.metrics.step_time.observe(tier, decision.predicted_ms, measured_ms)

    def _candidates(self, rows: Sequence[PlanRow]) -> list[float]:
        prior = self.prior
        cand = []
        for row in rows:
            survivals = prior if row.survivals is None else row.survivals
            cand.extend(s for s in survivals[: row.cap] if s >= MIN_SURVIVAL)
        cand.sort(reverse=True)
        return cand

    def _decide(self, rows: Sequence[PlanRow], prefill_rows: int) -> BudgetDecision:
        total = sum(row.cap for row in rows)
        table = self.table
        if table is None:
            if not self._warned:
                log.warning("no step-time table: scheduled verification verifies every draft")
                self._warned = True
            return BudgetDecision(budget=total, is_verify_all=True, reason="no_table")
        n = len(rows)
        base = prefill_rows + n
        cand = self._candidates(rows)
        gains = [0.0]
        for s in cand:
            gains.append(gains[-1] + s)

        def theta(b: int, m: int) -> float:
            return (n + gains[b]) / max(table.step_ms(n, m), 1e-9)

        if base > table.largest_tier:  # eager: no padding, every B
            best = max(range(len(cand) + 1), key=lambda b: (theta(b, base + b), -b))
            if best == len(cand):
                best = total
            return BudgetDecision(
                budget=best,
                is_verify_all=best == total,
                predicted_ms=table.step_ms(n, base + best),
                reason="eager",
            )
        edges: list[tuple[int, int, float]] = []  # (tier, B, Θ)
        for m in table.verify_tiers:
            if m < base:
                continue
            b = min(m - base, len(cand))
            edges.append((m, b, theta(b, m)))
            if b == len(cand):
                break  # larger tiers only cost more
        tier, b, value = max(edges, key=lambda e: (e[2], -e[0]))
        if self.config.hysteresis and self._last_tier is not None:
            for m, b_last, value_last in edges:
                if m == self._last_tier and value <= (1 + self.config.hysteresis) * value_last:
                    tier, b, value = m, b_last, value_last
        self._last_tier = tier
        if b == len(cand):
            return BudgetDecision(
                budget=total,
                is_verify_all=True,
                predicted_ms=table.step_ms(n, base + total),
                reason="verify_all",
            )
        return BudgetDecision(
            budget=b,
            is_verify_all=False,
            tier=tier,
            predicted_ms=table.step_ms(n, tier),
            reason="scheduled",
        )


def scheduled_planner(
    model, num_speculative_tokens: int | None = None, **options
) -> ScheduledPlanner:
    """The scheduled planner for `model`, its step-time table cached or profiled at start-up
    (eager mode: no table, verify-all). See `engine.speculative.profiling.
    build_scheduled_planner` for the options (max_requests, context_len, cache_dir, config)."""
    from engine.speculative.profiling import build_scheduled_planner  # imports the model

    return build_scheduled_planner(model, num_speculative_tokens, **options)
