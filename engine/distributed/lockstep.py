"""`LockstepRunner`: a `ModelRunner` whose every step first agrees with the other ranks.

`EngineCore.step` (schedule → execute → update) is unchanged; the core's runner is wrapped:

    execute(scheduled):
        agreement = coordinator.agree(RankWork(scheduled tokens, sequences, stop))
        stop            → run nothing; `stopped` is set (every rank leaves its loop)
        no rank works   → nothing to run (the coordinator slept)
        else            → the runner's own execute; if it ran no MoE pass (nothing of this
                          rank's, or every chunk refused), `model.zero_token_step()` joins the
                          collectives of the others

A rank with no request at all calls `idle_step()` instead of `EngineCore.step`. Exactly one
layer pass per agreed step with work is the invariant that keeps MoE collectives paired; it is
counted with a forward hook on the first MoE layer, so it holds whatever the runner skipped.

Any exception while agreeing or running is fatal for the group (a half-run step leaves peers
in a collective): it is kept in `fatal` and re-raised; the rank must exit (`EngineCore` would
otherwise only fail the step's requests and keep stepping).
"""

from __future__ import annotations

from engine.distributed.coordinator import RankWork, StepAgreement, StepCoordinator
from engine.model_runner import ModelRunner
from engine.outputs import ModelOutput, SchedulerOutput


class LockstepRunner:
    def __init__(self, runner: ModelRunner, coordinator: StepCoordinator) -> None:
        self.runner = runner
        self.model = runner.model
        self.coordinator = coordinator
        self.stop_requested = False  # set by the rank loop when told to stop
        self.stopped = False  # the ranks agreed to stop
        self.fatal: BaseException | None = None
        self._num_passes = 0
        self.model.layers[0].ffn.register_forward_hook(self._count_pass)

    def _count_pass(self, module, args, output) -> None:
        self._num_passes += 1

    @property
    def replay_rows(self):
        """The wrapped runner's `ModelRunner.replay_rows` (read by the rank's snapshot)."""
        return self.runner.replay_rows

    @property
    def speculative(self):
        """The wrapped runner's `ModelRunner.speculative` (its metrics feed the snapshot)."""
        return self.runner.speculative

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        try:
            agreement = self._agree(scheduled.num_tokens, len(scheduled.chunks))
            if self.stopped or not agreement.has_work:
                return ModelOutput(sampled={}, logprobs={})
            before = self._num_passes
            output = self.runner.execute(scheduled)
            if self._num_passes == before:
                self.model.zero_token_step()
            return output
        except BaseException as exc:
            self.fatal = exc
            raise

    def idle_step(self) -> None:
        """The step of a rank with no request: agree, and join the others' collectives."""
        try:
            agreement = self._agree(0, 0)
            if agreement.has_work:
                self.model.zero_token_step()
        except BaseException as exc:
            self.fatal = exc
            raise

    def _agree(self, num_tokens: int, num_seqs: int) -> StepAgreement:
        work = RankWork(num_tokens, num_seqs if num_tokens else 0, self.stop_requested)
        agreement = self.coordinator.agree(work)
        self.stopped = agreement.stop
        return agreement
