"""`all_to_all`: `torch.distributed.all_to_all_single` over the EP group (NCCL or gloo).

Forward: one tiny exchange of row counts, then the rows with those split sizes. Combine: the
rows back with the splits swapped (counts are known on both sides). Shapes depend on the counts,
so the host reads them (one read of both split lists per exchange): prefill, or eager decode.

Host reads of one MoE layer on CUDA (grouped local experts; the experts themselves read none):

    dispatch    plan_send's nonzero (rows to send)  +  this exchange's split sizes      2
    combine     fast: the split sizes                                                    1
                ordered: the valid pairs' index, pairs per source (two group sums),
                the split sizes, the sent pairs' nonzero                                 5

`fixed_capacity` with `one_pass` has none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from engine.distributed.dispatch.base import Dispatcher, ExpertPlacement


class AllToAllDispatcher(Dispatcher):
    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None) -> None:
        super().__init__(placement)
        self.group = group

    def _exchange(
        self, rows: Tensor, send_counts: Tensor, recv_counts: Tensor | None, rows_per_token: int
    ) -> tuple[Tensor, Tensor]:
        if recv_counts is None:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_splits, send_splits = torch.stack((recv_counts, send_counts.to(recv_counts))).tolist()
        recv = rows.new_empty(sum(recv_splits), rows.shape[1])
        dist.all_to_all_single(recv, rows, recv_splits, send_splits, group=self.group)
        return recv, recv_counts
