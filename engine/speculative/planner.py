"""How many drafts a step verifies, and which (`dspark.md` §3).

Two roles, split so that verification stays lossless (§3.2):

* `VerifyPlanner.budget` (CPU, while step t−1 runs): the number B of draft tokens step t
  verifies, from survivals at least two steps old. It never sees the drafts it admits.
* `allocate` (device, step t, after drafting): which B (request, position) slots, ranked by the
  current step's survivals; every request's admitted set is a prefix of its drafts.

`FixedPlanner` verifies every draft up to each request's cap (the `fixed` mode and every fallback
of §3.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


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


class VerifyPlanner(Protocol):
    def budget(self, rows: Sequence[PlanRow], prefill_rows: int) -> int:
        """Total drafts B to verify in the step (0 ≤ B ≤ Σ cap)."""
        ...

    def observe(self, survivals: torch.Tensor, request_count: int) -> None:
        """The step's calibrated survivals [N, L] (host copy), for the population prior."""
        ...


class FixedPlanner:
    """Verify all: B = Σ cap."""

    def budget(self, rows: Sequence[PlanRow], prefill_rows: int) -> int:
        return sum(row.cap for row in rows)

    def observe(self, survivals: torch.Tensor, request_count: int) -> None:
        return None


def allocate(survivals: torch.Tensor, caps: torch.Tensor, budget: int) -> torch.Tensor:
    """Verify lengths L_r [N] (int64): the top-`budget` slots (r, k), k < caps[r].

    survivals: [N, L] non-increasing along k. Order: survival descending, then k ascending, then
    r ascending (a tie-break that never looks at values), so each request's slots are a prefix.
    Slots with survival below 1e-6 are never taken.
    """
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
