"""An Engram layer's hash ids in one launch (`model.md` §3.9), per token position:

    c_s   = map[t_s], or map[pad] from the first blocked column on (t_s < 0 or an image token)
    roll  = (c_0·mult_0) ^ (c_1·mult_1) ^ ... ^ (c_n·mult_n)             n = 1 .. S−1
    id    = roll % prime[n−1, k] + offset[(n−1)·heads + k]             k = 0 .. heads−1

all in int64, columns in (n-gram, head) order. The torch form
(`engine/models/deepseek_v41/engram_hash.engram_hash_ids_reference`, which
`tests/kernels/test_engram_hash.py` compares; `kernels` cannot import it) is ~15 launches.
Integers only, so the ids are the reference's exactly.

    grid (cdiv(T, BLOCK_T)): BLOCK_T positions × every head per program

NOTE: like the reference, it trusts every map value to lie below the compressed vocabulary,
whose multiplier bound keeps the products below 2^63 (non-negative XORs, plain remainders).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["engram_hash"]

_BLOCK_T = 64


@triton.jit(do_not_specialize=["num_positions"])  # step-varying: one variant
def _engram_hash_kernel(
    token_ids_ptr,
    token_map_ptr,
    multipliers_ptr,
    primes_ptr,
    offsets_ptr,
    out_ptr,
    num_positions,
    pad_id,
    image_token_id,
    SPAN: tl.constexpr,
    HEADS: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = positions < num_positions
    heads = tl.arange(0, HEADS_BLOCK)
    in_heads = heads < HEADS
    rows = positions.to(tl.int64)
    pad = tl.load(token_map_ptr + pad_id)
    blocked = tl.zeros((BLOCK_T,), dtype=tl.int1)
    roll = tl.zeros((BLOCK_T,), dtype=tl.int64)
    for s in tl.static_range(SPAN):
        token = tl.load(token_ids_ptr + rows * SPAN + s, mask=live, other=0)
        stop = token < 0
        if HAS_IMAGE:
            stop = stop | (token == image_token_id)
        blocked = blocked | stop
        compressed = tl.load(token_map_ptr + tl.maximum(token, 0), mask=live & ~blocked, other=0)
        compressed = tl.where(blocked, pad, compressed)
        roll = roll ^ (compressed * tl.load(multipliers_ptr + s))
        if s > 0:
            column = (s - 1) * HEADS + heads
            primes = tl.load(primes_ptr + column, mask=in_heads, other=1)
            offsets = tl.load(offsets_ptr + column, mask=in_heads, other=0)
            ids = roll[:, None] % primes[None, :] + offsets[None, :]
            out = out_ptr + rows[:, None] * ((SPAN - 1) * HEADS) + column[None, :]
            tl.store(out, ids, mask=live[:, None] & in_heads[None, :])


def engram_hash(
    token_ids: Tensor,
    token_map: Tensor,
    multipliers: Tensor,
    primes: Tensor,
    offsets: Tensor,
    pad_id: int,
    image_token_id: int | None = None,
) -> Tensor:
    """token_ids int64 [T, S] (−1: before the sequence start), token_map int64 [vocab],
    multipliers int64 [S], primes int64 [S−1, heads], offsets int64 [(S−1)·heads] →
    int64 [T, (S−1)·heads] table rows (module docstring)."""
    tensors = (token_ids, token_map, multipliers, primes, offsets)
    if any(t.dtype != torch.int64 for t in tensors):
        raise ValueError("token ids, map, multipliers, primes and offsets must be int64")
    if token_ids.dim() != 2 or multipliers.shape != (token_ids.shape[1],):
        raise ValueError(
            f"token_ids {tuple(token_ids.shape)} must be [T, S] with S = {multipliers.numel()}"
        )
    span = token_ids.shape[1]
    if primes.dim() != 2 or primes.shape[0] != span - 1 or offsets.shape != (primes.numel(),):
        raise ValueError(f"primes must be [{span - 1}, heads] and offsets one per column")
    check_runnable(token_ids, "engram_hash")
    heads = primes.shape[1]
    out = torch.empty(
        token_ids.shape[0], (span - 1) * heads, dtype=torch.int64, device=token_ids.device
    )
    if out.numel():
        _engram_hash_kernel[(triton.cdiv(token_ids.shape[0], _BLOCK_T),)](
            token_ids.contiguous(),
            token_map.contiguous(),
            multipliers.contiguous(),
            primes.contiguous(),
            offsets.contiguous(),
            out,
            token_ids.shape[0],
            pad_id,
            image_token_id if image_token_id is not None else 0,
            SPAN=span,
            HEADS=heads,
            HEADS_BLOCK=triton.next_power_of_2(heads),
            HAS_IMAGE=image_token_id is not None,
            BLOCK_T=_BLOCK_T,
        )
    return out
