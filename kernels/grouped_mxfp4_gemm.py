"""Grouped GEMM over MXFP4 experts: each row block multiplies by its expert's weight, dequantised
in registers (the weights are read from HBM once, as 4.25 bits per value).

Layouts (the checkpoint's, `model.md` §5.3, stacked over experts):

    codes   int8  [E, N_w, K/2]   byte c of a row: code of column 2c (low nibble) | 2c+1 (high)
    scales  uint8 / float8_e8m0fnu [E, N_w, K/32]   value = e2m1(code) * 2^(scale - 127)

Rows reach their expert through `ExpertBlocks` (`align_to_experts`): the (token, slot) pairs of
a routing sorted by expert, each expert's run padded to a multiple of `block_m`, so every block of
`block_m` positions belongs to one expert. Nothing is read back to the host.

    position p:  0 ......... block_m ........ 2·block_m ......
    expert:      [ e0 e0 e0 -1 | e1 e1 e1 e1 | e1 -1 -1 -1 | (unused: block_expert = -1) ]
    pair_of_pos: [ 7  2  9  -1 | 0  4  ...              ]     (-1 = padding)

Two uses (the routed half of `MoE.forward`):

    gate/up   out[p]    = swiglu_L(x[pair // top_k] · W1ᵀ, x[pair // top_k] · W3ᵀ) (· w[pair])
              (W13 = [W1; W3] stacked along N_w = 2N; `gate_limit` = L)
    down      out[pair] = act[p] · W2ᵀ (· w[pair])

and two kernels, picked by the block size:

    decode   (block_m <= 32)  `_decode_kernel`: outᵀ = W · xᵀ, the weight tile the wgmma's A
             operand (64 or 128 rows), unpacked from registers by inline PTX in a permuted K
             order (`_weight_tile`); the block's rows are the wgmma's N (16 or 32). Bound by
             streaming the expert weights.
    prefill  (block_m > 32)   `_prefill_kernel`: out = x · Wᵀ, token rows the wgmma's M, the
             dequantised weight tile staged through shared memory. Bound by the tensor cores.

On Hopper (where Gluon runs, K a multiple of 128) `kernels.grouped_mxfp4_gluon` replaces the
decode kernel (`DECODE_KERNEL`) and, for blocks of 128 rows whose scales its unpack takes
exactly (`register_unpack`), the prefill kernel (`PREFILL_KERNEL`).

`grouped_mxfp4_gemm` is the launcher; `grouped_mxfp4_gemm_reference` the torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import (
    check_runnable,
    expert_alignment,
    grouped_mxfp4_gluon,
    grouped_mxfp4_ws,
    interpreting,
    runs_kernels,
)
from kernels.element_codes import mxfp4_to_float
from kernels.expert_alignment import MAX_PAIRS, ExpertBlocks
from kernels.mxfp4_unpack import UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3

MXFP4_BLOCK = 32
DECODE_MAX_BLOCK_M = 32  # blocks of up to this many rows take the decode kernel
DECODE_MAX_SCALE_CODE = 128  # the decode kernel's unpack is exact up to this e8m0 code (2^1)


def align_to_experts(expert_ids: Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Lay the routing `expert_ids` [T, top_k] out in expert-pure blocks of `block_m` positions.

    An id < 0 marks a pair that is not computed here (an EP rank's received rows: slots served
    by other ranks, padding rows): it gets no position, and its output row is never written.
    The block count is the bound T·top_k // block_m + min(E, T·top_k), so no count is read back
    to the host; blocks past the used ones get expert -1 and cost one load each.
    Where the kernels run, up to `expert_alignment.MAX_PAIRS` pairs are one launch
    (`kernels.expert_alignment`); larger routings and the CPU take its torch reference.
    """
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, top_k], got {tuple(expert_ids.shape)}")
    is_power_of_two = block_m > 0 and not block_m & (block_m - 1)
    if runs_kernels(expert_ids) and expert_ids.numel() <= MAX_PAIRS and is_power_of_two:
        pair_of_pos, block_expert = expert_alignment.align_to_experts(
            expert_ids, num_experts, block_m
        )
    else:
        pair_of_pos, block_expert = expert_alignment.align_to_experts_reference(
            expert_ids, num_experts, block_m
        )
    num_tokens, top_k = expert_ids.shape
    return ExpertBlocks(pair_of_pos, block_expert, block_m, top_k, num_tokens)


