"""Decode attention of one CSA2 layer (`model.md` §3.7) reading the encoded KV rows in place.

One new token per sequence. Each query head attends, in one softmax, to

    window    the `window` positions p − window + 1 .. p of its sequence, read from the layer's
              ring of MXFP8 rows (`swa_mxfp8`: e4m3 + ue8m0 per 32; row of position q at q % R)
    selected  up to K compressed positions chosen by the indexer (−1 = none), read from the
              paged pool of FP4 rows (`global_fp4`: e2m1 + e4m3 scale per 16) through the block
              table: position j lives in block table[j · ratio // 128], row j % (128 // ratio)
    sink      one logit per head with no value

and returns Σ softmax · row (keys are values: MQA over one latent row). The torch path gathers
and decodes [T, K, D] fp32 rows and runs the softmax over materialised scores; here rows are
decoded in registers, tile by tile, with an online softmax, in fp32 (exact products of the
decoded values; only the summation order differs).

    grid (sequences, heads / BLOCK_H); per program q [BLOCK_H, D], running max and sum,
    acc [BLOCK_H, D]

`sparse_mqa_decode` is the launcher; `sparse_mqa_decode_reference` the torch reference (codecs'
own dequantisation, a direct softmax).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

SWA_BLOCK = 32
GLOBAL_BLOCK = 16
_BLOCK_H = 16


@triton.jit
def _online_update(m, total, acc, scores, rows):
    """Fold one tile of scores [BH, BN] over rows [BN, D] into the running softmax."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, rows, input_precision="ieee")
    return m_new, total, acc


