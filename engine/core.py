"""EngineCore: one step is schedule → execute → update."""

from __future__ import annotations

from engine.model_runner import ModelRunner
from engine.outputs import Delta
from engine.request import Request
from engine.scheduler import Scheduler


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
        model_output = self.runner.execute(scheduled)
        deltas = self.scheduler.update(scheduled, model_output)
        self.runner.release([d.request_id for d in deltas if d.finish_reason is not None])
        return deltas
