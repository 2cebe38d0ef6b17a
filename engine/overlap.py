"""OverlappedCore: async scheduling, the host works on steps N+1 and N−1 while the device runs N.

One call of `step()`, with step N launched by the previous call and still on the device:

    host    schedule N+1 │ launch N+1 │ wait for N's ids │ update N │ sample N+1
    device  ── step N ───────────────────┤ forward N+1 ……………………… sampling N+1 ──

Step N+1 is scheduled before N's sampled ids reach the host: a request decoding in N gets a decode
row whose token is a placeholder (`PLACEHOLDER_TOKEN_ID`), which the runner fills from N's ids on
the device. N's ids are then brought back and applied (`Scheduler.update`), so stop conditions
take effect one step late: a request that stops at N's token has one more token computed in
N+1, which `update` drops (never emitted). Length limits are known ahead and cost nothing.

Sampling of N+1 is queued right behind its forward unless a row needs N's token on the host: a
grammar mask (the matcher must accept N's token before it can fill N+1's row) or a penalty
history. Such a step samples after N is collected, so only the rows that need N's tokens wait
for them: the forward of N+1 still overlaps N's return trip, and a request that finished at N
is sampled without its (released) grammar and discarded. A thinking budget's one forced draw
depends on whether an earlier output ended the reasoning: the scheduler does not run that row
ahead (it waits one step, once per request).

Tokens equal those of `EngineCore`: randomness is keyed by (seed, position), and every token a
request emits was sampled from the same logits and mask as in the synchronous loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core import EngineCore, internal_error_message
from engine.model_runner import StepInFlight
from engine.outputs import Delta, ModelOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _InFlight:
    scheduled: SchedulerOutput  # as scheduled (the runner's step leaves invalid chunks out)
    step: StepInFlight


class OverlappedCore(EngineCore):
    """`EngineCore` with one step in flight between calls of `step()` (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: _InFlight | None = None

    def has_work(self) -> bool:
        return self._in_flight is not None or super().has_work()

    def step(self) -> list[Delta]:
        """Schedule and launch step N+1, then apply step N; returns N's deltas."""
        scheduled = self.scheduler.schedule()
        launched = self._launch(scheduled)
        previous, previous_output = self._collect_in_flight()
        deltas = self.scheduler.update(previous, previous_output)
        self.runner.release([d.request_id for d in deltas if d.finish_reason is not None])
        self._sample(launched, previous_output)
        self._in_flight = None if scheduled.is_empty else _InFlight(scheduled, launched)
        return deltas

    # ---- the three phases, each failing only its own step's requests -------------------------

    def _launch(self, scheduled: SchedulerOutput) -> StepInFlight:
        """Start step N+1 on the device behind step N (whose ids fill its placeholders)."""
        try:
            return self.runner.launch(scheduled, self._in_flight and self._in_flight.step)
        except Exception:
            return _failed_step(scheduled)

    def _collect_in_flight(self) -> tuple[SchedulerOutput, ModelOutput]:
        """Wait for step N's sampled ids (nothing when no step is in flight); feed its device
        time to the step budget."""
        if self._in_flight is None:
            return SchedulerOutput(chunks=(), num_tokens=0), ModelOutput(sampled={}, logprobs={})
        scheduled, step = self._in_flight.scheduled, self._in_flight.step
        dropped = {rid for rid in step.request_ids if self.scheduler.get_request(rid) is None}
        try:
            output = self.runner.collect(step, dropped)
        except Exception:
            ids = [c.request_id for c in scheduled.chunks]
            logger.exception("engine step failed; failing the requests of the step: %s", ids)
            failed = {rid: internal_error_message(rid) for rid in ids}
            output = ModelOutput(sampled={}, logprobs={}, failed=failed)
        if not output.failed:
            self.scheduler.step_budget.observe(scheduled.shape, step.device_seconds)
        return scheduled, output

    def _sample(self, launched: StepInFlight, previous_output: ModelOutput) -> None:
        """Sample step N+1 if `launch` could not: its grammar masks and penalty histories read
        N's tokens; rows of requests that finished at N are dropped."""
        previous_tokens = {rid: ids[-1] for rid, ids in previous_output.sampled.items()}
        dropped = {rid for rid in launched.request_ids if self.scheduler.get_request(rid) is None}
        try:
            self.runner.sample(launched, previous_tokens, dropped)
        except Exception:
            ids = [c.request_id for c in launched.output.chunks]
            logger.exception("engine step failed; failing the requests of the step: %s", ids)
            launched.fail({rid: internal_error_message(rid) for rid in ids})


def _failed_step(scheduled: SchedulerOutput) -> StepInFlight:
    """A step that never ran: every request of it fails alone (the exception is logged)."""
    ids = [c.request_id for c in scheduled.chunks]
    logger.exception("engine step failed; failing the requests of the step: %s", ids)
    step = StepInFlight(scheduled, {})
    step.fail({rid: internal_error_message(rid) for rid in ids})
    return step
