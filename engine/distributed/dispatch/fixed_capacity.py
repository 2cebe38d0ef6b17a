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
This general form reads the counts and headers on the host (to size the passes and compact the
rows).

`one_pass` (the caller guarantees every rank's tokens ≤ C: a CUDA-graph bucket, or C sized from
the agreed max tokens) reads nothing on the host. The layout stays padded end to end:

    dispatch   send [N · C, W]: token t's row to peer p at p · C + (its rank among p's tokens);
               padding rows carry local ids −1 (no header: a padding row holds no pair)
    experts    RecvBatch of R = N · C rows; the grouped kernel skips the −1 slots
    combine    back [N · C, D] (fast: slots summed) or [N · C, k, D] (ordered), same row order;
               the owner gathers its rows by `SlotPlan.slot` and adds them as the general path

A rank over capacity raises ValueError before any collective (a host check of its own T).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from engine.distributed.dispatch.base import (
    Dispatcher,
    ExpertPlacement,
    RecvBatch,
    SlotPlan,
    _as_bytes,
    _from_bytes,
    sum_by_expert_id,
    sum_slots,
)

_HEADER_BYTES = 16  # two int64: rows in the block, sender's max rows still unsent


class FixedCapacityDispatcher(Dispatcher):
    def __init__(
        self,
        placement: ExpertPlacement,
        group: dist.ProcessGroup | None,
        capacity_tokens: int,
        one_pass: bool = False,
    ) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be at least 1, got {capacity_tokens}")
        super().__init__(placement)
        self.group = group
        self.capacity_tokens = capacity_tokens
        self.one_pass = one_pass
        self.num_passes_last = 0  # passes of the latest exchange (observability, tests)

    def dispatch(self, x: Tensor, ids: Tensor, weights: Tensor) -> RecvBatch:
        if not self.one_pass:
            return super().dispatch(x, ids, weights)
        num_tokens, k = ids.shape
        if num_tokens > self.capacity_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed the one-pass capacity of {self.capacity_tokens}"
            )
        ep_size, cap = self.placement.ep_size, self.capacity_tokens
        ranks = torch.arange(ep_size, device=ids.device)
        dest = self.placement.owner_of(ids)
        hit = torch.zeros(num_tokens, ep_size, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, dest, True)
        slot = torch.where(hit, torch.cumsum(hit.long(), 0) - 1 + ranks * cap, ep_size * cap)
        local = ids[:, None, :] - (ranks * self.placement.experts_per_rank)[:, None]
        local = torch.where(dest[:, None, :] == ranks[:, None], local, -1).to(torch.int32)
        x_bytes, w_bytes = _as_bytes(x), _as_bytes(weights.float())
        x_width = x_bytes.shape[1]
        width = x_width + 4 * k + w_bytes.shape[1]
        rows = torch.cat(
            (
                x_bytes[:, None].expand(-1, ep_size, -1),
                _as_bytes(local.view(-1, k)).view(num_tokens, ep_size, 4 * k),
                w_bytes[:, None].expand(-1, ep_size, -1),
            ),
            dim=2,
        )
        send = torch.zeros(ep_size * cap + 1, width, dtype=torch.uint8, device=x.device)
        send[:, x_width : x_width + 4 * k] = 0xFF  # int32 −1: padding rows hold no pair
        send[slot.flatten()] = rows.reshape(-1, width)  # (unsent rows land on the extra row)
        send = send[:-1]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        self.num_passes_last = 1
        return RecvBatch(
            x=_from_bytes(recv[:, :x_width], x.dtype),
            local_ids=_from_bytes(recv[:, x_width : x_width + 4 * k], torch.int32).long(),
            weights=_from_bytes(recv[:, x_width + 4 * k :], torch.float32),
            recv_counts=torch.full((ep_size,), cap, dtype=torch.long, device=x.device),
            plan=SlotPlan(slot=slot, ids=ids),
        )

    def combine(self, slot_out: Tensor, recv: RecvBatch, ordered: bool) -> Tensor:
        if not self.one_pass:
            return super().combine(slot_out, recv, ordered)
        plan = recv.plan
        back = (slot_out if ordered else sum_slots(slot_out)).contiguous()
        returned = torch.empty_like(back)
        dist.all_to_all_single(returned, back, group=self.group)
        returned = torch.cat((returned, returned.new_zeros((1, *returned.shape[1:]))))
        if ordered:  # slot j of token t came back on the row it was sent on to its owner
            row = plan.slot.gather(1, self.placement.owner_of(plan.ids))
            per_pair = returned[row, torch.arange(row.shape[1], device=row.device)]
            return sum_by_expert_id(per_pair, plan.ids)
        partials = returned[plan.slot]  # [T, N, D]; zero rows where nothing was sent
        out = torch.zeros_like(partials[:, 0])
        for rank in range(partials.shape[1]):  # partials in rank order
            out = out + partials[:, rank]
        return out

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
