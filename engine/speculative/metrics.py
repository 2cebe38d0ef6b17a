"""Speculation counters (`dspark.md` §5.1), kept by the runner's speculative step (plain ints).

Per request-step that drafted: K drafts proposed, L verified, a accepted (a + 1 tokens
committed). Per position k (1-based): how often draft k was verified, and accepted (k ≤ a: under
block verification, where the drafts are decided jointly, a is η and draft k counts as accepted
when it lies in the accepted prefix).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SpeculativeMetrics:
    """Cumulative counts since start; `snapshot` copies them for the metrics endpoint."""

    num_speculative_tokens: int
    num_steps: int = 0  # engine steps with a drafting request
    num_request_steps: int = 0  # request-steps that drafted
    num_drafted: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    accept_length: list[int] = field(default_factory=list)  # [a + 1] -> request-steps
    verify_rows_per_step: list[int] = field(default_factory=list)  # Σ(1 + L) -> steps
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accept_length = self.accept_length or [0] * (k + 2)
        self.verified_per_position = self.verified_per_position or [0] * (k + 1)
        self.accepted_per_position = self.accepted_per_position or [0] * (k + 1)

    def observe(
        self,
        is_drafting: Sequence[bool],
        lengths: Sequence[int],
        accepted: Sequence[int],
        num_drafted: int,
    ) -> None:
        """One step: per sampled request, whether it drafted, L verified and a accepted."""
        rows = 0
        any_drafting = False
        for drafted, n, a in zip(is_drafting, lengths, accepted, strict=True):
            if not drafted:
                continue
            any_drafting = True
            rows += 1 + n
            self.num_request_steps += 1
            self.num_drafted += min(num_drafted, self.num_speculative_tokens)
            self.num_verified += n
            self.num_accepted += a
            self.accept_length[a + 1] += 1
            for k in range(1, n + 1):
                self.verified_per_position[k] += 1
                self.accepted_per_position[k] += k <= a
        if any_drafting:
            self.num_steps += 1
            while len(self.verify_rows_per_step) <= rows:
                self.verify_rows_per_step.append(0)
            self.verify_rows_per_step[rows] += 1

    def copy(self) -> SpeculativeMetrics:
        """An independent copy (for snapshots read while steps run)."""
        return dataclasses.replace(
            self,
            accept_length=list(self.accept_length),
            verify_rows_per_step=list(self.verify_rows_per_step),
            verified_per_position=list(self.verified_per_position),
            accepted_per_position=list(self.accepted_per_position),
        )

    @property
    def mean_accept_length(self) -> float:
        """Committed tokens per drafting request-step (a + 1), 0 before any."""
        if not self.num_request_steps:
            return 0.0
        return (self.num_accepted + self.num_request_steps) / self.num_request_steps
