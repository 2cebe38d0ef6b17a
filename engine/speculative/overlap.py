"""OverlappedSpeculativeCore: async scheduling with speculation on (DSpark, `dspark.md` §1.2).

One call of `step()`, with step N (its verify forward and sampling) launched by the previous
call and still on the device:

    host    schedule N+1 │ wait a │ commit N, update N, resolve N+1 │ wait b │ launch N+1 │ stream N
    device  ── verify N ──────┤ inject N, draft N+1 ──────────────────┤ verify N+1 ───────────

* **Scheduling N+1 overlaps N on the device.** The scheduler plans N+1 (admissions,
  preemptions, chunked prefills, block allocation, the planner's lagged budget) before N's
  accept counts reach the host: a request decoding in N gets a decode row at the lowest
  position N can leave it at (`p + 1`, as if no draft were accepted), a placeholder token,
  draft slots from lower bounds on its outputs, and blocks up to the highest (`p + 1 + c_N + 1
  + c_{N+1}`, `Request.num_inflight_drafts`; at most `p + 2·(1 + K)`). The budget it asks the
  planner for reads survivals two steps old, as in the synchronous loop (§3.2): `update`
  records N's survivals under N's step index (`SchedulerOutput.draft_step`), after N+1 was
  planned.
* **Wait a, for N's verdict:**, the one device → host sync of N (a step with logprobs
  adds one for them). `collect` accepts on the host, queues the draft context of N's
  committed rows, and advances the grammar matchers on N's committed tokens only (a rejected
  draft never advances one); rows of requests aborted meanwhile are skipped.
* **N+1's drafts are queued right behind** (`SpeculativeStep.draft_ahead`): each drafting
  row's anchor and position follow from the tokens N emitted for it, so the draft forward
  runs while the host applies N and resolves N+1. Draws are keyed by (seed, position), so
  drafting a superset of the rows (some resolve to cap 0 or finish) changes no draft.
* **N is applied before N+1 is placed.** `Scheduler.update` appends N's tokens and finds
  its stops; `Scheduler.resolve` puts every row of N+1 on the position N committed, with its
  real anchor, its exact sampling (output index, penalty history, thinking budget's forced
  draw) and its exact cap (max_tokens and the context limit are never overshot), and drops
  the rows of requests that finished at N. So, unlike `OverlappedCore`, a stop costs no
  computed-and-discarded step and a request finishing at N never has N+1 launched.
* **Wait b, launching N+1:** it takes the drafts (the wait for the draft forward and the planner's
  ranking: the ragged batch and the grammar masks are built from them on the host), then
  queues the verify forward, the masks and the sampling. N's deltas are then streamed
  (detokenised, sent) by the server while N+1 runs, and the next call schedules N+2.

Why not the full device-side future map (§1.2: N+1 launched before N's verdict, its anchor,
position and drafts read on the device). The model's batch is ragged by host-known lengths
(positions, window floors, block tables and per-row verify lengths are host ints), the
acceptance (`acceptance.verify`) and the grammar walk of the drafts run on the host, and the
draft context is written for committed rows only, selected on the host. Moving them to the
device is the next step; this core takes scheduling, the draft forward and streaming off the
critical path, with every state write identical to the synchronous loop's.

Tokens. Each step runs on the same committed state with the same drafts, masks and
acceptance as `EngineCore`'s. Greedy rows and the coupled mode give the tokens of decoding
without speculation whatever the verify lengths; rejection and block sampling give its
distribution, and the synchronous loop's seeded tokens when the verify lengths are the same,
which they are unless the token budget binds (it is spent on upper-bound caps here) or the
scheduled planner's budget differs (it is computed from those caps).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core import EngineCore, internal_error_message
from engine.model_runner import StepInFlight
from engine.outputs import Delta, ModelOutput, SchedulerOutput
from engine.request import RequestStatus
from engine.speculative.step import DraftsAhead, SpeculativeInFlight, SpeculativeStep

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _InFlight:
    scheduled: SchedulerOutput  # as resolved (the runner's step leaves invalid chunks out)
    step: SpeculativeInFlight


class OverlappedSpeculativeCore(EngineCore):
    """`EngineCore` with speculation and one step in flight between calls of `step()` (see
    the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.runner.speculative is None or self.scheduler.speculation is None:
            raise ValueError("OverlappedSpeculativeCore needs speculation in runner and scheduler")
        self.speculative: SpeculativeStep = self.runner.speculative
        self._in_flight: _InFlight | None = None

    def has_work(self) -> bool:
        return self._in_flight is not None or super().has_work()

    def step(self) -> list[Delta]:
        """Schedule N+1, apply N, then launch N+1 where N left its requests; returns N's deltas."""
        scheduled = self.scheduler.schedule()
        previous, previous_output = self._collect_in_flight()
        ahead = self._draft_ahead(scheduled, previous_output)
        deltas = self.scheduler.update(previous, previous_output)
        self.runner.release([d.request_id for d in deltas if d.finish_reason is not None])
        resolved = self.scheduler.resolve(scheduled)
        launched = None if resolved.is_empty else self._launch(resolved, ahead)
        self._in_flight = None if launched is None else _InFlight(resolved, launched)
        return deltas

    # ---- the phases, each failing only its own step's requests --------------------------------

    def _draft_ahead(self, scheduled: SchedulerOutput, previous: ModelOutput) -> DraftsAhead | None:
        """Queue N+1's drafts behind N's commit, so that the draft forward runs while the host
        applies N and resolves N+1; None when that fails (`launch` then drafts itself)."""
        if scheduled.is_empty:
            return None
        try:
            return self.speculative.draft_ahead(self.runner, scheduled, previous)
        except Exception:
            logger.exception("drafting ahead failed; the step drafts when it is launched")
            return None

    def _launch(self, scheduled: SchedulerOutput, ahead: DraftsAhead | None) -> SpeculativeInFlight:
        try:
            return self.speculative.launch(self.runner, scheduled, ahead)
        except Exception:
            ids = [c.request_id for c in scheduled.chunks]
            logger.exception("engine step failed; failing the requests of the step: %s", ids)
            failed = {rid: internal_error_message(rid) for rid in ids}
            empty = SchedulerOutput(chunks=(), num_tokens=0)
            return SpeculativeInFlight(empty, failed, StepInFlight(empty, {}))

    def _collect_in_flight(self) -> tuple[SchedulerOutput, ModelOutput]:
        """Wait for step N's verdict (nothing when no step is in flight); feed its device
        time to the step budget and the planner's step-time table."""
        if self._in_flight is None:
            return SchedulerOutput(chunks=(), num_tokens=0), ModelOutput(sampled={}, logprobs={})
        scheduled, step = self._in_flight.scheduled, self._in_flight.step
        dropped = {rid for rid in step.request_ids if not self._is_running(rid)}
        try:
            output = self.speculative.collect(self.runner, step, dropped)
        except Exception:
            ids = [c.request_id for c in scheduled.chunks]
            logger.exception("engine step failed; failing the requests of the step: %s", ids)
            failed = {rid: internal_error_message(rid) for rid in ids}
            return scheduled, ModelOutput(sampled={}, logprobs={}, failed=failed)
        if not output.failed and not step.output.is_empty:
            step.timer.wait()
            seconds = step.timer.device_seconds
            self.scheduler.step_budget.observe(scheduled.shape, seconds)
            self.scheduler.speculation.record_step_time(scheduled.draft_step, seconds * 1e3)
        return scheduled, output

    def _is_running(self, request_id: str) -> bool:
        """False for a request aborted or preempted while its step was in flight."""
        request = self.scheduler.get_request(request_id)
        return request is not None and request.status is RequestStatus.RUNNING
