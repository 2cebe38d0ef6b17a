"""EngineCore: one step is schedule → execute → update."""

from __future__ import annotations

import logging
import time

from engine.model_runner import ModelRunner
from engine.outputs import Delta, ModelOutput, SchedulerOutput
from engine.request import Request
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def internal_error_message(request_id: str) -> str:
    """What a request that failed inside the engine tells its client: no exception text (it
    may describe another request of the same step); the details are in the server log."""
    return f"internal error while running request {request_id}; see the server log"


class EngineCore:
    """Synchronous core driven by `AsyncEngine` (or directly by tests and benchmarks)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Delta]:
        """Run one batch; returns the deltas of every request that advanced or finished."""
        scheduled = self.scheduler.schedule()
        model_output = self._execute(scheduled)
        deltas = self.scheduler.update(scheduled, model_output)
        self.runner.release([d.request_id for d in deltas if d.finish_reason is not None])
        return deltas

    def _execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        """The runner's output, its time fed to the step budget. If the runner raises, only
        this step's requests fail (their state may be half written; no other request's is)."""
        started = time.perf_counter()
        try:
            model_output = self.runner.execute(scheduled)
        except Exception:
            ids = [c.request_id for c in scheduled.chunks]
            logger.exception("engine step failed; failing the requests of the step: %s", ids)
            failed = {rid: internal_error_message(rid) for rid in ids}
            return ModelOutput(sampled={}, logprobs={}, failed=failed)
        if not scheduled.is_empty:
            elapsed = time.perf_counter() - started
            self.scheduler.step_budget.observe(scheduled.shape, elapsed)
            if self.scheduler.speculation is not None:
                self.scheduler.speculation.record_step_time(scheduled.draft_step, elapsed * 1e3)
        return model_output
