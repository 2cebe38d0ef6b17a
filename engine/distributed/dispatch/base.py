"""The MoE token-dispatch contract (`scaleout.md` §2.2–§2.3) and the work every transport shares.

    dispatcher.dispatch(x, ids, weights) -> RecvBatch      tokens this rank's experts must run
    experts(RecvBatch)                    -> slot outputs  fp32 [R, k, D]: one row per received
                                                           (row, slot), zero where served elsewhere
    dispatcher.combine(slot_out, recv, ordered) -> y [T, D] routed output back at the owner

Sender side (`SendPlan`): each token is shipped ONCE per destination rank that owns at least one
of its top-k experts, with all k (local expert id or −1, weight) pairs; rows are grouped by
destination rank, tokens ascending inside a group:

    ids [T, k] ──owner──▶ dest [T, k] ──any per rank──▶ rows (rank 0: t…, rank 1: t…, …)

Each row travels as bytes `[x (D · itemsize) | local ids (k int32) | weights (k fp32)]` — one
buffer, one exchange. Transports (`Dispatcher._exchange`) only move such byte rows between ranks.

Combine, two orders (the `ordered` flag, `scaleout.md` §2.3):

* fast (`ordered=False`): each destination sums its pairs of a token into one partial row and
  returns it; the owner adds the partials in rank order. Fewest bytes; the rounding depends on
  where experts live.
* ordered (`ordered=True`, batch-invariant mode): destinations return one row per (token, k)
  pair; the owner adds a token's k rows in ascending LOGICAL expert id starting from 0.0 (fp32).
  That is exactly the order of the single-process reference path (`MoE._routed_reference` adds
  experts in id order), so with a row-invariant expert kernel the output is bitwise independent
  of the placement, of the EP size and of the other tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class ExpertPlacement:
    """Which routed experts a rank holds: contiguous blocks, rank r owns
    `[r · per_rank, (r + 1) · per_rank)`. Raises ValueError when `num_experts` is not divisible
    by `ep_size`."""

    num_experts: int
    ep_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.ep_size < 1 or not 0 <= self.rank < self.ep_size:
            raise ValueError(f"rank {self.rank} is outside an EP group of size {self.ep_size}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"{self.num_experts} routed experts cannot be split over {self.ep_size} EP ranks: "
                f"every rank holds the same number of experts, so the EP size must divide "
                f"{self.num_experts}"
            )

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.experts_per_rank

    @property
    def local_experts(self) -> range:
        """Global ids of this rank's experts, ascending (local id = position in this range)."""
        return range(self.first_expert, self.first_expert + self.experts_per_rank)

    def owns(self, expert: int) -> bool:
        return expert in self.local_experts

    def owner_of(self, ids: Tensor) -> Tensor:
        return torch.div(ids, self.experts_per_rank, rounding_mode="floor")


@dataclass
class SendPlan:
    """Sender-side bookkeeping of one dispatch (kept until `combine`).

    token: [S] owner token index of each sent row (grouped by destination rank).
    local_ids: [S, k] the row's pairs as the destination's local expert ids (−1: elsewhere).
    send_counts: [N] rows per destination rank.
    ids: [T, k] the global expert ids (the ordered combine sorts by them).
    """

    token: Tensor
    local_ids: Tensor
    send_counts: Tensor
    ids: Tensor


@dataclass
class SlotPlan:
    """Sender-side bookkeeping of a static-layout dispatch (`fixed_capacity`, one pass).

    slot: [T, N] the padded-layout row (peer · C + position) of token t's row to peer p,
        N · C where the token sends nothing to p.
    ids: [T, k] the global expert ids.
    """

    slot: Tensor
    ids: Tensor


def plan_send(ids: Tensor, placement: ExpertPlacement) -> SendPlan:
    """Rows to ship for routing `ids` [T, k] (one per token and destination rank)."""
    num_tokens, ep_size = ids.shape[0], placement.ep_size
    dest = placement.owner_of(ids)
    hit = torch.zeros(num_tokens, ep_size, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, dest, True)
    rank, token = hit.t().nonzero(as_tuple=True)  # rank-major, tokens ascending
    row_dest = dest[token]
    local = ids[token] - rank[:, None] * placement.experts_per_rank
    local_ids = torch.where(row_dest == rank[:, None], local, torch.full_like(local, -1))
    # (not bincount: on CUDA it reads the largest rank back to size its output)
    send_counts = torch.zeros(ep_size, dtype=torch.long, device=ids.device)
    send_counts.scatter_add_(0, rank, torch.ones_like(rank))
    return SendPlan(token=token, local_ids=local_ids, send_counts=send_counts, ids=ids)


@dataclass
class RecvBatch:
    """Rows received by this rank, grouped by source rank.

    x: [R, D] token activations; local_ids: [R, k] int64 (−1: a pair served elsewhere, or a
    padding row of a static layout); weights: [R, k] fp32; recv_counts: [N] rows from each
    source rank; plan: the sender-side plan of the same dispatch (this rank's own tokens),
    needed by `combine` (`SlotPlan` for a static layout).
    """

    x: Tensor
    local_ids: Tensor
    weights: Tensor
    recv_counts: Tensor
    plan: SendPlan | SlotPlan
    _pair_index: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(row [P], local expert [P], weight [P]) of the valid pairs in row-major order."""
        flat = self.pair_index()
        k = self.local_ids.shape[1]
        row = torch.div(flat, k, rounding_mode="floor")
        return row, self.local_ids.flatten()[flat], self.weights.flatten()[flat]

    def pair_index(self) -> Tensor:
        """Flat slot (row · k + slot) of each valid pair, row-major [P]. P is read on the host
        (one sync), once per batch."""
        if self._pair_index is None:
            self._pair_index = (self.local_ids >= 0).flatten().nonzero(as_tuple=True)[0]
        return self._pair_index

    def slot_outputs(self, pair_out: Tensor) -> Tensor:
        """Pair outputs [P, D] in `pairs` order → the slot layout [R, k, D] `combine` takes
        (zeros at slots served elsewhere)."""
        num_rows, k = self.local_ids.shape
        out = pair_out.new_zeros(num_rows * k, pair_out.shape[1])
        out[self.pair_index()] = pair_out
        return out.view(num_rows, k, pair_out.shape[1])


def _as_bytes(t: Tensor) -> Tensor:
    """[R, n] of any dtype → [R, n · itemsize] uint8 (also for R = 0)."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: Tensor, dtype: torch.dtype) -> Tensor:
    return b.contiguous().view(dtype)


