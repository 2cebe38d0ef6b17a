"""A routing laid out in expert-pure blocks (`ExpertBlocks`, defined here) in one launch.

For the (token, slot) pairs p of `expert_ids` [T, top_k] flattened (key(p) = the expert, or
"skipped" for an id < 0), with counts c_e and each expert's run padded to a multiple of block_m:

    first_e        = Σ_{e' < e} ceil(c_e' / block_m) · block_m       (the run's first position)
    pair_of_pos[q] = p   at q = first_e + #{p' < p : key(p') = e}   (e = key(p), p not skipped)
                     -1  at every other position (run padding, unused blocks)
    block_expert[b] = the e whose run holds position b · block_m, -1 past the last run

with num_blocks = T·top_k // block_m + min(E, T·top_k), so nothing is read back to the host.

How: one launch of P = max(ceil(T·top_k / CHUNK), ceil(num_blocks / BLOCK_CHUNK)) programs with
no order among them. Every program reads all the keys, KEY_TILE at a time (the tiles' loads are
independent), and counts them per expert (`tl.histogram`): all pairs give c_e (so first_e is a
cumsum in registers); the tiles left of its own chunk also give b_e, the counts of the pairs
before the chunk (the one tile that holds the chunk's start is counted again, masked). Then
program i

    ranks chunk i:   position(p) = first_e + b_e + #{p' in chunk i, p' < p : key(p') = e}
                     (`tl.gather` of first + b by key, plus a [CHUNK, CHUNK] comparison);
    writes blocks i·BLOCK_CHUNK ... (i + 1)·BLOCK_CHUNK - 1: the expert of a block is the
                     number of runs that end at or before its first position (a
                     [BLOCK_CHUNK, E_PAD] comparison); its positions past the run's count get -1.

    pairs:      | chunk 0 | chunk 1 | ... | chunk i | ... | chunk P-1 |   (program i reads all)
                |<--- counted in b_e ---->|< ranks >|   (in program i)
    positions:  | run of e0 (c_0 pairs, padding) | run of e1 | ... | unused blocks (-1) |
                ^ first_0 = 0                   ^ first_1
    blocks:     | BLOCK_CHUNK of program 0 | of program 1 | ... |   (block_expert, the -1s)

A pair's position, a block's expert and the padding's -1s are disjoint addresses, each written
by one program, so no program waits for another.

`align_to_experts_reference` is the torch code (a scatter-add count, a cumsum, ranks by a prefix
count over a one-hot table or by a stable sort), the path for larger routings and the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable


@dataclass(frozen=True)
class ExpertBlocks:
    """A routing laid out in expert-pure blocks (`grouped_mxfp4_gemm.align_to_experts`; the
    layout is drawn in `grouped_mxfp4_gemm`'s docstring).

    pair_of_pos: int32 [num_blocks · block_m], the flat (token · top_k + slot) index at each
        position, -1 for padding.
    block_expert: int32 [num_blocks], the expert of each block, -1 for unused blocks.
    """

    pair_of_pos: Tensor
    block_expert: Tensor
    block_m: int
    top_k: int
    num_tokens: int

    @property
    def num_positions(self) -> int:
        return self.pair_of_pos.numel()

    @property
    def num_pairs(self) -> int:
        """T · top_k: the rows of the down GEMM's output."""
        return self.num_tokens * self.top_k


__all__ = [
    "MAX_PAIRS",
    "ExpertBlocks",
    "align_to_experts",
    "align_to_experts_reference",
    "num_blocks_for",
]

# Routings up to this many (token, slot) pairs take the kernel: decode steps and prefill chunks
# up to 4,096 tokens at top-8 (24,576 pairs at top-6); the torch reference sorts larger ones.
# NOTE: every program reads all the keys from L2: programs · pairs · 8 bytes (int64 ids), at
# 1,536 decode pairs 24 · 12 KiB = 288 KiB, at 24,576 pairs 192 · 192 KiB = 36 MiB, at 32,768
# pairs 256 · 256 KiB = 64 MiB; the whole kernel took 25.9 and 30.6 µs at the last two (H100).
MAX_PAIRS = 32768
# Elements of the [BLOCK_CHUNK, E_PAD] and [BLOCK_CHUNK, block_m] block tiles (registers of 4
# warps).
_TILE = 8192


def _program_shape(block_m: int) -> tuple[int, int]:
    """(CHUNK, KEY_TILE): pairs ranked per program (a [CHUNK, CHUNK] comparison) and keys
    counted per step of the key loop. Decode blocks (block_m <= 32: few pairs) want the short
    rank; prefill blocks (many pairs, which every program reads) want fewer programs and longer
    tiles. A function of block_m, already a constexpr, so no step size compiles a variant.

    H100, graph replays: 1,536 pairs at block 32 5.9 µs (the one-program kernel: 38.7; 64 /
    4,096: 6.8); 24,576 pairs at block 128 25.9 µs (64 / 2,048: 36.6; 128 / 2,048: 28.4).
    """
    return (64, 2048) if block_m <= 32 else (128, 4096)


def num_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The block bound T·top_k // block_m + min(E, T·top_k): every run's padding fits."""
    return num_pairs // block_m + min(num_experts, num_pairs)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # step-varying: one variant
def _align_kernel(
    ids_ptr,
    pair_of_pos_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    KEY_TILE: tl.constexpr,
):
    program = tl.program_id(0)
    chunk_start = program * CHUNK
    experts = tl.arange(0, E_PAD)
    tile = tl.arange(0, KEY_TILE)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)  # pairs left of this program's chunk
    for start in range(0, num_pairs, KEY_TILE):
        pairs = start + tile
        key = _keys(ids_ptr, pairs, num_pairs, num_experts)
        tile_counts = tl.histogram(key, E_PAD)
        counts += tile_counts
        if start + KEY_TILE <= chunk_start:  # the whole tile lies left of the chunk
            before += tile_counts
        elif start < chunk_start:  # the one tile that holds the chunk's start
            before += tl.histogram(tl.where(pairs < chunk_start, key, num_experts), E_PAD)
    padded = tl.where(experts < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    end = tl.cumsum(padded, axis=0)
    first = end - padded

    lanes = tl.arange(0, CHUNK)
    pairs = chunk_start + lanes
    key = _keys(ids_ptr, pairs, num_pairs, num_experts)
    earlier = lanes[None, :] < lanes[:, None]  # [i, j]: pair j comes before pair i
    within = tl.sum(((key[:, None] == key[None, :]) & earlier).to(tl.int32), axis=1)
    position = tl.gather(first + before, key, 0) + within
    tl.store(pair_of_pos_ptr + position, pairs, mask=key < num_experts)

    # NOTE: entries e >= E have padded 0, so end there is the last run's end; a block past it
    # counts them too and gets an expert >= E (-1), one inside counts only real runs.
    blocks = program * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
    is_block = blocks < num_blocks
    block_start = blocks * BLOCK_M
    expert = tl.sum((end[None, :] <= block_start[:, None]).to(tl.int32), axis=1)
    is_run = expert < num_experts
    tl.store(block_expert_ptr + blocks, tl.where(is_run, expert, -1), mask=is_block)
    hot = expert[:, None] == experts[None, :]
    run_first = tl.sum(tl.where(hot, first[None, :], 0), axis=1)
    run_count = tl.sum(tl.where(hot, counts[None, :], 0), axis=1)
    rows = tl.arange(0, BLOCK_M)
    rank = (block_start - run_first)[:, None] + rows[None, :]
    padding = ~is_run[:, None] | (rank >= run_count[:, None])
    tl.store(
        pair_of_pos_ptr + block_start[:, None] + rows[None, :],
        tl.full([BLOCK_CHUNK, BLOCK_M], -1, tl.int32),
        mask=padding & is_block[:, None],
    )


@triton.jit
def _keys(ids_ptr, pairs, num_pairs, num_experts):
    """Each pair's expert, or num_experts for a skipped pair (id < 0) and lanes past the end."""
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    return tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)


