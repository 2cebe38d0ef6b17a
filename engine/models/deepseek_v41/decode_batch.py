"""A decode step padded to fixed shapes, whose forward a single CUDA graph can hold.

Today's `StepBatch` derives row subsets (which tokens close a compressor pair) and the indexer's
key count (the batch's longest context) from host ints, so its operations change shape from
step to step. `PaddedDecodeBatch` is a decode step (every row one new token) padded to
`num_rows` rows and `blocks_cap` block-table columns, described by device tensors only:

    row       0 .. n−1: the real sequences      n .. num_rows−1: padding rows
    slot      its state slot                    `ModelState.scratch_slot`
    position  its new token's position          0
    table     its blocks, then −1               `ModelState.trash_block` in every column

Every layer then runs fixed shapes with no host read: ratio-2 compressors pool every row and
write global KV / index keys of rows that emit nothing into the trash block; the indexer scores
`key_capacity(ratio)` = blocks_cap · 128 / ratio positions (the hidden ones at −inf, as today)
and keeps min(index_topk, that capacity) of them (−1 past the visible ones, as today).

NOTE: padding rows read and write only the scratch slot and the trash block, which no request
owns (`DeepseekV41ForCausalLM.allocate_state(reserve_scratch=True)`), so they never change a
real request's state; their outputs are garbage that callers drop.
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch import Tensor

from engine.models.deepseek_v41.state import BLOCK_TOKENS, ModelState, StepBatch


class PaddedDecodeBatch(StepBatch):
    """One decode step over `num_rows` rows (see the module docstring), all device tensors.

    token_ids, positions, slots: int64 [num_rows]; block_tables: int64 [num_rows, blocks_cap].
    The tensors are used in place (a step graph's static buffers): fill them, then run.
    """

    def __init__(
        self,
        token_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        block_tables: Tensor,
        trash_block: int,
    ) -> None:
        num_rows = token_ids.shape[0]
        if not (positions.shape == slots.shape == (num_rows,)) or block_tables.shape[0] != num_rows:
            raise ValueError("token_ids, positions, slots and block_tables need one row each")
        device = token_ids.device
        rows = torch.arange(num_rows, device=device)
        self.token_ids = token_ids
        self.starts = list(range(num_rows + 1))
        self.start_positions = []  # host positions are unknown: see `end_positions`
        self.slots = slots
        self.block_tables = block_tables
        self.logits_indices = None
        self.window_floors = self.reuse_ends = self.decoder_floors = None
        self.positions = positions
        self.seq_of_token = rows
        self.pad_index = rows[:, None]
        self.start_position_tensor = positions
        self.lengths = [1] * num_rows
        self.window_floor_tensor = self.reuse_end_tensor = None
        self._unpad_index = rows
        self._token_indices = {}
        self._uniform = True
        self._shared = {}
        self.trash_block = trash_block

    @property
    def blocks_cap(self) -> int:
        return self.block_tables.shape[1]

    def key_capacity(self, ratio: int) -> int:
        """Compressed positions a ratio-`ratio` source can hold in `blocks_cap` blocks."""
        return self.blocks_cap * BLOCK_TOKENS // ratio

    def end_positions(self) -> NoReturn:
        raise RuntimeError("a padded decode batch has no host positions (use key_capacity)")

    def token_indices(self, tail: int | None = None, parity: int | None = None) -> NoReturn:
        raise RuntimeError("a padded decode batch has no host row subsets")

    def decoder_part(self) -> NoReturn:
        raise RuntimeError("a padded decode batch has no decoder floors")


def is_padded_decode(batch: StepBatch) -> bool:
    return isinstance(batch, PaddedDecodeBatch)


def can_pad(batch: StepBatch) -> bool:
    """`batch` is a plain decode step a `PaddedDecodeBatch` reproduces: one new token per
    sequence, no prefix-cache replay or decoder floors, logits for every row in order.

    NOTE: `logits_indices` is only checked for its length (its values are on the device): a
    decode step's full-length logit rows are its rows in order (`ModelRunner.build_batch`
    lists each sampled chunk's last row, ascending)."""
    if batch.max_len != 1 or is_padded_decode(batch):
        return False
    if (batch.window_floors, batch.reuse_ends, batch.decoder_floors) != (None, None, None):
        return False
    indices = batch.logits_indices
    return indices is None or indices.numel() == batch.num_seqs


class DecodeBuffers:
    """Static metadata buffers of one (num_rows, blocks_cap) step shape.

    `fill` copies a decode `StepBatch`'s device tensors into rows 0..n−1 and the padding
    template into the rest: device-to-device copies only, no host wait.
    """

    def __init__(self, num_rows: int, blocks_cap: int, state: ModelState, device) -> None:
        if state.scratch_slot is None or state.trash_block is None:
            raise ValueError("padded decode steps need a state with a scratch slot")
        long = {"dtype": torch.long, "device": device}
        self.num_rows = num_rows
        self.token_ids = torch.zeros(num_rows, **long)
        self.positions = torch.zeros(num_rows, **long)
        self.slots = torch.full((num_rows,), state.scratch_slot, **long)
        self.block_tables = torch.full((num_rows, blocks_cap), state.trash_block, **long)
        self._pad_slots = self.slots.clone()
        self._pad_tables = self.block_tables.clone()
        self.trash_block = state.trash_block

    def batch(self) -> PaddedDecodeBatch:
        """A batch over the buffers. NOTE: a batch caches index tensors derived from the
        buffers (`StepBatch.shared`), so an eager forward needs a new one after each `fill`;
        a captured graph recomputes them at every replay."""
        return PaddedDecodeBatch(
            self.token_ids, self.positions, self.slots, self.block_tables, self.trash_block
        )

    def fill(self, batch: StepBatch) -> None:
        """Rows 0..n−1 from `batch` (`can_pad` must hold; n ≤ num_rows, table width ≤
        blocks_cap), the rest padding."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        self.token_ids[:n].copy_(batch.token_ids)
        self.token_ids[n:].zero_()
        self.positions[:n].copy_(batch.positions)
        self.positions[n:].zero_()
        self.slots[:n].copy_(batch.slots)
        self.slots[n:].copy_(self._pad_slots[n:])
        self.block_tables[:n, :width].copy_(batch.block_tables)
        self.block_tables[:n, width:].fill_(-1)
        self.block_tables[n:].copy_(self._pad_tables[n:])
