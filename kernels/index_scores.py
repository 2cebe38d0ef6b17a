"""The lightning indexer's scores (`model.md` §3.6) read from the paged FP4 index-key pool.

For query token t of sequence b and compressed position j:

    score[b, t, j] = Σ_h hw[t, h] · relu(iq[t, h, :] · key[b, j, :])     (fp32)
                   = −inf where j ≥ (position[t] + 1) // ratio, and on padding rows

Keys are `index_fp4` rows (`kv_formats.index_fp4_quantize`: D/2 bytes of e2m1 pairs, the even
element in the low nibble, then a ue8m0 scale per 32) in the pool [blocks, 128 / ratio, 17·D/32],
position j of sequence b in block table[b, j · ratio // 128], row j % (128 / ratio). The torch
path gathers the rows, decodes them to fp32 [B, J, D] and runs a bf16 bmm plus an fp32 head sum;
here a row is decoded in registers and used once per tile.

Precision: a decoded key (an e2m1 code times a power of two) and a query that went through the
FP4 round trip are exact in bf16, so the dots run on bf16 tensor cores with fp32 accumulation:
every product is exact and only the fp32 summation order differs from the torch path (over D
inside a dot, over heads in the weighted sum). In the interpreter the operands stay fp32
(`_DOT_DTYPE`), the same values.

    grid (B, T_max / BLOCK_T, J / BLOCK_J); per program the queries of BLOCK_T tokens × all
    heads [BLOCK_T · BLOCK_H, D] against BLOCK_J decoded keys [BLOCK_J, D]: one dot, relu,
    the head-weighted sum, the visibility mask. A tile past every visible position of its
    tokens loads nothing and stores −inf.

`index_scores` is the launcher; `index_scores_reference` the torch reference (float64 sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting
from kernels.element_codes import e2m1_pairs_to_float, ue8m0_to_float
from kernels.row_codes import e2m1_value, ue8m0_value

__all__ = [
    "TILES",
    "IndexTiles",
    "block_t_for",
    "choose_tiles",
    "index_scores",
    "index_scores_reference",
]

_BLOCK_TOKENS = 128  # positions per block-table entry (`state.BLOCK_TOKENS`)
_INTERPRETING = interpreting()
# The interpreter's bf16 dot is not trustworthy: there the operands stay fp32 (exact values).
_DOT_DTYPE = tl.float32 if _INTERPRETING else tl.bfloat16
# Rows of one dot: BLOCK_T tokens × BLOCK_H heads (decode: one token, all heads).
_MAX_DOT_ROWS = 128


@dataclass(frozen=True)
class IndexTiles:
    """One launch shape of `_index_scores_kernel`: j_tiles tiles of block_j compressed
    positions per program, the queries and head weights loaded once for all of them (a decode
    step's program otherwise reloads its token's 64 × 128 fp32 queries for every 64 keys)."""

    block_j: int
    num_warps: int
    num_stages: int = 1
    j_tiles: int = 1

    def __str__(self) -> str:
        tiles = f" x{self.j_tiles}" if self.j_tiles > 1 else ""
        return f"j{self.block_j} w{self.num_warps} s{self.num_stages}{tiles}"


# THE CHOICE (a pure function of the launch's shapes, so nothing is tuned or compiled while
# serving): the first entry whose bound is at least the launch's new tokens per sequence. H200
# (`benchmarks/kernel_speed.py --only index_scores`): decode, 2026-12-02, 16 / 64 / 256
# sequences 46.8 / 66.9 / 249.5 µs against 70.3 / 75.7 / 299.9 for j64 w4 (2026-12-03: four or
# more key tiles per program 24–78 / 79–81 / 293–310 µs against 21 / 66 / 245); a 1,024-token
# prefill, 2026-12-03, four key tiles per program 587 µs against 772 for one (j128 w8 642).
TILES: tuple[tuple[int, IndexTiles], ...] = (
    (64, IndexTiles(64, 8)),
    (1 << 62, IndexTiles(64, 8, j_tiles=4)),
)
CANDIDATES: tuple[IndexTiles, ...] = (
    IndexTiles(64, 4),
    IndexTiles(64, 8),
    IndexTiles(128, 8),
    IndexTiles(64, 8, j_tiles=4),
    IndexTiles(64, 8, j_tiles=8),
    IndexTiles(64, 8, j_tiles=16),
    IndexTiles(64, 8, num_stages=2, j_tiles=8),
    IndexTiles(64, 4, j_tiles=8),
    IndexTiles(128, 8, j_tiles=4),
)
if _INTERPRETING:
    TILES = ((1 << 62, IndexTiles(16, 4)),)


def choose_tiles(tokens_per_seq: int) -> IndexTiles:
    """The `TILES` entry for a launch of `tokens_per_seq` new tokens per sequence."""
    return next(tiles for bound, tiles in TILES if tokens_per_seq <= bound)


@triton.jit
def _index_rows(pool_ptr, row_index, valid, D: tl.constexpr, BLOCK_J: tl.constexpr):
    """`index_fp4` rows as float32 [BLOCK_J, D] (exact; NaN where the scale byte is 255)."""
    c = tl.arange(0, D // 2)
    packed = tl.load(pool_ptr + row_index[:, None] + c[None, :], mask=valid[:, None], other=0)
    packed = packed.to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_J, D // 32, 32))
    b = tl.arange(0, D // 32)
    scale = tl.load(
        pool_ptr + row_index[:, None] + D // 2 + b[None, :], mask=valid[:, None], other=127
    )
    values = e2m1_value(codes) * ue8m0_value(scale.to(tl.int32))[:, :, None]
    return tl.reshape(values, (BLOCK_J, D))


@triton.jit
def _tile_rows(table_ptr, seq, stride_table, j0, tile_visible, stride_pool_block,
               stride_pool_row, RATIO: tl.constexpr, BLOCK_J: tl.constexpr):  # fmt: skip
    """(pool byte offset, is a stored row) of positions j0 .. j0 + BLOCK_J of sequence `seq`
    (j0 a multiple of BLOCK_J): one block-table entry per pool block the tile spans, loaded
    once and broadcast to its rows (a load per row repeats the same entry 128 / RATIO times,
    with its 64-bit address arithmetic). Positions ≥ tile_visible are not rows."""
    rows_per_block: tl.constexpr = 128 // RATIO  # _BLOCK_TOKENS (a jit sees no globals)
    tile_blocks: tl.constexpr = (BLOCK_J + rows_per_block - 1) // rows_per_block
    rows_each: tl.constexpr = BLOCK_J // tile_blocks
    first = j0 + tl.arange(0, tile_blocks) * rows_each
    block = tl.load(
        table_ptr + seq * stride_table + (first * RATIO) // 128,
        mask=first < tile_visible,
        other=-1,
    )
    j = first[:, None] + tl.arange(0, rows_each)[None, :]
    base = tl.where(block >= 0, block, 0) * stride_pool_block
    row_index = base[:, None] + (j % rows_per_block) * stride_pool_row
    is_row = (j < tile_visible) & (block >= 0)[:, None]
    return tl.reshape(row_index, (BLOCK_J,)), tl.reshape(is_row, (BLOCK_J,))


# Integers that change from step to step are not specialised (a value of 1, divisibility by
# 16), so one compiled variant per layer shape serves every step (`warm_up.py`).
@triton.jit(
    do_not_specialize=[
        "max_len", "num_j", "stride_table", "stride_pad", "stride_ob", "stride_ot"
    ]
)  # fmt: skip
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    table_ptr,
    pad_ptr,
    position_ptr,
    out_ptr,
    num_heads,
    max_len,
    num_j,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_pool_block,
    stride_pool_row,
    stride_table,
    stride_pad,
    stride_ob,
    stride_ot,
    RATIO: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    J_TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    j_start = tl.program_id(2) * (J_TILES * BLOCK_J)
    token = tl.load(pad_ptr + seq * stride_pad + t, mask=t < max_len, other=-1)
    is_token = token >= 0
    position = tl.load(position_ptr + token, mask=is_token, other=-1)
    num_visible = (position + 1) // RATIO  # padding: position −1 sees nothing
    tile_visible = tl.max(num_visible, axis=0)
    out_ptrs = out_ptr + seq * stride_ob + t.to(tl.int64)[:, None] * stride_ot
    is_out_row = (t < max_len)[:, None]
    if j_start < tile_visible:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        is_head = h < num_heads
        q_ptrs = (
            q_ptr
            + token[:, None, None] * stride_qt
            + h[None, :, None] * stride_qh
            + d[None, None, :]
        )
        q_mask = is_token[:, None, None] & is_head[None, :, None]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
        q = tl.reshape(q, (BLOCK_T * BLOCK_H, D)).to(DOT_DTYPE)
        w_mask = is_token[:, None] & is_head[None, :]
        w = tl.load(w_ptr + token[:, None] * stride_wt + h[None, :], mask=w_mask, other=0.0)
        w = tl.reshape(w, (BLOCK_T * BLOCK_H,))
        # Tiles past the visible positions (the program's last ones) load no key and score −inf.
        for tile in tl.range(J_TILES, num_stages=NUM_STAGES):
            j0 = j_start + tile * BLOCK_J
            j = j0 + tl.arange(0, BLOCK_J)
            row_index, is_row = _tile_rows(
                table_ptr, seq, stride_table, j0, tile_visible, stride_pool_block,
                stride_pool_row, RATIO, BLOCK_J,
            )  # fmt: skip
            keys = _index_rows(pool_ptr, row_index, is_row, D, BLOCK_J)
            dots = tl.dot(q, tl.trans(keys).to(DOT_DTYPE), out_dtype=tl.float32)
            weighted = tl.maximum(dots, 0.0) * w[:, None]
            total = tl.sum(tl.reshape(weighted, (BLOCK_T, BLOCK_H, BLOCK_J)), axis=1)
            visible = (j[None, :] < num_visible[:, None]) & is_row[None, :]
            scores = tl.where(visible, total, float("-inf"))
            tl.store(out_ptrs + j[None, :], scores, mask=is_out_row & (j < num_j)[None, :])
    else:
        hidden = tl.full((BLOCK_T, BLOCK_J), float("-inf"), tl.float32)
        for tile in range(J_TILES):
            j = j_start + tile * BLOCK_J + tl.arange(0, BLOCK_J)
            tl.store(out_ptrs + j[None, :], hidden, mask=is_out_row & (j < num_j)[None, :])


def _check(iq: Tensor, hw: Tensor, pool: Tensor, ratio: int) -> None:
    num_tokens, num_heads, dim = iq.shape
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"the index head dim must be a power of two >= 32, got {dim}")
    if ratio < 1 or _BLOCK_TOKENS % ratio:
        raise ValueError(f"ratio must divide {_BLOCK_TOKENS}, got {ratio}")
    if iq.dtype not in (torch.float32, torch.bfloat16) or iq.stride(-1) != 1:
        raise ValueError("iq must be fp32 or bf16 [T, H, D] with unit column stride")
    if hw.dtype != torch.float32 or hw.shape != (num_tokens, num_heads) or hw.stride(-1) != 1:
        raise ValueError(f"hw must be fp32 [{num_tokens}, {num_heads}] with unit column stride")
    width = dim // 2 + dim // 32
    if pool.dtype != torch.uint8 or pool.shape[-2:] != (_BLOCK_TOKENS // ratio, width):
        raise ValueError(f"pool must be uint8 [blocks, {_BLOCK_TOKENS // ratio}, {width}]")
    if pool.stride(-1) != 1:
        raise ValueError("pool rows need unit byte stride")
    if num_heads > _MAX_DOT_ROWS:
        raise ValueError(f"at most {_MAX_DOT_ROWS} heads, got {num_heads}")


def block_t_for(num_heads: int, max_len: int) -> int:
    """BLOCK_T (a constexpr: one compiled variant each) for steps of up to `max_len` new
    tokens per sequence: the next power of two of max_len, at most 128 dot rows with the
    heads; tl.dot needs 16 rows, so few heads take several tokens even in decode."""
    block_h = triton.next_power_of_2(num_heads)
    block_t = min(triton.next_power_of_2(max_len), max(1, _MAX_DOT_ROWS // block_h))
    return max(block_t, -(-16 // block_h))


def index_scores(
    iq: Tensor,
    hw: Tensor,
    pool: Tensor,
    block_tables: Tensor,
    ratio: int,
    pad_index: Tensor,
    positions: Tensor,
    num_j: int,
    *,
    tiles: IndexTiles | None = None,
) -> Tensor:
    """fp32 [B, T_max, num_j] indexer scores, −inf where position j is not visible.

    iq: [T, H, D] fp32 or bf16 queries whose values are exact in bf16 (the FP4 round trip).
    hw: fp32 [T, H] head weights (scale included). pool: uint8 [blocks, 128 / ratio, 17·D/32]
    `index_fp4` rows. block_tables: int64 [B, max_blocks] (−1 = unallocated: such positions
    score −inf), covering positions below num_j · ratio.
    pad_index: int64 [B, T_max] flat token index of row t of sequence b, −1 for padding
    (`StepBatch.pad_index`). positions: int64 [T]. Token t sees j < (positions[t] + 1) // ratio;
    padding rows see nothing. tiles: a launch shape of its own (benchmarks); default
    `choose_tiles(T_max)`.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take (D not a power of two
            ≥ 32, more than 128 heads, non-unit column strides), or not on CUDA (or the
            interpreter).
    """
    _check(iq, hw, pool, ratio)
    check_runnable(iq, "index_scores")
    num_seqs, max_len = pad_index.shape
    out = torch.empty(num_seqs, max_len, num_j, dtype=torch.float32, device=iq.device)
    if not out.numel():
        return out
    num_heads, dim = iq.shape[1:]
    block_h = triton.next_power_of_2(num_heads)
    block_t = block_t_for(num_heads, max_len)
    tiles = tiles or choose_tiles(max_len)
    per_program = tiles.block_j * tiles.j_tiles
    grid = (num_seqs, triton.cdiv(max_len, block_t), triton.cdiv(num_j, per_program))
    _index_scores_kernel[grid](
        iq,
        hw,
        pool,
        block_tables,
        pad_index,
        positions,
        out,
        num_heads,
        max_len,
        num_j,
        iq.stride(0),
        iq.stride(1),
        hw.stride(0),
        pool.stride(0),
        pool.stride(1),
        block_tables.stride(0),
        pad_index.stride(0),
        out.stride(0),
        out.stride(1),
        RATIO=ratio,
        D=dim,
        BLOCK_H=block_h,
        BLOCK_T=block_t,
        DOT_DTYPE=_DOT_DTYPE,
        BLOCK_J=tiles.block_j,
        J_TILES=tiles.j_tiles,
        NUM_STAGES=tiles.num_stages,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def index_scores_reference(
    iq: Tensor,
    hw: Tensor,
    pool: Tensor,
    block_tables: Tensor,
    ratio: int,
    pad_index: Tensor,
    positions: Tensor,
    num_j: int,
) -> Tensor:
    """`index_scores` in plain torch: gather and decode the rows, sum in float64, round once."""
    num_seqs, max_len = pad_index.shape
    j = torch.arange(num_j, device=pool.device)
    block = block_tables[:, (j * ratio) // _BLOCK_TOKENS]  # [B, J]
    stored = pool[block.clamp(min=0), (j % (_BLOCK_TOKENS // ratio))[None, :]]
    dim = iq.shape[-1]
    values = e2m1_pairs_to_float(stored[..., : dim // 2]).unflatten(-1, (-1, 32))
    keys = (values * ue8m0_to_float(stored[..., dim // 2 :]).unsqueeze(-1)).flatten(-2)
    token = pad_index.clamp(min=0)
    q = iq[token].double()  # [B, T_max, H, D]
    dots = torch.einsum("bthd,bjd->bthj", q, keys.double()).relu()
    scores = torch.einsum("bthj,bth->btj", dots, hw[token].double()).float()
    position = torch.where(pad_index >= 0, positions[token], -1)
    num_visible = torch.div(position + 1, ratio, rounding_mode="floor")
    hidden = (j[None, None, :] >= num_visible[..., None]) | (block < 0)[:, None, :]
    return scores.masked_fill(hidden, float("-inf"))