def align_to_experts(expert_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(pair_of_pos int32 [num_blocks · block_m], block_expert int32 [num_blocks]) of the
    routing `expert_ids` [T, top_k] (integer ids, < 0 skipped) in one launch (a grid sized by
    T·top_k alone, so a CUDA graph of fixed shapes replays it); the same tensors as
    `align_to_experts_reference`. No count comes back to the host.

    NOTE: an id >= num_experts is not a routing; here it is skipped like a negative one (the
    reference raises or misplaces it), since checking would read the ids back.

    Raises:
        ValueError: not [T, top_k] integers, more than MAX_PAIRS pairs, a block_m that is not
            a power of two, or not on CUDA (or Triton's interpreter).
    """
    if expert_ids.dim() != 2 or expert_ids.dtype.is_floating_point:
        raise ValueError(f"expert_ids must be integer [T, top_k], got {expert_ids.dtype}")
    num_pairs = expert_ids.numel()
    if num_pairs > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} pairs in one launch, got {num_pairs}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    check_runnable(expert_ids, "align_to_experts")
    num_blocks = num_blocks_for(num_pairs, num_experts, block_m)
    device = expert_ids.device
    pair_of_pos = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_blocks:
        e_pad = triton.next_power_of_2(num_experts + 1)
        block_chunk = max(1, min(64, _TILE // e_pad, _TILE // block_m))
        chunk, key_tile = _program_shape(block_m)
        num_programs = max(triton.cdiv(num_pairs, chunk), triton.cdiv(num_blocks, block_chunk))
        _align_kernel[(num_programs,)](
            expert_ids.contiguous(),
            pair_of_pos,
            block_expert,
            num_pairs,
            num_experts,
            num_blocks,
            BLOCK_M=block_m,
            E_PAD=e_pad,
            CHUNK=chunk,
            BLOCK_CHUNK=block_chunk,
            KEY_TILE=key_tile,
            num_warps=4,
        )
    return pair_of_pos, block_expert


# Routings of up to this many (token, slot) pairs rank pairs within their expert by a prefix
# count over a one-hot [pairs, E + 1] table (a few small kernels); larger ones sort (the radix
# sort was 1.1 ms of a 64-sequence decode step on the H200, 40 launches).
COUNTED_RANK_MAX_PAIRS = 4096


def align_to_experts_reference(
    expert_ids: Tensor, num_experts: int, block_m: int
) -> tuple[Tensor, Tensor]:
    """`align_to_experts` in torch (any device, any size and block_m); no host read either."""
    device = expert_ids.device
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    num_blocks = num_blocks_for(num_pairs, num_experts, block_m)
    num_positions = num_blocks * block_m
    key = torch.where(flat >= 0, flat, num_experts)  # skipped pairs sort last, as "expert E"
    # (not bincount: on CUDA it reads the largest id back to size its output)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, key, torch.ones_like(key)
    )
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    # skipped pairs land on one extra position past the end, dropped below
    first_position = torch.cat((padded_end - padded, padded_end.new_full((1,), num_positions)))
    if num_pairs <= COUNTED_RANK_MAX_PAIRS:
        pair, expert, rank = _ranks_counted(key, num_experts)
    else:
        pair, expert, rank = _ranks_sorted(key, counts)
    positions = first_position[expert] + torch.where(expert < num_experts, rank, 0)
    pair_of_pos = torch.full((num_positions + 1,), -1, dtype=torch.int32, device=device)
    pair_of_pos[positions] = pair.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return pair_of_pos[:num_positions], block_expert


def _ranks_counted(key: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pair index, its key, its rank among the earlier pairs of that key), pairs in order."""
    hot = key[:, None] == torch.arange(num_experts + 1, device=key.device)
    earlier = torch.cumsum(hot, 0, dtype=torch.int32) - hot.to(torch.int32)
    rank = earlier.gather(1, key[:, None]).squeeze(1).long()
    return torch.arange(key.numel(), device=key.device), key, rank


def _ranks_sorted(key: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`_ranks_counted` by a stable sort: the same triples, pairs in key order."""
    order = torch.argsort(key, stable=True)
    sorted_keys = key[order]
    start = torch.cumsum(counts, 0) - counts
    return order, sorted_keys, torch.arange(key.numel(), device=key.device) - start[sorted_keys]
