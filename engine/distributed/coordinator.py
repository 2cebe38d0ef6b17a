"""Lockstep across engine ranks (`scaleout.md` §2.1).

Every MoE layer is a collective, so every rank must run every step, even one with nothing to do.
Once per step, before it builds its batch, each rank calls `StepCoordinator.agree(RankWork)`:
one small all-gather of `[step, num_tokens, num_seqs, stop]` over the control group. All ranks
get the same `StepAgreement` back and act on it the same way:

    agreement = coordinator.agree(RankWork(num_tokens, num_seqs))
    if not agreement.has_work:      # no rank has work: `agree` already slept
        continue
    if num_tokens == 0:             # others have work: join their MoE collectives
        model.zero_token_step()
    else:
        model.forward_step(batch, state)

The agreement also fixes the CUDA-graph bucket (`bucket_for`: the smallest bucket holding the
largest rank's tokens, the same on every rank) and the fixed-capacity dispatcher's bound
(`max_tokens`: no rank sends more rows than that to any peer).

NOTE: every choice that changes which collectives a step runs (zero-token step, dispatcher,
graph bucket) must be a function of the agreement alone, never of rank-local state, or ranks
pair different collectives and hang until the group timeout.

Idle: when no rank has work every rank sleeps `idle_sleep_s`, doubling up to `max_idle_sleep_s`
while the engine stays idle (work arriving meanwhile waits at most that long); the first step
with work resets the backoff. A mismatch of step numbers (a rank skipped or repeated a step)
raises `LockstepError` on every rank instead of pairing the wrong collectives.

Stop: a rank asked to stop sets `RankWork.stop`; the agreement's `stop` is then true on every
rank in the same step, so all leave the loop together (none is left waiting in a collective).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class LockstepError(RuntimeError):
    """Ranks disagree on the step they are in."""


class IntGather(Protocol):
    """All-gather of one small list of ints per rank (the same length on every rank)."""

    def __call__(self, values: Sequence[int]) -> list[list[int]]: ...


def gloo_int_gather(group: dist.ProcessGroup | None) -> IntGather:
    """`IntGather` over a torch.distributed (gloo) group: one int64 `all_gather`."""

    def gather(values: Sequence[int]) -> list[list[int]]:
        local = torch.tensor(list(values), dtype=torch.int64)
        world = dist.get_world_size(group)
        out = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(out, local, group=group)
        return [t.tolist() for t in out]

    return gather


@dataclass(frozen=True)
class RankWork:
    """What one rank would run this step: scheduled tokens and sequences; `stop`: this rank
    wants every rank to leave the step loop now (instead of running the step)."""

    num_tokens: int
    num_seqs: int
    stop: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.num_seqs < 0:
            raise ValueError(f"negative work: {self}")
        if (self.num_tokens == 0) != (self.num_seqs == 0):
            raise ValueError(f"tokens without sequences or sequences without tokens: {self}")


@dataclass(frozen=True)
class StepAgreement:
    """The step every rank runs: per-rank tokens and sequences, indexed by rank."""

    step: int
    num_tokens: tuple[int, ...]
    num_seqs: tuple[int, ...]
    stop: bool = False

    @property
    def has_work(self) -> bool:
        """Some rank runs tokens this step (never when the ranks stop)."""
        return not self.stop and any(self.num_tokens)

    @property
    def max_tokens(self) -> int:
        return max(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def is_zero_token(self, rank: int) -> bool:
        """True when `rank` must run a zero-token step (others have work, it has none)."""
        return self.has_work and self.num_tokens[rank] == 0

    def bucket_for(self, buckets: Sequence[int]) -> int | None:
        """The smallest bucket holding `max_tokens` (None when none does): every rank picks
        the same one, so captured shapes line up."""
        return next((b for b in sorted(buckets) if b >= self.max_tokens), None)


class StepCoordinator:
    """Per-rank agent of the lockstep protocol (see the module docstring).

    gather: the control-group all-gather (`gloo_int_gather(groups.cpu)`; a fake in unit tests).
    sleep: injected for tests (`time.sleep` by default).
    """

    def __init__(
        self,
        gather: IntGather,
        idle_sleep_s: float = 0.001,
        max_idle_sleep_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0 < idle_sleep_s <= max_idle_sleep_s:
            raise ValueError("need 0 < idle_sleep_s <= max_idle_sleep_s")
        self._gather = gather
        self._idle_sleep_s = idle_sleep_s
        self._max_idle_sleep_s = max_idle_sleep_s
        self._sleep = sleep
        self._next_sleep_s = idle_sleep_s
        self._step = 0

    @property
    def step(self) -> int:
        """The number of the next step to agree on (mutated only by `agree`)."""
        return self._step

    def agree(self, work: RankWork) -> StepAgreement:
        """Exchange this rank's work with every rank; sleep when nobody has any. Collective:
        every rank must call it once per step."""
        rows = self._gather([self._step, work.num_tokens, work.num_seqs, int(work.stop)])
        steps = [row[0] for row in rows]
        if any(s != self._step for s in steps):
            raise LockstepError(f"ranks are in different steps: {steps} (this rank: {self._step})")
        agreement = StepAgreement(
            step=self._step,
            num_tokens=tuple(row[1] for row in rows),
            num_seqs=tuple(row[2] for row in rows),
            stop=any(row[3] for row in rows),
        )
        self._step += 1
        if agreement.has_work or agreement.stop:
            self._next_sleep_s = self._idle_sleep_s
        else:
            self._sleep(self._next_sleep_s)
            self._next_sleep_s = min(2 * self._next_sleep_s, self._max_idle_sleep_s)
        return agreement
