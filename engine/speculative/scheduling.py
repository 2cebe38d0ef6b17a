"""The scheduler's speculation collaborator: per-request draft caps and the step's budget.

The scheduler asks, for each decoding request, how many drafts it may verify (`cap`: never past
`max_tokens` or the context limit, none for rows whose sampling reads the tokens before them),
reserves KV for them, and asks the planner for the step's budget B (and whether it is
verify-all, which runs the fixed path) from survivals published at
least `LAG` steps before (`dspark.md` §3.2: the budget never sees the drafts it admits). The
runner then verifies the top-B slots by the current survivals (`planner.allocate`).

Pure Python on the host, like the scheduler; the planner's `observe` receives a host tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from engine.request import Request
from engine.speculative import planner as planners
from engine.speculative.config import SpeculativeConfig
from engine.speculative.planner import (
    BudgetDecision,
    FixedPlanner,
    PlanRow,
    SurvivalHistory,
    VerifyPlanner,
)

# Steps between the step that published a request's survivals and the step that plans with them.
LAG = 2


# The scheduled planner's constructor in `planner.py`: `scheduled_planner(model, k, **options)`.
SCHEDULED_PLANNER_FACTORY = "scheduled_planner"


def build_planner(config: SpeculativeConfig, model: object, max_requests: int) -> VerifyPlanner:
    """The planner `config.verify` names: `fixed` verifies all; `scheduled` is the profiled
    planner of `planner.py` (its step-time table cached or profiled for up to `max_requests`
    drafting requests; eager mode has no table and verifies all). Raises ValueError when that
    planner is not in this build."""
    if config.verify == "fixed":
        return FixedPlanner()
    factory = getattr(planners, SCHEDULED_PLANNER_FACTORY, None)
    if factory is None:
        raise ValueError(
            "--speculative-verify scheduled needs the scheduled planner "
            "(engine/speculative/planner.py), which this build does not have; "
            "use --speculative-verify fixed"
        )
    return factory(model, config.num_speculative_tokens, max_requests=max_requests)


class DraftScheduling:
    """Caps and budgets for one scheduler (see the module docstring). Not thread-safe."""

    def __init__(self, num_speculative_tokens: int, planner: VerifyPlanner) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.planner = planner
        self._num_steps = 0  # budgets planned so far (the step index of the next one)
        self._history = SurvivalHistory(LAG)
        # Plans that asked the planner, by step index, until their step is timed (two at most
        # under async scheduling: the step in flight and the one just planned).
        self._decisions: dict[int, BudgetDecision] = {}

    def cap(self, request: Request, max_model_len: int, *, num_ahead: int = 0) -> int:
        """Drafts a decoding request may verify after its last token this step.

        A step emits at most L + 1 tokens, so L < the outputs left and the context left. Rows
        whose draw depends on earlier tokens of the same step get none: a penalty history, or a
        thinking budget whose forced draw would fall on a draft row.

        num_ahead: outputs a step in flight samples before this row (async scheduling, counted
        as one each: their accepted drafts are not known yet), so the cap is an upper bound
        that `Scheduler.resolve` lowers to this exact one (num_ahead 0) once they are.
        """
        params = request.params
        num_tokens = request.num_tokens + num_ahead
        num_outputs = request.num_output_tokens + num_ahead
        cap = min(self.num_speculative_tokens, max_model_len - num_tokens - 1)
        if params.max_tokens is not None:
            cap = min(cap, params.max_tokens - num_outputs - 1)
        if (
            params.presence_penalty != 0
            or params.frequency_penalty != 0
            or params.repetition_penalty != 1
        ):
            return 0
        budget = params.thinking_budget
        if budget is not None and num_outputs <= budget.max_tokens:
            cap = min(cap, budget.max_tokens - num_outputs - 1)
        return max(0, cap)

    @property
    def num_steps(self) -> int:
        """Steps planned so far; the last planned step's index is `num_steps - 1`."""
        return self._num_steps

    def plan(self, rows: Sequence[tuple[Request, int]], num_prefill_rows: int) -> BudgetDecision:
        """The step's draft budget and its path (`planner.plan`); advances the step (its
        index, `num_steps - 1` afterwards, is what `observe` and `record_step_time` take).

        rows: every request that samples this step with its cap (0 for a last prefill chunk
        or a row that may not draft); num_prefill_rows: the step's other target rows (prefill
        rows that do not sample), the planner's M₀. A step without draft slots asks no planner
        (budget 0, verify-all).
        """
        step = self._num_steps
        self._num_steps += 1
        total = sum(cap for _, cap in rows)
        if total == 0:
            return BudgetDecision(budget=0, is_verify_all=True, reason="no_drafts")
        plan_rows = [
            PlanRow(cap, self._history.lagged(step, request.request_id, request.num_preemptions))
            for request, cap in rows
        ]
        decision = self.planner.plan(plan_rows, num_prefill_rows)
        budget = max(0, min(total, decision.budget))
        if budget != decision.budget:
            decision = dataclasses.replace(decision, budget=budget)
        self._decisions[step] = decision
        return decision

    def record_step_time(self, step: int, measured_ms: float) -> None:
        """The measured time of planned step `step` (once; nothing for a step that asked no
        planner). Plans of earlier steps that were never timed are dropped."""
        decision = self._decisions.pop(step, None)
        for older in [s for s in self._decisions if s < step]:
            del self._decisions[older]
        if decision is not None:
            self.planner.record_step_time(decision, measured_ms)

    def observe(
        self,
        survivals: Mapping[str, tuple[float, ...]],
        requests: Mapping[str, Request],
        step: int,
    ) -> None:
        """The survivals planned step `step` published, by request id (under async
        scheduling the step after it is planned already)."""
        for request_id, values in survivals.items():
            request = requests.get(request_id)
            if request is None:
                continue
            self._history.record(step, request_id, request.num_preemptions, values)
        if survivals:
            self.planner.observe(torch.tensor(list(survivals.values())), len(survivals))

    def forget(self, request_id: str) -> None:
        self._history.forget(request_id)
