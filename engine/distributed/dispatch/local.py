"""`local`: EP size 1 — every expert is on this rank, rows go nowhere."""

from __future__ import annotations

from torch import Tensor

from engine.distributed.dispatch.base import Dispatcher, ExpertPlacement


class LocalDispatcher(Dispatcher):
    """No communication; the same plan, pair layout and combine orders as the parallel ones."""

    def __init__(self, placement: ExpertPlacement) -> None:
        if placement.ep_size != 1:
            raise ValueError(f"the local dispatcher serves EP size 1, not {placement.ep_size}")
        super().__init__(placement)

    def _exchange(
        self, rows: Tensor, send_counts: Tensor, recv_counts: Tensor | None, rows_per_token: int
    ) -> tuple[Tensor, Tensor]:
        return rows, send_counts
