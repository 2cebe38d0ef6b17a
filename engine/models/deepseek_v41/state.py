"""Per-sequence model state and the batch description of one incremental forward.

State layout (`model.md` §3.10, §4), all addressed by ABSOLUTE position so that writes ahead of
the committed length (speculative drafts) never need a rollback:

    window rings   swa[layer]       [num_slots, ring_len, row_width]      pos p at p % ring_len
    global KV      global_kv[src]   [num_blocks, 128 // r, row_width]     compressed j at block
    index keys     index_keys[src]  [num_blocks, 128 // r, row_width]     table[j·r // 128],
                                                                          row j % (128 // r)
    pending pairs  pending[src]     [num_slots, pair_ring, 2, head_dim]   fp32 (k, gate) of even
                                                                          pos 2i at i % pair_ring
    token history  tokens           [num_slots, token_ring]               pos p at p % token_ring
    draft rings    draft_swa[stage] [num_slots, ring_len, row_width]      DSpark context rows

A "slot" is a running sequence's index into the per-sequence pools; a block table maps a
sequence's 128-token blocks to pool blocks, so global KV can be paged by the engine. One 128-token
block holds 64 rows of a ratio-2 source and 128 rows of a ratio-1 source.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

BLOCK_TOKENS = 128
PAIR_RING = 8
TOKEN_RING = 16


@dataclass
class ModelState:
    """Device tensors holding every sequence's persistent state (see the module docstring)."""

    swa: list[Tensor]
    global_kv: dict[int, Tensor]
    index_keys: dict[int, Tensor]
    pending: dict[int, Tensor]
    tokens: Tensor
    draft_swa: list[Tensor] = field(default_factory=list)  # DSpark context rings, one per stage
    # Reserved for the padding rows of padded decode steps (`decode_batch.py`); no request owns
    # them and nothing reads them as real data. None when the state reserves none.
    scratch_slot: int | None = None
    trash_block: int | None = None

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_blocks(self) -> int:
        return next(iter(self.global_kv.values())).shape[0] if self.global_kv else 0

    def nbytes(self) -> int:
        tensors = [*self.swa, *self.global_kv.values(), *self.index_keys.values()]
        tensors += [*self.pending.values(), self.tokens, *self.draft_swa]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StepBatch:
    """New tokens of several sequences for one forward (flat, sequence-major).

    Sequence b contributes tokens `token_ids[starts[b]:starts[b+1]]` at consecutive positions
    `start_positions[b], start_positions[b]+1, ...`; every earlier position must already be in
    the state of slot `slots[b]`. `block_tables[b]` lists the pool blocks of sequence b's
    128-token blocks (−1 = unallocated), covering every position it reaches in this step.
    `logits_indices` selects the flat rows that get logits (None = all rows).

    Prefix-cache replay (None = off for the whole batch; `engine/kv_cache/reuse.py`):
    `window_floors[b]`: sequence b's window reads see no row below this position (its ring
    holds another sequence's rows there); `reuse_ends[b]`: positions below it are in shared,
    read-only cached blocks, so the KV sources write no global KV or index key there.

    Decoder bounded replay (None = every row runs every layer; `model.md` §7.1):
    `decoder_floors[b]`: sequence b's decoder layers (the CED boundary on) compute only its
    positions ≥ this floor (at least its last one), and their window reads see no row below
    it; the boundary's KV source still writes the global KV of every row (`decoder_part`).
    """

    token_ids: Tensor  # int64 [T]
    starts: list[int]  # host ints, B + 1 offsets
    start_positions: list[int]  # host ints, B
    slots: Tensor  # int64 [B]
    block_tables: Tensor  # int64 [B, max_blocks]
    logits_indices: Tensor | None = None
    window_floors: list[int] | None = None  # host ints, B
    reuse_ends: list[int] | None = None  # host ints, B
    decoder_floors: list[int] | None = None  # host ints, B
    # Derived device-side indices, filled by `prepare`.
    positions: Tensor = field(init=False)
    seq_of_token: Tensor = field(init=False)
    pad_index: Tensor = field(init=False)  # [B, T_max] flat token index, −1 for padding
    start_position_tensor: Tensor = field(init=False)  # `start_positions` on the device
    lengths: list[int] = field(init=False)
    window_floor_tensor: Tensor | None = field(init=False)  # `window_floors` on the device
    reuse_end_tensor: Tensor | None = field(init=False)  # `reuse_ends` on the device

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.start_positions) + 1:
            raise ValueError("starts must have one more entry than start_positions")
        device = self.token_ids.device
        self.lengths = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        if any(n <= 0 for n in self.lengths):
            raise ValueError("every sequence in a step needs at least one new token")
        if self.decoder_floors is not None and any(
            f > p + n - 1
            for f, p, n in zip(self.decoder_floors, self.start_positions, self.lengths, strict=True)
        ):
            raise ValueError("a decoder floor lies past its sequence's last new position")
        lengths = ints_to_device(self.lengths, device)
        # output_size from the host: otherwise CUDA reads the sum of lengths back (a host wait).
        self.seq_of_token = torch.repeat_interleave(
            torch.arange(len(self.lengths), device=device), lengths, output_size=sum(self.lengths)
        )
        first = ints_to_device(self.starts[:-1], device)
        self.start_position_tensor = ints_to_device(self.start_positions, device)
        offset = torch.arange(self.token_ids.numel(), device=device) - first[self.seq_of_token]
        self.positions = self.start_position_tensor[self.seq_of_token] + offset
        t_max = max(self.lengths)
        local = torch.arange(t_max, device=device)
        self.pad_index = torch.where(local[None, :] < lengths[:, None], first[:, None] + local, -1)
        self._unpad_index = ints_to_device(
            [b * t_max + i for b, n in enumerate(self.lengths) for i in range(n)], device
        )
        self._token_indices: dict[tuple[int | None, int | None], Tensor] = {}
        # Every sequence has T_max tokens (decode steps): pad / unpad are reshapes.
        self._uniform = all(n == t_max for n in self.lengths)
        self._shared: dict[Hashable, Any] = {}
        self.window_floor_tensor = (
            None if self.window_floors is None else ints_to_device(self.window_floors, device)
        )
        self.reuse_end_tensor = (
            None if self.reuse_ends is None else ints_to_device(self.reuse_ends, device)
        )

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def max_len(self) -> int:
        return self.pad_index.shape[1]

    def end_positions(self) -> list[int]:
        """Position of each sequence's last new token."""
        return [p + n - 1 for p, n in zip(self.start_positions, self.lengths, strict=True)]

    def token_indices(self, tail: int | None = None, parity: int | None = None) -> Tensor:
        """Flat indices (int64, on the batch's device) of the tokens among the last `tail` new
        positions of their sequence and/or at positions of the given parity (None = any).

        Computed on the host from the batch's ints, so no device value is read back. Ring
        writes keep only a tail, so a long chunk never writes one ring index twice.
        """
        key = (tail, parity)
        if key not in self._token_indices:
            chosen = []
            seqs = zip(self.starts, self.start_positions, self.lengths, strict=False)
            for first, start, n in seqs:
                skip = 0 if tail is None else max(0, n - tail)
                chosen.extend(
                    first + i for i in range(skip, n) if parity is None or (start + i) % 2 == parity
                )
            self._token_indices[key] = ints_to_device(chosen, self.token_ids.device)
        return self._token_indices[key]

    def decoder_part(self) -> tuple[StepBatch, Tensor]:
        """The rows the decoder layers compute under `decoder_floors` (which must be set): a
        batch of each sequence's positions from max(start, floor) on, its window floors at
        `decoder_floors`, its logit rows renumbered (they must be kept rows: a chunk's last
        row always is); and the flat indices of those rows here.

        Built from host ints (no device read-back); token ids and logit rows are gathered on
        the device. The part computes no KV source: its caller wrote them for every row."""
        if self.decoder_floors is None:
            raise ValueError("decoder_part needs decoder_floors")
        kept, starts, start_positions = [], [0], []
        floors = self.decoder_floors
        seqs = zip(self.starts, self.start_positions, self.lengths, floors, strict=False)
        for first, start, n, floor in seqs:
            skip = max(0, floor - start)
            kept.extend(range(first + skip, first + n))
            starts.append(starts[-1] + n - skip)
            start_positions.append(start + skip)
        device = self.token_ids.device
        rows = ints_to_device(kept, device)
        logits_indices = None
        if self.logits_indices is not None:
            renumber = torch.full((self.num_tokens,), -1, dtype=torch.long, device=device)
            renumber[rows] = torch.arange(len(kept), device=device)
            logits_indices = renumber[self.logits_indices]
        part = StepBatch(
            token_ids=self.token_ids[rows],
            starts=starts,
            start_positions=start_positions,
            slots=self.slots,
            block_tables=self.block_tables,
            logits_indices=logits_indices,
            window_floors=list(floors),
            reuse_ends=self.reuse_ends,
        )
        return part, rows

    def rows_in_part(self, part: StepBatch, rows: Sequence[int]) -> list[int]:
        """The flat indices in `part` (this batch's `decoder_part`) of the flat `rows` of this
        batch, in their order, leaving out the rows below their sequence's decoder floor
        (the part did not compute them). Host ints only."""
        found = []
        for row in rows:
            seq = bisect.bisect_right(self.starts, row) - 1
            offset = self.start_positions[seq] + row - self.starts[seq] - part.start_positions[seq]
            if offset >= 0:
                found.append(part.starts[seq] + offset)
        return found

    def pad(self, flat: Tensor, fill: float = 0.0) -> Tensor:
        """[T, ...] → [B, T_max, ...] with `fill` in padding rows (a view when there are none)."""
        if self._uniform:
            return flat.unflatten(0, (self.num_seqs, self.max_len))
        source, rows = self.shared(
            "pad", lambda: (self.pad_index.clamp(min=0), self.pad_index >= 0)
        )
        out = flat[source]
        mask = rows.view(*self.pad_index.shape, *([1] * (flat.dim() - 1)))
        return out.masked_fill(~mask, fill)

    def unpad(self, padded: Tensor) -> Tensor:
        """[B, T_max, ...] → [T, ...] (inverse of `pad`; a view when there is no padding)."""
        if self._uniform:
            return padded.flatten(0, 1)
        return padded.flatten(0, 1)[self._unpad_index]

    def shared(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()`, computed once per batch for `key`: the index tensors every layer of a
        step would otherwise rebuild (each rebuild is a few kernel launches)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def ring_writes(self, ring_len: int) -> tuple[Tensor | None, Tensor, Tensor]:
        """Where a ring of `ring_len` rows per slot stores this step's rows: (the flat tokens
        kept, None for all of them in order; their slots; their ring rows). Only each
        sequence's last `ring_len` positions are kept (`token_indices`). Computed once per
        batch: every layer's window ring writes the same places."""
        return self.shared(("ring writes", ring_len), lambda: self._ring_writes(ring_len))

    def ring_flat_rows(self, ring_len: int) -> Tensor:
        """`ring_writes`' (slot, ring row) of every token as one row index into the ring's
        rows [slots · ring_len, ...] (where every token's row is kept). Once per batch."""

        def build() -> Tensor:
            keep, slots, rows = self.ring_writes(ring_len)
            if keep is not None:
                raise ValueError("some of this step's rows are not kept in the ring")
            return slots * ring_len + rows

        return self.shared(("ring flat rows", ring_len), build)

    def _ring_writes(self, ring_len: int) -> tuple[Tensor | None, Tensor, Tensor]:
        if all(n <= ring_len for n in self.lengths):
            return None, self.slots[self.seq_of_token], self.positions % ring_len
        keep = self.token_indices(tail=ring_len)
        return keep, self.slots[self.seq_of_token[keep]], self.positions[keep] % ring_len


def write_token_history(
    state: ModelState, slot: int, first_position: int, token_ids: list[int]
) -> None:
    """Write `token_ids` at positions `first_position, ...` into a slot's token history (what a
    sequence restored from the prefix cache has not computed itself)."""
    if not token_ids:
        return
    keep = token_ids[-TOKEN_RING:]
    first = first_position + len(token_ids) - len(keep)
    device = state.tokens.device
    positions = torch.arange(first, first + len(keep), device=device) % TOKEN_RING
    state.tokens[slot, positions] = ints_to_device(keep, device)


class PinnedStaging:
    """Reused host buffers for host → device copies that do not make the host wait.

    `upload` copies a host tensor into a staging buffer and queues the buffer's copy to the
    device; the buffer is handed out again only once the event recorded after that copy has
    completed (buffers of one size class are reused oldest first, and copies complete in
    stream order, so the oldest is the first to be free). When none is free a new one is
    allocated; at most `max_per_size` wait per size class (older ones are dropped: their
    copies keep them alive, `torch`'s pinned allocator frees them after).

    `allocate(numel)`: a staging buffer (pinned int64 on CUDA); `copy(staged, device)`: the
    queued copy; `record()`: an event with `query()` recorded after it. Thread-safe."""

    def __init__(
        self,
        allocate: Callable[[int], Tensor],
        copy: Callable[[Tensor, torch.device], Tensor],
        record: Callable[[], Any],
        max_per_size: int = 64,
    ) -> None:
        self._allocate = allocate
        self._copy = copy
        self._record = record
        self._max_per_size = max_per_size
        self._waiting: dict[int, deque[tuple[Tensor, Any]]] = {}
        self._lock = threading.Lock()

    def upload(self, host: Tensor, device: torch.device) -> Tensor:
        """`host` (an int64 host tensor, any shape) on `device`; valid in stream order like any
        queued copy."""
        numel = host.numel()
        size = 1 << max(6, (numel - 1).bit_length())  # size classes: powers of two, >= 64
        with self._lock:
            waiting = self._waiting.setdefault(size, deque())
            if waiting and waiting[0][1].query():
                buffer = waiting.popleft()[0]
            else:
                buffer = self._allocate(size)
            staged = buffer[:numel].view(host.shape)
            staged.copy_(host)
            out = self._copy(staged, device)
            waiting.append((buffer, self._record()))
            if len(waiting) > self._max_per_size:
                waiting.popleft()
        return out


def _cuda_staging() -> PinnedStaging:
    def record() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def allocate(numel: int) -> Tensor:
        # A normal tensor, not an inference one: uploads run inside and outside inference
        # mode, and an inference tensor takes no in-place copy outside it.
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=torch.long, pin_memory=True)

    return PinnedStaging(
        allocate,
        lambda staged, device: staged.to(device, non_blocking=True),
        record,
    )


# NOTE: a process-wide resource (like torch's own pinned allocator), not per-step state.
_CUDA_STAGING: PinnedStaging | None = None


def ints_to_device(
    values: list[int] | list[list[int]] | Tensor, device: torch.device | str
) -> Tensor:
    """An int64 tensor of host ints (or an int64 host tensor) on `device`; to a GPU through
    reused pinned buffers (`PinnedStaging`) without making the host wait for the GPU (a plain
    `torch.tensor(..., device=cuda)` does)."""
    global _CUDA_STAGING
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.long)
    device = torch.device(device)
    if device.type != "cuda":
        return host
    if torch.cuda.is_current_stream_capturing():
        # A captured copy reads its host buffer at every replay: never a reused one (nor an
        # event query while capturing).
        return host.pin_memory().to(device, non_blocking=True)
    if _CUDA_STAGING is None:
        _CUDA_STAGING = _cuda_staging()
    return _CUDA_STAGING.upload(host, device)


def sequential_batch(
    token_lists: list[list[int]],
    start_positions: list[int],
    slots: list[int],
    block_tables: Tensor,
    device: torch.device | str = "cpu",
    logits_indices: Tensor | None = None,
) -> StepBatch:
    """Convenience constructor from Python lists (logits_indices: the rows whose logits the
    step returns; None = every row)."""
    flat = [t for seq in token_lists for t in seq]
    starts = [0]
    for seq in token_lists:
        starts.append(starts[-1] + len(seq))
    return StepBatch(
        token_ids=ints_to_device(flat, device),
        starts=starts,
        start_positions=list(start_positions),
        slots=ints_to_device(list(slots), device),
        block_tables=block_tables.to(device),
        logits_indices=None if logits_indices is None else logits_indices.to(device),
    )


# ---------------------------------------------------------------------------- resume slots

_SLOT_ALIGN = 16  # every part of a slot payload starts at a multiple of this byte offset


def _slot_parts(state: ModelState, slot: int, tail_block: int | None) -> list[Tensor]:
    """The tensors a resume slot copies, in payload order: every per-sequence pool's row of
    `slot` (window rings, pending pairs, token history, draft rings), then the global KV and
    index keys of pool block `tail_block` (the sequence's partial last block), if any."""
    parts = [ring[slot] for ring in state.swa]
    parts += [state.pending[s][slot] for s in state.pending]
    parts.append(state.tokens[slot])
    parts += [ring[slot] for ring in state.draft_swa]
    if tail_block is not None:
        parts += [state.global_kv[s][tail_block] for s in state.global_kv]
        parts += [state.index_keys[s][tail_block] for s in state.index_keys]
    return parts


def _part_offsets(parts: list[Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for part in parts:
        offsets.append(end)
        end += -(-(part.numel() * part.element_size()) // _SLOT_ALIGN) * _SLOT_ALIGN
    return offsets, end


def slot_payload_len(state: ModelState, with_tail: bool = True) -> int:
    """Bytes of one resume-slot payload (see `export_slot`), with or without a tail block."""
    return _part_offsets(_slot_parts(state, 0, 0 if with_tail else None))[1]


def export_slot(state: ModelState, slot: int, tail_block: int | None) -> Tensor:
    """A sequence's private state as one flat uint8 host tensor (`cache.md` §3.2): the rows of
    `slot` in every per-sequence pool and pool block `tail_block`'s global KV and index keys.

    On CUDA the tensor is pinned and filled by one non-blocking copy queued on the current
    stream (after every step already queued): read it only after a `torch.cuda.Event`
    recorded next. Rows keep the pools' storage formats, so `import_slot` is a plain copy.
    """
    parts = _slot_parts(state, slot, tail_block)
    offsets, total = _part_offsets(parts)
    device = state.tokens.device
    # One gather on the device and one copy to the host (not a copy per part): the alignment
    # gaps are slices of one zero block.
    zeros = torch.zeros(_SLOT_ALIGN, dtype=torch.uint8, device=device)
    pieces, end = [], 0
    for part, offset in zip(parts, offsets, strict=True):
        if offset > end:
            pieces.append(zeros[: offset - end])
        flat = part.contiguous().view(torch.uint8).reshape(-1)
        pieces.append(flat)
        end = offset + flat.numel()
    if total > end:
        pieces.append(zeros[: total - end])
    on_cuda = device.type == "cuda"
    out = torch.empty(total, dtype=torch.uint8, pin_memory=on_cuda)
    out.copy_(torch.cat(pieces), non_blocking=on_cuda)
    return out


def import_slot(state: ModelState, slot: int, tail_block: int | None, payload: Tensor) -> None:
    """Write a payload from `export_slot` into `slot` and pool block `tail_block` (which must
    be None exactly when the payload has no tail block). Raises ValueError for a payload of
    the wrong length."""
    parts = _slot_parts(state, slot, tail_block)
    offsets, total = _part_offsets(parts)
    if payload.numel() != total or payload.dtype != torch.uint8:
        raise ValueError(f"slot payload of {payload.numel()} bytes, expected {total}")
    non_blocking = payload.is_pinned()
    for part, offset in zip(parts, offsets, strict=True):
        size = part.numel() * part.element_size()
        rows = payload[offset : offset + size].view(part.dtype).view(part.shape)
        part.copy_(rows.to(part.device, non_blocking=non_blocking), non_blocking=non_blocking)