@triton.jit
def _swa_rows(ring_ptr, row_index, valid, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Decode MXFP8 rows [BLOCK_N, D] (row bytes: D e4m3 codes, then D/32 ue8m0 scales)."""
    d = tl.arange(0, D)
    code_ptrs = ring_ptr + row_index[:, None] + d[None, :]
    codes = tl.load(code_ptrs, mask=valid[:, None], other=0).to(tl.uint16)
    # e4m3 (s, e, m) placed at fp16 bits: 2^(e-15)·(1 + m/8) or m/8·2^-14, i.e. e4m3 · 2^-8.
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
    values = bits.to(tl.float16, bitcast=True).to(tl.float32)
    b = tl.arange(0, D // 32)
    exponent = tl.load(ring_ptr + row_index[:, None] + D + b[None, :], mask=valid[:, None], other=0)
    multiplier = tl.exp2(exponent.to(tl.float32) - (127.0 - 8.0))
    values = tl.reshape(values, (BLOCK_N, D // 32, 32)) * multiplier[:, :, None]
    return tl.reshape(values, (BLOCK_N, D))


@triton.jit
def _global_rows(pool_ptr, row_index, valid, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Decode FP4 rows [BLOCK_N, D] (row bytes: D/2 packed e2m1 pairs, then D/16 e4m3 scales)."""
    c = tl.arange(0, D // 2)
    packed = tl.load(pool_ptr + row_index[:, None] + c[None, :], mask=valid[:, None], other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, D)).to(tl.uint16)
    # e2m1 (s, e, m) at fp16 bits: e2m1 · 2^-14.
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    values = bits.to(tl.float16, bitcast=True).to(tl.float32)
    b = tl.arange(0, D // 16)
    scale_bytes = tl.load(
        pool_ptr + row_index[:, None] + D // 2 + b[None, :], mask=valid[:, None], other=0
    ).to(tl.uint16)
    scale_bits = ((scale_bytes & 0x80) << 8) | ((scale_bytes & 0x7F) << 7)
    # e4m3 · 2^-8 from the fp16 reading, times 2^-14 from the codes': undo both (2^22).
    scales = scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0
    values = tl.reshape(values, (BLOCK_N, D // 16, 16)) * scales[:, :, None]
    return tl.reshape(values, (BLOCK_N, D))


@triton.jit
def _sparse_mqa_decode_kernel(
    q_ptr,
    ring_ptr,
    pool_ptr,
    selection_ptr,
    block_table_ptr,
    slot_ptr,
    position_ptr,
    sink_ptr,
    out_ptr,
    num_heads,
    num_selected,
    ring_len,
    softmax_scale,
    stride_qs,
    stride_qh,
    stride_ring_slot,
    stride_ring_row,
    stride_pool_block,
    stride_pool_row,
    stride_sel,
    stride_table,
    stride_os,
    stride_oh,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_head = heads < num_heads
    d = tl.arange(0, D)
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=is_head[:, None], other=0.0).to(tl.float32) * softmax_scale
    # The running max starts finite, so an all-masked tile gives exp(...) = 0, not NaN.
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    position = tl.load(position_ptr + seq)
    slot = tl.load(slot_ptr + seq)
    ring_base = ring_ptr + slot * stride_ring_slot
    for w0 in range(0, WINDOW, BLOCK_N):
        key_position = position - (WINDOW - 1) + w0 + tl.arange(0, BLOCK_N)
        valid = key_position >= 0
        row_index = (tl.where(valid, key_position, 0) % ring_len) * stride_ring_row
        rows = _swa_rows(ring_base, row_index, valid, D, BLOCK_N)
        scores = tl.dot(q, tl.trans(rows), input_precision="ieee")
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m, total, acc = _online_update(m, total, acc, scores, rows)
    if RATIO > 0:
        rows_per_block: tl.constexpr = 128 // RATIO
        for k0 in range(0, num_selected, BLOCK_N):
            k = k0 + tl.arange(0, BLOCK_N)
            j = tl.load(selection_ptr + seq * stride_sel + k, mask=k < num_selected, other=-1)
            valid = j >= 0
            j = tl.where(valid, j, 0)
            block = tl.load(block_table_ptr + seq * stride_table + (j * RATIO) // 128)
            row_index = block * stride_pool_block + (j % rows_per_block) * stride_pool_row
            rows = _global_rows(pool_ptr, row_index, valid, D, BLOCK_N)
            scores = tl.dot(q, tl.trans(rows), input_precision="ieee")
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m, total, acc = _online_update(m, total, acc, scores, rows)
    sink = tl.load(sink_ptr + heads, mask=is_head, other=0.0)
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    total = total * alpha + tl.exp(sink - m_new)
    out = acc * alpha[:, None] / total[:, None]
    out_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out, mask=is_head[:, None])


def sparse_mqa_decode(
    q: Tensor,
    ring: Tensor,
    slots: Tensor,
    positions: Tensor,
    sink: Tensor,
    window: int,
    softmax_scale: float,
    global_rows: tuple[Tensor, Tensor, Tensor, int] | None = None,
) -> Tensor:
    """fp32 [S, H, D] attention output of one new token per sequence.

    q: [S, H, D] (bf16 or fp32). ring: uint8 [slots, R, D + D/32] MXFP8 rows, each sequence's
    newest row already written. slots, positions: int64 [S]. sink: fp32 [H].
    global_rows: (pool uint8 [blocks, 128/ratio, D/2 + D/16], selection int64 [S, K] with −1
    for none, block_tables int64 [S, max_blocks], ratio) for layers with a KV source.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take (D not a power of two
            ≥ 32, window not a multiple of 16, non-unit row strides).
    """
    num_seqs, num_heads, dim = q.shape
    if dim < 32 or dim & (dim - 1) or window % 16:
        raise ValueError(
            "need a power-of-two head dim >= 32 and a window that is a multiple of 16; got "
            f"dim {dim}, window {window}"
        )
    if q.stride(-1) != 1 or ring.dtype != torch.uint8 or ring.shape[-1] != dim + dim // 32:
        row = dim + dim // 32
        raise ValueError(f"q needs unit column stride; ring must be uint8 [.., .., {row}]")
    if ring.stride(-1) != 1 or sink.dtype != torch.float32 or sink.shape != (num_heads,):
        raise ValueError("ring needs unit byte stride; sink must be fp32 [heads]")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("sparse_mqa_decode runs on CUDA (or Triton's CPU interpreter)")
    out = torch.empty(num_seqs, num_heads, dim, dtype=torch.float32, device=q.device)
    if global_rows is None:
        pool, selection, tables, ratio = ring, slots[:, None], slots[:, None], 0
    else:
        pool, selection, tables, ratio = global_rows
        if pool.dtype != torch.uint8 or pool.shape[-2:] != (128 // ratio, dim // 2 + dim // 16):
            raise ValueError(f"pool must be uint8 [blocks, {128 // ratio}, {dim // 2 + dim // 16}]")
        if selection.shape[0] != num_seqs or tables.shape[0] != num_seqs:
            raise ValueError("selection and block tables need one row per sequence")
    grid = (num_seqs, triton.cdiv(num_heads, _BLOCK_H))
    _sparse_mqa_decode_kernel[grid](
        q,
        ring,
        pool,
        selection,
        tables,
        slots,
        positions,
        sink,
        out,
        num_heads,
        selection.shape[1] if ratio else 0,
        ring.shape[1],
        softmax_scale,
        q.stride(0),
        q.stride(1),
        ring.stride(0),
        ring.stride(1),
        pool.stride(0),
        pool.stride(1),
        selection.stride(0),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        RATIO=ratio,
        WINDOW=window,
        D=dim,
        BLOCK_H=_BLOCK_H,
        BLOCK_N=32 if window % 32 == 0 else 16,
        num_warps=8,
    )
    return out


def sparse_mqa_decode_reference(
    q: Tensor,
    ring: Tensor,
    slots: Tensor,
    positions: Tensor,
    sink: Tensor,
    window: int,
    softmax_scale: float,
    global_rows: tuple[Tensor, Tensor, Tensor, int] | None = None,
) -> Tensor:
    """`sparse_mqa_decode` in plain torch: decode the rows with the codecs, one softmax."""
    from engine.models.deepseek_v41.kv_formats import (
        global_fp4_dequantize,
        swa_mxfp8_dequantize,
    )

    offsets = torch.arange(-(window - 1), 1, device=q.device)
    key_positions = positions[:, None] + offsets[None, :]  # [S, W]
    rows = swa_mxfp8_dequantize(ring[slots[:, None], key_positions.clamp(min=0) % ring.shape[1]])
    masks = [key_positions >= 0]
    if global_rows is not None:
        pool, selection, tables, ratio = global_rows
        j = selection.clamp(min=0)
        blocks = torch.gather(tables, 1, j * ratio // 128)
        selected = global_fp4_dequantize(pool[blocks, j % (128 // ratio)])
        rows = torch.cat((rows, selected), 1)
        masks.append(selection >= 0)
    scores = torch.einsum("shd,skd->shk", q.float(), rows) * softmax_scale
    scores = scores.masked_fill(~torch.cat(masks, 1)[:, None, :], float("-inf"))
    sinks = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat((scores, sinks), -1).softmax(-1)[..., :-1]
    return torch.einsum("shk,skd->shd", probs, rows)