@triton.jit
def _as_bf16_pairs(packed):
    low = (packed & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.join(low, (packed >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, rows, k0, K, stride_cn, stride_sn,
                 BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """bf16 weights [BLOCK_N, 128] of `rows`, columns k0 .. k0 + 128 in the kernel's K order.

    K order: the tile's 16 words per row are read as [lane quad q (4), word w (4)]; logical
    column k = h | q << 1 | j << 3 | w << 5 takes value j + 4h of word 4q + w (`_x_columns`).
    With it the words' natural layout (each lane 16 contiguous bytes) is the wgmma A operand's,
    and lane quad q needs the one scale of its 32 columns.
    """
    offs_word = k0 // 8 + tl.arange(0, 16)
    word_ptrs = codes_ptr + rows[:, None] * (stride_cn // 4) + offs_word[None, :]
    if EVEN_K:  # the four scales of a row's step as one word (rows are 4-byte aligned)
        words = tl.load(word_ptrs)
        scale_words = (scales_ptr + rows * stride_sn + k0 // 32).to(tl.pointer_type(tl.uint32))
        scales = (tl.load(scale_words)[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF
    else:  # K is a multiple of 32: whole words and scale groups are in or out
        words = tl.load(word_ptrs, mask=(offs_word < K // 8)[None, :], other=0)
        offs_scale = k0 // 32 + tl.arange(0, 4)
        scale_ptrs = scales_ptr + rows[:, None] * stride_sn + offs_scale[None, :]
        scales = tl.load(scale_ptrs, mask=(offs_scale < K // 32)[None, :], other=0)
        scales = scales.to(tl.uint32)
    return _unpack(words, scales, BLOCK_N)


@triton.jit
def _unpack(words, scales, BLOCK_N: tl.constexpr):
    """bf16 [BLOCK_N, 128] of the words [BLOCK_N, 16] and scales [BLOCK_N, 4] of one step."""
    multiplier = (scales + 126) << 7  # bf16 2^(scale - 1)
    multiplier = tl.broadcast_to((multiplier | (multiplier << 16))[:, :, None], (BLOCK_N, 4, 4))
    words = tl.reshape(words, (BLOCK_N, 4, 4))
    args = [words, multiplier]
    out0 = tl.inline_asm_elementwise(UNPACK_0, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out1 = tl.inline_asm_elementwise(UNPACK_1, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out2 = tl.inline_asm_elementwise(UNPACK_2, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out3 = tl.inline_asm_elementwise(UNPACK_3, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    pairs = tl.join(
        tl.join(_as_bf16_pairs(out0), _as_bf16_pairs(out1)),
        tl.join(_as_bf16_pairs(out2), _as_bf16_pairs(out3)),
    )  # [BLOCK_N, q, w, h, j & 1, j >> 1]
    pairs = tl.permute(pairs, (0, 2, 5, 4, 1, 3))  # [BLOCK_N, w, j >> 1, j & 1, q, h]
    return tl.reshape(pairs, (BLOCK_N, 128))


@triton.jit
def _raw_tile(codes_ptr, scales_ptr, rows, k0, stride_cn, stride_sn, mask):
    """The step's words [rows, 16] and packed scales [rows] as loaded (EVEN_K only)."""
    word_ptrs = codes_ptr + rows[:, None] * (stride_cn // 4) + (k0 // 8 + tl.arange(0, 16))[None, :]
    scale_words = (scales_ptr + rows * stride_sn + k0 // 32).to(tl.pointer_type(tl.uint32))
    return tl.load(word_ptrs, mask=mask), tl.load(scale_words, mask=mask)


@triton.jit
def _operand_rows(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Regroup the ROWS rows of `t` [ROWS, WIDTH] (64 or 128, one warp per 16) so that the
    layout a program of ROWS / 16 warps loads them in (8 rows across lanes, then warps, then
    one register bit) is the wgmma A operand's (8 rows across lanes, the register bit, then
    warps): row p = l | w << 3 | r << (3 + log2 warps) moves to l | r << 3 | w << 4. Applied
    to the rows' indices it says where each result row goes."""
    t = tl.permute(tl.reshape(t, (2, ROWS // 16, 8, WIDTH)), (1, 0, 2, 3))
    return tl.reshape(t, (ROWS, WIDTH))


@triton.jit
def _unpack_raw(words, packed_scales, BLOCK_N: tl.constexpr):
    words = _operand_rows(words, BLOCK_N, 16)
    packed_scales = _operand_rows(tl.reshape(packed_scales, (BLOCK_N, 1)), BLOCK_N, 1)
    packed_scales = tl.reshape(packed_scales, (BLOCK_N,))
    scales = (packed_scales[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 0xFF
    return _unpack(words, scales, BLOCK_N)


@triton.jit
def _x_columns():
    """Physical column (within a 128-column step) of each logical K of `_weight_tile`."""
    k = tl.arange(0, 128)
    word = 4 * ((k >> 1) & 3) + (k >> 5)
    return 8 * word + ((k >> 3) & 3) + 4 * (k & 1)


@triton.jit
def _kernel_order(n):
    """Where natural column n goes when a row is written in the kernel's K order (the inverse
    of `_x_columns` within each 128): a gate/up output the down GEMM then reads as it is."""
    c = n & 127
    word = c >> 3
    within = c & 7
    return (n - c) + ((within >> 2) | ((word >> 2) << 1) | ((within & 3) << 3) | ((word & 3) << 5))


def _in_kernel_order(x: Tensor) -> Tensor:
    """A copy of x [rows, K] (K a multiple of 128) with each 128 columns in the kernel's K
    order (`_kernel_columns`), so a step's 128 columns of a row are one contiguous run."""
    k = x.shape[1]
    return x.view(x.shape[0], k // 128, 128)[:, :, _kernel_columns(x.device)].view(-1, k)


@triton.jit
def _rows_at_positions_kernel(
    x_ptr, pair_of_pos_ptr, out_ptr, K, stride_x, stride_out, TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr, KERNEL_ORDER: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(0)
    pair = tl.load(pair_of_pos_ptr + pos)
    token = tl.where(pair >= 0, pair // TOP_K, 0).to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        n = k0 + tl.arange(0, BLOCK_K)
        values = tl.load(x_ptr + token * stride_x + n, mask=n < K)
        column = _kernel_order(n) if KERNEL_ORDER else n
        tl.store(out_ptr + pos.to(tl.int64) * stride_out + column, values, mask=n < K)


def rows_at_positions(x: Tensor, blocks: ExpertBlocks, kernel_order: bool = True) -> Tensor:
    """x's token rows at the blocks' positions ([num_positions, K]; padding positions take row
    0, whose products are never stored), each 128 columns in the kernel's K order unless x is
    in it already (`kernel_order` False): the gate/up's x as 2-D tiles for the warp-specialized
    kernel's TMA copies (`grouped_mxfp4_ws`), in one launch. The torch reference is
    `_in_kernel_order(x)[token]` (`rows_at_positions_reference`)."""
    k = x.shape[1]
    if x.stride(1) != 1 or (kernel_order and k % 128):
        raise ValueError(f"x must be [rows, K] of unit column stride, K % 128 == 0 (K = {k})")
    check_runnable(x, "rows_at_positions")
    out = torch.empty(blocks.num_positions, k, dtype=x.dtype, device=x.device)
    if blocks.num_positions and k:
        _rows_at_positions_kernel[(blocks.num_positions,)](
            x, blocks.pair_of_pos, out, k, x.stride(0), out.stride(0), TOP_K=blocks.top_k,
            BLOCK_K=1024, KERNEL_ORDER=kernel_order,
        )  # fmt: skip
    return out


def rows_at_positions_reference(
    x: Tensor, blocks: ExpertBlocks, kernel_order: bool = True
) -> Tensor:
    """`rows_at_positions` in torch."""
    token = torch.where(blocks.pair_of_pos >= 0, blocks.pair_of_pos // blocks.top_k, 0)
    return (_in_kernel_order(x) if kernel_order else x)[token.long()]


@functools.cache
def _kernel_columns(device: torch.device) -> Tensor:
    """`_x_columns` as an index: x's columns in the kernel's K order, per 128."""
    k = torch.arange(128)
    word = 4 * ((k >> 1) & 3) + (k >> 5)
    return (8 * word + ((k >> 3) & 3) + 4 * (k & 1)).to(device)


def _prefetch_tiles(block_n: int, maxnreg: int) -> dict:
    """The register-prefetch decode kernel's launch with BLOCK_N weight rows per program (64 or
    128: one warp per 16, the wgmma's M of 64 per warpgroup) under a register cap."""
    return {
        "BLOCK_N": block_n,
        "PREFETCH": True,
        "num_warps": block_n // 16,
        "num_stages": 1,
        "maxnreg": maxnreg,
    }


# What `benchmarks/grouped_gemm_tiles.py --prefetch-tiles` times and the `gpu` tests check:
# 128 weight rows per program share each step's x tile between two warpgroups (half the x
# traffic per weight byte of 64 rows).
DECODE_CANDIDATES: tuple[dict, ...] = tuple(
    _prefetch_tiles(n, cap) for n, cap in ((64, 128), (64, 168), (128, 128), (128, 168))
)


def decode_tiles(n: int, k: int, block_m: int, gated: bool) -> dict:
    """The decode kernel's launch shape for an (N, K, block size, use), what the autotuner keyed
    (a pure function of those, so nothing is tuned or compiled while serving). BLOCK_N weight
    rows per program, mapped to the wgmma's M (64 per warpgroup); the block's token rows are its
    N (BLOCK_M, 16 or 32); K steps by 128. THE CHOICE, from the H200 sweeps
    (`docs/performance.md`; `benchmarks/grouped_gemm_tiles.py --prefetch-tiles` times the
    `DECODE_CANDIDATES`): 64 rows, 4 warps, the register prefetch, its register cap 128 (four
    programs share an SM), except gate/up at blocks of 32 rows: 128 weight rows, 8 warps
    (2026-12-03, 256 tokens: 0.501 against 0.582 ms; down 0.301 against 0.288, blocks of 16
    rows 0.276–0.565 against 0.275–0.537)."""
    if gated and block_m > 16:
        return _prefetch_tiles(128, 128)
    return _prefetch_tiles(64, 128)


@triton.jit
def _decode_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    pair_of_pos_ptr,
    block_expert_ptr,
    row_weight_ptr,
    N,
    K,
    gate_limit,
    stride_xm,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    STORE_KERNEL_ORDER: tl.constexpr,
):
    # Computed transposed, out[rows]ᵀ = W · x[rows]ᵀ: the dequantised weight tile is the wgmma's
    # A operand, straight from registers, and a block's few token rows are its N, so decode
    # blocks of 16 rows cost no more weight reads than full ones.
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_pos = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_of_pos_ptr + offs_pos)
    is_row = pair >= 0
    if TOKEN_ROWS:  # input rows: tokens; output rows: positions (gate/up)
        in_row = pair // TOP_K
        out_row = offs_pos
    else:  # input rows: positions; output rows: (token, slot) pairs (down)
        in_row = offs_pos
        out_row = pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.where(offs_n < N, offs_n, N - 1)  # tail rows recompute row N-1, never stored
    codes_ptr += expert.to(tl.int64) * (stride_ce // 4)
    scales_ptr += expert.to(tl.int64) * stride_se
    # EVEN_K: the launcher hands x in the weights' K order (`_kernel_columns`), so each step's
    # 128 columns of a row are one contiguous run; otherwise they are gathered here.
    columns = tl.arange(0, 128) if EVEN_K else _x_columns()
    x_ptrs = x_ptr + in_row[None, :].to(tl.int64) * stride_xm + columns[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    out_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output column of each row
    if PREFETCH and EVEN_K:
        # The next step's words, scales and x load into registers while this step computes
        # (num_stages 1: the words skip shared memory); rows regrouped (`_operand_rows`).
        out_n = _operand_rows(tl.reshape(out_n, (BLOCK_N, 1)), BLOCK_N, 1)
        out_n = tl.reshape(out_n, (BLOCK_N,))
        x_next = tl.load(x_ptrs, mask=is_row[None, :], other=0.0)
        w_next, s_next = _raw_tile(codes_ptr, scales_ptr, offs_n, 0, stride_cn, stride_sn, True)
        u_next, t_next = _raw_tile(codes_ptr, scales_ptr, offs_n + N, 0, stride_cn, stride_sn,
                                   GATED)  # fmt: skip
        for k0 in range(0, K, 128):
            x_t, w_cur, s_cur, u_cur, t_cur = x_next, w_next, s_next, u_next, t_next
            more = k0 + 128 < K
            x_next = tl.load(x_ptrs + k0 + 128, mask=is_row[None, :] & more, other=0.0)
            w_next, s_next = _raw_tile(codes_ptr, scales_ptr, offs_n, k0 + 128, stride_cn,
                                       stride_sn, more)  # fmt: skip
            u_next, t_next = _raw_tile(codes_ptr, scales_ptr, offs_n + N, k0 + 128, stride_cn,
                                       stride_sn, more & GATED)  # fmt: skip
            acc = tl.dot(_unpack_raw(w_cur, s_cur, BLOCK_N), x_t, acc)
            if GATED:
                acc_up = tl.dot(_unpack_raw(u_cur, t_cur, BLOCK_N), x_t, acc_up)
    else:
        for k0 in range(0, K, 128):
            if EVEN_K:
                x_t = tl.load(x_ptrs + k0, mask=is_row[None, :], other=0.0)
            else:
                in_k = k0 + columns < K
                x_t = tl.load(x_ptrs + k0, mask=is_row[None, :] & in_k[:, None], other=0.0)
            w = _weight_tile(
                codes_ptr, scales_ptr, offs_n, k0, K, stride_cn, stride_sn, BLOCK_N, EVEN_K
            )
            acc = tl.dot(w, x_t, acc)
            if GATED:  # W3's rows follow W1's
                w = _weight_tile(codes_ptr, scales_ptr, offs_n + N, k0, K, stride_cn, stride_sn,
                                 BLOCK_N, EVEN_K)  # fmt: skip
                acc_up = tl.dot(w, x_t, acc_up)
    if GATED:
        gate = tl.minimum(acc, gate_limit)
        acc = gate * tl.sigmoid(gate) * tl.clamp(acc_up, -gate_limit, gate_limit)
    if HAS_ROW_WEIGHT:
        weight = tl.load(row_weight_ptr + tl.where(is_row, pair, 0), mask=is_row, other=0.0)
        acc = acc * weight[None, :]
    out_col = _kernel_order(out_n) if STORE_KERNEL_ORDER else out_n
    tl.store(
        out_ptr + out_row[None, :].to(tl.int64) * stride_om + out_col[:, None],
        acc.to(out_ptr.dtype.element_ty),
        mask=is_row[None, :] & (out_n < N)[:, None],
    )


@triton.jit
def _dequantize_tile(
    codes_ptr,
    scales_ptr,
    offs_n,
    n_mask,
    k0,
    stride_cn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] bf16 weights of rows `offs_n`, columns k0 .. k0 + BLOCK_K."""
    offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    code_ptrs = codes_ptr + offs_n[:, None] * stride_cn + offs_byte[None, :]
    packed = tl.load(code_ptrs, mask=n_mask[:, None], other=0).to(tl.uint8, bitcast=True)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
    # fp16 bits with the 3-bit magnitude code at the exponent's low bits: code (e, m) reads as
    # 2^(e-15)·(1 + m/2), or m·2^-15 when e = 0 (subnormal) — e2m1 times 2^-14 in both cases.
    codes = codes.to(tl.uint16)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    values = bits.to(tl.float16, bitcast=True).to(tl.float32)
    offs_scale = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale_ptrs = scales_ptr + offs_n[:, None] * stride_sn + offs_scale[None, :]
    exponent = tl.load(scale_ptrs, mask=n_mask[:, None], other=0).to(tl.uint8, bitcast=True)
    multiplier = tl.exp2(exponent.to(tl.float32) - (127.0 - 14.0))
    values = tl.reshape(values, (BLOCK_N, BLOCK_K // 32, 32)) * multiplier[:, :, None]
    return tl.reshape(values, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)


# The interpreter's bf16 dot is not trustworthy: there the prefill kernel's operands (bf16 values,
# exact in fp32) go to an fp32 dot.
_PREFILL_DOT = tl.constexpr(tl.float32 if interpreting() else tl.bfloat16)


# What `benchmarks/grouped_gemm_tiles.py --register-unpack` times and the `gpu` tests check:
# the prefill kernel with the decode kernel's unpack, (BLOCK_N, warps, stages), BLOCK_K 128.
REGISTER_PREFILL_CANDIDATES: tuple[dict, ...] = tuple(
    {"BLOCK_N": n, "BLOCK_K": 128, "num_warps": w, "num_stages": s, "REGISTER_UNPACK": True}
    for n, w, s in ((64, 4, 3), (64, 8, 3), (64, 4, 4), (128, 8, 3), (128, 4, 3))
)


def prefill_tiles(n: int, k: int, block_m: int, gated: bool, register_unpack: bool = False) -> dict:
    """The prefill kernel's launch shape (BLOCK_N, BLOCK_K, warps, stages; token rows as the
    wgmma's M) for an (N, K, block size, use), what the autotuner keyed. THE CHOICE: the
    fastest of the seven former autotuner candidates per (block size, use) at the released
    width on the H200 (`benchmarks/grouped_gemm_tiles.py --tokens 4096 --no-tuned`,
    docs/performance.md 2026-12-02): blocks of 128 rows gate/up 128 × 128 over 8 warps, down
    128 × 64; smaller blocks gate/up 64 × 64, down 128 × 128. BLOCK_K falls to the largest of
    128, 64, 32 dividing K and not above the choice. `register_unpack` (scale codes <= 128,
    K a multiple of 128): gate/up unpacks as the decode kernel does (`REGISTER_UNPACK`)."""
    if block_m >= 128:
        block_n, block_k, warps, stages = (128, 128, 8, 3) if gated else (128, 64, 4, 4)
    else:
        block_n, block_k, warps, stages = (64, 64, 4, 4) if gated else (128, 128, 8, 3)
    if register_unpack and gated and k % 128 == 0:
        # H100, 4,096 tokens (`grouped_gemm_tiles.py --register-unpack`, 2026-12-06): gate/up
        # 128 rows 3.87 ms (128 columns, 8 warps) against the table's 4.33, 64 rows 4.47 (64
        # columns, 4 warps) against 5.20; the down lost at every shape (3.24-4.62 against
        # 2.32-2.87 ms) and keeps the table.
        block_n, warps = (128, 8) if block_m >= 128 else (64, 4)
        return {"BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": warps, "num_stages": 3,
                "REGISTER_UNPACK": True}  # fmt: skip
    block_k = next(b for b in (128, 64, 32) if b <= block_k and k % b == 0)
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


@triton.jit
def _prefill_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    pair_of_pos_ptr,
    block_expert_ptr,
    row_weight_ptr,
    N,
    K,
    gate_limit,
    stride_xm,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    HAS_ROW_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REGISTER_UNPACK: tl.constexpr,
    STORE_KERNEL_ORDER: tl.constexpr,
):
    # REGISTER_UNPACK: the weight tiles unpack as the decode kernel's (`_weight_tile`: inline
    # PTX, ~2.5 instructions per value against ~7 of `_dequantize_tile`, scale codes <= 128
    # only), BLOCK_K = 128, codes read as int32 words, x's columns in the kernel's K order.
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_pos = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_of_pos_ptr + offs_pos)
    is_row = pair >= 0
    if GATED:  # input rows: tokens; output rows: positions
        in_row = pair // TOP_K
        out_row = offs_pos
    else:  # input rows: positions; output rows: (token, slot) pairs
        in_row = offs_pos
        out_row = pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if REGISTER_UNPACK:  # tail rows recompute row N-1, never stored
        offs_n = tl.where(n_mask, offs_n, N - 1)
        codes_ptr += expert.to(tl.int64) * (stride_ce // 4)
    else:
        codes_ptr += expert.to(tl.int64) * stride_ce
    offs_up = offs_n + N  # W3's rows follow W1's (gated only)
    scales_ptr += expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + in_row[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=is_row[:, None],
            other=0.0,
        )
        if REGISTER_UNPACK:
            w = _weight_tile(codes_ptr, scales_ptr, offs_n, k0, K, stride_cn, stride_sn,
                             BLOCK_N, True)  # fmt: skip
        else:
            w = _dequantize_tile(
                codes_ptr, scales_ptr, offs_n, n_mask, k0, stride_cn, stride_sn, BLOCK_N, BLOCK_K
            )
        acc = tl.dot(x.to(_PREFILL_DOT), tl.trans(w.to(_PREFILL_DOT)), acc)
        if GATED:
            if REGISTER_UNPACK:
                w_up = _weight_tile(codes_ptr, scales_ptr, offs_up, k0, K, stride_cn, stride_sn,
                                    BLOCK_N, True)  # fmt: skip
            else:
                w_up = _dequantize_tile(codes_ptr, scales_ptr, offs_up, n_mask, k0, stride_cn,
                                        stride_sn, BLOCK_N, BLOCK_K)  # fmt: skip
            acc_up = tl.dot(x.to(_PREFILL_DOT), tl.trans(w_up.to(_PREFILL_DOT)), acc_up)
    if GATED:
        gate = tl.minimum(acc, gate_limit)
        acc = gate * tl.sigmoid(gate) * tl.clamp(acc_up, -gate_limit, gate_limit)
    if HAS_ROW_WEIGHT:
        weight = tl.load(row_weight_ptr + tl.where(is_row, pair, 0), mask=is_row, other=0.0)
        acc = acc * weight[:, None]
    out_col = _kernel_order(offs_n) if STORE_KERNEL_ORDER else offs_n
    tl.store(
        out_ptr + out_row[:, None].to(tl.int64) * stride_om + out_col[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=is_row[:, None] & n_mask[None, :],
    )


def _check_weights(codes: Tensor, scales: Tensor, k: int) -> tuple[int, int]:
    if codes.dtype != torch.int8 or codes.dim() != 3 or codes.stride(-1) != 1:
        raise ValueError(f"codes must be int8 [E, N, K/2] with unit column stride, got {codes}")
    num_experts, n_weight, half_k = codes.shape
    if half_k * 2 != k or k % MXFP4_BLOCK:
        raise ValueError(f"codes hold K = {half_k * 2} columns, x has {k} (a multiple of 32)")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu) or scales.stride(-1) != 1:
        raise ValueError(f"scales must be uint8/e8m0 with unit column stride, got {scales.dtype}")
    if tuple(scales.shape) != (num_experts, n_weight, k // MXFP4_BLOCK):
        expected = (num_experts, n_weight, k // MXFP4_BLOCK)
        raise ValueError(f"scales shape {tuple(scales.shape)} != {expected}")
    return num_experts, n_weight


def decode_tiles_exact(scales: Tensor) -> bool:
    """Whether the decode kernel is exact for these e8m0 scales (every code <= 128, see the
    unpack's NOTE). Reads the scales back to the host: call it once, when the weights load,
    and give blocks of more than `DECODE_MAX_BLOCK_M` rows to weights where it is False."""
    return int(scales.view(torch.uint8).max()) <= DECODE_MAX_SCALE_CODE


def grouped_mxfp4_gemm(
    x: Tensor,
    blocks: ExpertBlocks,
    codes: Tensor,
    scales: Tensor,
    *,
    gate_limit: float | None = None,
    row_weight: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fixed_tiles: bool = False,
    register_unpack: bool = False,
    x_kernel_order: bool = False,
    out_kernel_order: bool = False,
) -> Tensor:
    """The routed GEMM of `blocks` (see the module docstring).

    gate_limit None (down): x is [num_positions, K] (rows at positions); returns
        [T·top_k, N] rows at (token, slot) pairs.
    gate_limit L (gate/up): x is [T, K] (token rows), codes hold [W1; W3] (N_w = 2N); returns
        the clamped SwiGLU [num_positions, N] at positions (padding rows uninitialised).
    row_weight: fp32 [T·top_k] routing weights multiplied into each output row.
    fixed_tiles: the prefill kernel with one tile config per K (batch-invariant mode): needs
        block_m > DECODE_MAX_BLOCK_M. Triton's CPU interpreter always runs these tiles (the
        decode tiles' inline PTX has no interpreter). Otherwise `decode_tiles` or
        `prefill_tiles` by the block size.
    register_unpack: the caller guarantees `decode_tiles_exact(scales)`: blocks of more than
        `DECODE_MAX_BLOCK_M` rows may unpack the weights as the decode kernel does (gate/up:
        the prefill kernel's register unpack; blocks of 128 rows of either use: the Gluon
        kernel, where `PREFILL_KERNEL` chooses it).
    x_kernel_order: x's columns are already in the kernel's K order (a gate/up output written
        with `out_kernel_order`); only where `reads_kernel_order` says the launch reads it so.
    out_kernel_order: gate/up, N a multiple of 128: each output row's columns are written in
        the kernel's K order, as the down GEMM reads them (no reordering copy of x there).

    Raises:
        ValueError: a shape, dtype or stride the kernel does not take.
    """
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be bf16 [rows, K], unit column stride; got {x.dtype} {x.shape}")
    check_runnable(x, "grouped_mxfp4_gemm")
    k = x.shape[1]
    _, n_weight = _check_weights(codes, scales, k)
    gated = gate_limit is not None
    if gated and n_weight % 2:
        raise ValueError(f"gate/up weights need an even N_w (W1; W3), got {n_weight}")
    n = n_weight // 2 if gated else n_weight
    expected_rows = blocks.num_tokens if gated else blocks.num_positions
    if x.shape[0] != expected_rows:
        raise ValueError(f"x has {x.shape[0]} rows, the routing needs {expected_rows}")
    if row_weight is not None and (
        row_weight.dtype != torch.float32
        or not row_weight.is_contiguous()
        or row_weight.numel() != blocks.num_pairs
    ):
        raise ValueError(f"row_weight must be contiguous fp32 [{blocks.num_pairs}]")
    if x_kernel_order and not reads_kernel_order(
        k, blocks.block_m, fixed_tiles=fixed_tiles, exact_unpack=register_unpack, x=x
    ):
        raise ValueError(f"this launch (K = {k}, blocks of {blocks.block_m}) reads x as it is")
    if out_kernel_order and (not gated or n % 128):
        raise ValueError(f"only a gate/up output of N % 128 == 0 goes in kernel order (N = {n})")
    out_rows = blocks.num_positions if gated else blocks.num_pairs
    out = torch.empty(out_rows, n, dtype=out_dtype, device=x.device)
    weights = (codes, scales.view(torch.uint8))
    if interpreting() and blocks.block_m <= DECODE_MAX_BLOCK_M:
        raise ValueError("the decode tiles' inline PTX does not run in Triton's interpreter")
    if fixed_tiles or interpreting():
        if blocks.block_m <= DECODE_MAX_BLOCK_M:
            raise ValueError(f"fixed tiles need blocks of more than {DECODE_MAX_BLOCK_M} rows")
        tiles = {**_fixed_tiles(k), "out_kernel_order": out_kernel_order}
        _launch_prefill(x, blocks, weights, out, gate_limit, row_weight, **tiles)
    elif _gluon_runs(x, k, blocks.block_m, exact_unpack=register_unpack):
        # NOTE: blocks of up to DECODE_MAX_BLOCK_M rows come only where the caller guarantees
        # `decode_tiles_exact(scales)` (`_block_m`); larger ones only with `register_unpack`.
        choice = PREFILL_KERNEL if blocks.block_m > DECODE_MAX_BLOCK_M else DECODE_KERNEL
        ws_tiles = grouped_mxfp4_ws.tiles(blocks.block_m, gated)
        if choice == "gluon-ws" and grouped_mxfp4_ws.runs(x, blocks, codes, n,
                                                          ws_tiles["num_warps"]):  # fmt: skip
            if gated:  # token rows into position order (and the K order) for the TMA tiles
                x = rows_at_positions(x, blocks, kernel_order=not x_kernel_order)
            elif not x_kernel_order:
                x = _in_kernel_order(x)
            grouped_mxfp4_ws.launch(x, blocks, weights, out, gate_limit, row_weight,
                                    out_kernel_order=out_kernel_order, **ws_tiles)  # fmt: skip
            return out
        x = x if x_kernel_order else _in_kernel_order(x)
        tiles = grouped_mxfp4_gluon.decode_tiles(n, k, blocks.block_m, gated)
        grouped_mxfp4_gluon.launch_decode(x, blocks, weights, out, gate_limit, row_weight,
                            out_kernel_order=out_kernel_order, **tiles)  # fmt: skip
    elif blocks.block_m <= DECODE_MAX_BLOCK_M:
        tiles = decode_tiles(n, k, blocks.block_m, gated)
        orders = {"x_kernel_order": x_kernel_order, "out_kernel_order": out_kernel_order}
        _launch_decode(x, blocks, weights, out, gate_limit, row_weight, **orders, **tiles)
    else:
        tiles = prefill_tiles(n, k, blocks.block_m, gated, register_unpack)
        tiles["out_kernel_order"] = out_kernel_order
        _launch_prefill(x, blocks, weights, out, gate_limit, row_weight, **tiles)
    return out


# THE CHOICE of the decode kernel where both run (Hopper, K a multiple of 128): "gluon"
# (`kernels.grouped_mxfp4_gluon`: cp.async ring, asynchronous wgmma), "gluon-ws"
# (`kernels.grouped_mxfp4_ws`: the same products with TMA loads by a producer warp, where its
# contract holds; the cp.async kernel elsewhere) or "triton" (`_decode_kernel`). Elsewhere the
# Triton kernel runs.
DECODE_KERNEL = "gluon"
# THE CHOICE for blocks of 128 rows (prefill) where the Gluon kernel runs and the caller
# guarantees its exactness (`register_unpack`): "gluon" (the same kernel, 128 tokens on the
# wgmma's N), "gluon-ws" (`kernels.grouped_mxfp4_ws`: the same products with TMA loads by a
# producer warp, where its contract holds; the cp.async kernel elsewhere) or "triton"
# (`_prefill_kernel`).
PREFILL_KERNEL = "gluon"


def _gluon_runs(x: Tensor, k: int, block_m: int, *, exact_unpack: bool) -> bool:
    if k % grouped_mxfp4_gluon.STEP_K:
        return False
    if block_m <= DECODE_MAX_BLOCK_M:
        chosen = DECODE_KERNEL in ("gluon", "gluon-ws")
    else:
        chosen = block_m == 128 and exact_unpack and PREFILL_KERNEL in ("gluon", "gluon-ws")
    return chosen and grouped_mxfp4_gluon.runs_here(x)


def reads_kernel_order(
    k: int,
    block_m: int,
    *,
    fixed_tiles: bool = False,
    exact_unpack: bool = False,
    x: Tensor | None = None,
) -> bool:
    """Whether the down `grouped_mxfp4_gemm` of inner dimension k over blocks of `block_m`
    rows reads x in the kernel's K order (the decode tiles; blocks of 128 where the Gluon
    kernel takes them: `exact_unpack` as the launch's `register_unpack`, x on the launch's
    device), so that the gate/up launch may write it so (`out_kernel_order`, then
    `x_kernel_order`) instead of the launcher reordering a copy."""
    if k % 128 or fixed_tiles or interpreting():
        return False
    if block_m <= DECODE_MAX_BLOCK_M:
        return True
    return x is not None and _gluon_runs(x, k, block_m, exact_unpack=exact_unpack)


def _launch_decode(
    x,
    blocks,
    weights,
    out,
    gate_limit,
    row_weight,
    token_rows=None,
    x_kernel_order=False,
    out_kernel_order=False,
    **tiles,
) -> None:
    """`_decode_kernel` over `blocks` with `tiles` (BLOCK_N, PREFETCH and launch options).
    token_rows: x holds token rows and out position rows (default: whether gated); True with
    no gate_limit multiplies gate and up as plain rows, out [positions, N_w] (a candidate:
    `benchmarks/grouped_gemm_tiles.py --split-gate-up`). x_kernel_order, out_kernel_order:
    as `grouped_mxfp4_gemm`'s."""
    codes, scales = weights
    token_rows = gate_limit is not None if token_rows is None else token_rows
    k, n = x.shape[1], out.shape[1]
    even_k = k % 128 == 0
    if even_k and not x_kernel_order:  # x's columns in the weights' K order: contiguous runs
        x = _in_kernel_order(x)
    grid = (blocks.block_expert.numel(), triton.cdiv(n, tiles["BLOCK_N"]))
    _decode_kernel[grid](
        x,
        codes.view(torch.int32),
        scales,
        out,
        blocks.pair_of_pos,
        blocks.block_expert,
        row_weight if row_weight is not None else x,
        n,
        k,
        float(gate_limit or 0.0),
        x.stride(0),
        codes.stride(0),
        codes.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        TOP_K=blocks.top_k,
        GATED=gate_limit is not None,
        TOKEN_ROWS=token_rows,
        HAS_ROW_WEIGHT=row_weight is not None,
        EVEN_K=even_k,
        BLOCK_M=blocks.block_m,
        STORE_KERNEL_ORDER=out_kernel_order,
        **tiles,
    )


def _fixed_tiles(k: int) -> dict[str, int]:
    """One prefill config for inner dimension K: 64 columns, the largest K step of 128, 64
    or 32 dividing K."""
    block_k = next(b for b in (128, 64, 32) if k % b == 0)
    return {"BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}


def _launch_prefill(
    x,
    blocks,
    weights,
    out,
    gate_limit,
    row_weight,
    REGISTER_UNPACK=False,
    out_kernel_order=False,
    **tiles,
) -> None:
    """`_prefill_kernel` over `blocks` with `tiles` (BLOCK_N, BLOCK_K, num_warps, num_stages);
    REGISTER_UNPACK (BLOCK_K 128, K a multiple of 128): x's columns go in the kernel's K
    order first (one copy of x, as the decode launcher's); out_kernel_order as
    `grouped_mxfp4_gemm`'s."""
    codes, scales = weights
    n = out.shape[1]
    k = x.shape[1]
    if REGISTER_UNPACK and (tiles["BLOCK_K"] != 128 or k % 128):
        raise ValueError(f"the register unpack steps K by 128 (K = {k}, {tiles})")
    if REGISTER_UNPACK:
        x = _in_kernel_order(x)
    grid = (blocks.block_expert.numel(), triton.cdiv(n, tiles["BLOCK_N"]))
    _prefill_kernel[grid](
        x,
        codes.view(torch.int32) if REGISTER_UNPACK else codes,  # strides stay in bytes
        scales,
        out,
        blocks.pair_of_pos,
        blocks.block_expert,
        row_weight if row_weight is not None else x,
        n,
        x.shape[1],
        float(gate_limit or 0.0),
        x.stride(0),
        codes.stride(0),
        codes.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        TOP_K=blocks.top_k,
        GATED=gate_limit is not None,
        HAS_ROW_WEIGHT=row_weight is not None,
        BLOCK_M=blocks.block_m,
        REGISTER_UNPACK=REGISTER_UNPACK,
        STORE_KERNEL_ORDER=out_kernel_order,
        **tiles,
    )


def grouped_mxfp4_gemm_reference(
    x: Tensor,
    blocks: ExpertBlocks,
    codes: Tensor,
    scales: Tensor,
    *,
    gate_limit: float | None = None,
    row_weight: Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """`grouped_mxfp4_gemm` in plain torch (fp32 maths, same rounding points; the weights decoded
    by `element_codes.mxfp4_to_float`); padding and unused rows are zero here."""
    pair_of_pos = blocks.pair_of_pos.long()
    block_expert = blocks.block_expert.long().repeat_interleave(blocks.block_m)
    is_row = pair_of_pos >= 0
    gated = gate_limit is not None
    n = codes.shape[1] // 2 if gated else codes.shape[1]
    acc = torch.zeros(blocks.num_positions, n, device=x.device)
    positions = torch.arange(blocks.num_positions, device=x.device)
    in_rows = pair_of_pos // blocks.top_k if gated else positions
    for expert in torch.unique(block_expert[is_row]).tolist():
        mine = is_row & (block_expert == expert)
        weight = mxfp4_to_float(codes[expert], scales[expert])
        rows = x[in_rows[mine]].float()
        if gated:
            gate = (rows @ weight[:n].t()).clamp(max=gate_limit)
            up = (rows @ weight[n:].t()).clamp(-gate_limit, gate_limit)
            acc[mine] = torch.nn.functional.silu(gate) * up
        else:
            acc[mine] = rows @ weight.t()
    if row_weight is not None:
        acc[is_row] *= row_weight[pair_of_pos[is_row]][:, None]
    if gated:
        return acc.to(out_dtype)
    out = torch.zeros(blocks.num_pairs, n, device=x.device)
    out[pair_of_pos[is_row]] = acc[is_row]
    return out.to(out_dtype)
