"""`fixed_capacity`: equal-split `all_to_all_single` of static shapes (CUDA-graph friendly).

Every exchange moves exactly `[N, 1 + C, W]` bytes per pass: for each peer one header row and C
row slots (C = `capacity_tokens` × rows per token; padding is zeros). No count exchange, no
variable split sizes:

    block for peer p:  [header: rows in this block, sender's max rows still unsent] [row]·C

Overflow (a sender has more than C rows for some peer): the rows that did not fit go in further
passes of the same shape. Every sender puts its own "max rows still unsent over all peers" in
every header, and every rank receives a header from every sender, so after each pass all ranks
see the same global maximum and run the same number of passes — rows are never dropped and no
extra collective is needed. Rows keep their order, so the result equals `all_to_all`'s.

Sizing: a rank sends a token at most once per peer, so C ≥ the step's largest per-rank token
count (`StepAgreement.max_tokens`, equal on all ranks) never overflows: one pass, static shapes.
NOTE: this reference implementation reads the headers on the host to compact the valid rows for
the expert loop; a captured decode graph consumes the padded layout directly (masked grouped
GEMM, a GPU follow-up) and must be sized so it cannot overflow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from engine.distributed.dispatch.base import Dispatcher, ExpertPlacement

_HEADER_BYTES = 16  # two int64: rows in the block, sender's max rows still unsent


class FixedCapacityDispatcher(Dispatcher):
    def __init__(
        self, placement: ExpertPlacement, group: dist.ProcessGroup | None, capacity_tokens: int
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be at least 1, got {capacity_tokens}")
        super().__init__(placement)
        self.group = group
        self.capacity_tokens = capacity_tokens
        self.num_passes_last = 0  # passes of the latest exchange (observability, tests)

    def _exchange(
        self, rows: Tensor, send_counts: Tensor, recv_counts: Tensor | None, rows_per_token: int
    ) -> tuple[Tensor, Tensor]:
        ep_size = self.placement.ep_size
        cap = self.capacity_tokens * rows_per_token
        width = max(rows.shape[1], _HEADER_BYTES)
        counts = send_counts.tolist()
        starts = [sum(counts[:p]) for p in range(ep_size)]
        received: list[list[Tensor]] = [[] for _ in range(ep_size)]
        done = 0
        while True:
            unsent = max(max(c - done - cap, 0) for c in counts)
            send = rows.new_zeros(ep_size, 1 + cap, width)
            for peer in range(ep_size):
                n = min(max(counts[peer] - done, 0), cap)
                lo = starts[peer] + done
                send[peer, 1 : 1 + n, : rows.shape[1]] = rows[lo : lo + n]
                header = torch.tensor([n, unsent], dtype=torch.int64).view(torch.uint8)
                send[peer, 0, :_HEADER_BYTES] = header.to(rows.device)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            headers = recv[:, 0, :_HEADER_BYTES].contiguous().view(torch.int64).tolist()
            for source, (n, _) in enumerate(headers):
                received[source].append(recv[source, 1 : 1 + n, : rows.shape[1]])
            done += cap
            self.num_passes_last = done // cap
            if max(h[1] for h in headers) == 0:
                break
        per_source = [torch.cat(chunks) for chunks in received]
        got = torch.tensor([len(t) for t in per_source], device=send_counts.device)
        if recv_counts is not None and not torch.equal(got, recv_counts.to(got.device)):
            raise RuntimeError(f"fixed-capacity exchange lost rows: got {got}, want {recv_counts}")
        return torch.cat(per_source), got