class Dispatcher(ABC):
    """Dispatch/combine over one EP group. Subclasses implement only `_exchange`.

    Every method is a collective over the group: all ranks call it in the same order (a rank
    without tokens calls it with T = 0).
    """

    def __init__(self, placement: ExpertPlacement) -> None:
        self.placement = placement

    @abstractmethod
    def _exchange(
        self, rows: Tensor, send_counts: Tensor, recv_counts: Tensor | None, rows_per_token: int
    ) -> tuple[Tensor, Tensor]:
        """Send byte rows `rows` [S, W] (grouped by destination, `send_counts` [N] each);
        return the rows received (grouped by source) and their counts [N]. `recv_counts` is
        given when the receiver already knows it (the combine direction). `rows_per_token`
        bounds rows per token and peer (1, or k for pair rows: fixed-capacity sizing)."""

    def dispatch(self, x: Tensor, ids: Tensor, weights: Tensor) -> RecvBatch:
        """Ship each token of `x` [T, D] once to every rank owning one of its experts `ids`
        [T, k] (global ids), with its (local id, fp32 weight) pairs."""
        plan = plan_send(ids, self.placement)
        k = ids.shape[1]
        rows = torch.cat(
            (
                _as_bytes(x[plan.token]),
                _as_bytes(plan.local_ids.to(torch.int32)),
                _as_bytes(weights[plan.token].float()),
            ),
            dim=1,
        )
        recv, recv_counts = self._exchange(rows, plan.send_counts, None, 1)
        x_bytes = x.shape[1] * x.element_size()
        return RecvBatch(
            x=_from_bytes(recv[:, :x_bytes], x.dtype),
            local_ids=_from_bytes(recv[:, x_bytes : x_bytes + 4 * k], torch.int32).long(),
            weights=_from_bytes(recv[:, x_bytes + 4 * k :], torch.float32),
            recv_counts=recv_counts,
            plan=plan,
        )

    def combine(self, slot_out: Tensor, recv: RecvBatch, ordered: bool) -> Tensor:
        """Routed output [T, D] fp32 of this rank's own tokens from the expert outputs in slot
        layout [R, k, D] (fp32, weighted, zero where `recv.local_ids` < 0: slots served
        elsewhere). See the module docstring for `ordered`."""
        plan = recv.plan
        num_tokens, k = plan.ids.shape
        dim = slot_out.shape[-1]
        if ordered:
            back = slot_out.reshape(-1, dim)[recv.pair_index()]  # valid pairs, row-major
            back_counts = _per_source(recv)
            sent_valid = plan.local_ids >= 0
            expect = _group_sums(sent_valid.sum(1), plan.send_counts)
        else:
            back = sum_slots(slot_out)
            back_counts, expect = recv.recv_counts, plan.send_counts
        rows, _ = self._exchange(_as_bytes(back), back_counts, expect, k if ordered else 1)
        returned = _from_bytes(rows, torch.float32)
        out = torch.zeros(num_tokens, dim, dtype=torch.float32, device=slot_out.device)
        if not ordered:
            return out.index_add_(0, plan.token, returned)  # partials in rank order
        per_pair = torch.zeros(num_tokens, k, dim, dtype=torch.float32, device=slot_out.device)
        sent_row, sent_k = sent_valid.nonzero(as_tuple=True)
        per_pair[plan.token[sent_row], sent_k] = returned
        return sum_by_expert_id(per_pair, plan.ids)


def sum_slots(slot_out: Tensor) -> Tensor:
    """[R, k, D] → [R, D]: each row's slots added in slot order from 0.0 (the fast combine's
    per-destination partial)."""
    total = torch.zeros_like(slot_out[:, 0])
    for j in range(slot_out.shape[1]):
        total = total + slot_out[:, j]
    return total


def sum_by_expert_id(per_pair: Tensor, ids: Tensor) -> Tensor:
    """[T, k, D] → [T, D]: a token's k rows added in ascending expert id `ids` [T, k] from 0.0
    (the ordered combine; the reference path's order)."""
    by_id = ids.argsort(dim=1, stable=True)[..., None].expand_as(per_pair)
    by_expert = per_pair.gather(1, by_id)
    out = torch.zeros_like(per_pair[:, 0])
    for j in range(per_pair.shape[1]):
        out = out + by_expert[:, j]
    return out


def _group_sums(values: Tensor, counts: Tensor) -> Tensor:
    """Sums of consecutive groups of `values` of sizes `counts`."""
    group = torch.repeat_interleave(torch.arange(len(counts), device=values.device), counts)
    return torch.zeros(len(counts), dtype=torch.long, device=values.device).index_add_(
        0, group, values.long()
    )


def _per_source(recv: RecvBatch) -> Tensor:
    """Valid pairs received from each source rank."""
    return _group_sums((recv.local_ids >= 0).sum(1), recv.recv_counts)
