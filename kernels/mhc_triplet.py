"""One hyper-connection site's whole mHC triplet in two launches (`model.md` §3.2).

From the residual streams z = f32(R) [T, N·D] of each token (N streams of width D):

    mix    = (z · fnᵀ) · rsqrt(mean(z²) + norm_eps)                [T, 2N + N²]
    logits = fma(mix, scales, base)    scales = (s0 ×N, s1 ×N, s2 ×N²)
    (pre, post, comb) = `kernels.mhc_mix` of the logits

The torch version (`mhc_triplet_reference`, below) is ~8 launches before `mhc_mix`'s one.

    launch 1  programs (tile of BLOCK_T tokens, slice of SPLIT_COLS columns): read the slice of
              each row once, fp32 dots with fn's 2N + N² rows and Σ z² → partials
              [splits, T, MIX_PAD] (column 2N + N² holds Σ z²)
    launch 2  per tile of tokens: the partials summed in split order, rsqrt, the fused
              multiply-add, then `mhc_mix`'s gates and Sinkhorn (`mix_and_store`)

The split and the tiles do not depend on T, so a row's sums are the same operations whatever
else is in the batch (by construction; batch-invariant mode still takes the torch steps). The
order of the fp32 sums differs from BLAS: pre / post / comb within ~2e-6 relative (norm) and
~60 ulps of the torch path at the released width (`tests/kernels/test_mhc_triplet.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.mhc_mix import mhc_mix_reference, mix_and_store

__all__ = ["mhc_logits_reference", "mhc_triplet", "mhc_triplet_reference"]

_BLOCK_T = 16
_BLOCK_K = 64
SPLIT_COLS = 512  # columns of N·D per program of launch 1


@triton.jit
def _mhc_partials_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    num_tokens,
    width,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    is_token = t < num_tokens
    m = tl.arange(0, MIX_PAD)
    rows = x_ptr + t[:, None].to(tl.int64) * width
    weights = fn_ptr + m[None, :].to(tl.int64) * width
    dots = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in tl.static_range(0, SPLIT, BLOCK_K):
        k = split * SPLIT + k0 + tl.arange(0, BLOCK_K)
        in_row = k < width
        x = tl.load(rows + k[None, :], mask=is_token[:, None] & in_row[None, :], other=0.0)
        x = x.to(tl.float32)
        w = tl.load(weights + k[:, None], mask=(m[None, :] < MIX) & in_row[:, None], other=0.0)
        dots = tl.dot(x, w.to(tl.float32), dots, input_precision="ieee")
        squares += tl.sum(x * x, axis=1)
    dots = tl.where(m[None, :] == MIX, squares[:, None], dots)
    out = (split.to(tl.int64) * num_tokens + t[:, None]) * MIX_PAD + m[None, :]
    tl.store(part_ptr + out, dots, mask=is_token[:, None])


@triton.jit
def _mhc_finish_kernel(
    part_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    num_splits,
    inv_width,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_token = t < num_tokens
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    gate_mask = is_token[:, None]
    cell_mask = is_token[:, None, None]
    cell = 2 * N + j[None, :, None] * N + i[None, None, :]
    row = part_ptr + t.to(tl.int64) * MIX_PAD
    split_stride = tl.full((), MIX_PAD, tl.int64) * num_tokens  # num_tokens may be a constexpr 1
    pre = tl.zeros((BLOCK_T, N), dtype=tl.float32)
    post = tl.zeros((BLOCK_T, N), dtype=tl.float32)
    comb = tl.zeros((BLOCK_T, N, N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for split in range(num_splits):  # a fixed order: no atomics
        p = row + split * split_stride
        pre += tl.load(p[:, None] + i[None, :], mask=gate_mask, other=0.0)
        post += tl.load(p[:, None] + N + i[None, :], mask=gate_mask, other=0.0)
        comb += tl.load(p[:, None, None] + cell, mask=cell_mask, other=0.0)
        squares += tl.load(p + (2 * N + N * N), mask=is_token, other=0.0)
    r = tl.rsqrt(squares * inv_width + norm_eps)
    # mix = dots · r, rounded, then one fused multiply-add, as the released kernel rounds it
    pre = tl.fma(
        pre * r[:, None],
        tl.load(scale_ptr).to(tl.float32),
        tl.load(base_ptr + i).to(tl.float32)[None, :],
    )
    post = tl.fma(
        post * r[:, None],
        tl.load(scale_ptr + 1).to(tl.float32),
        tl.load(base_ptr + N + i).to(tl.float32)[None, :],
    )
    comb = tl.fma(
        comb * r[:, None, None],
        tl.load(scale_ptr + 2).to(tl.float32),
        tl.load(base_ptr + cell).to(tl.float32),
    )
    mix_and_store(pre, post, comb, t, is_token, pre_ptr, post_ptr, comb_ptr, hc_eps, ITERS, N)


def mhc_triplet(
    residual: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_triplet_reference` in two launches: residual [T, N, D] (any float dtype), fn
    [2N + N², N·D], base [2N + N²], scale [3] → fp32 pre [T, N], post [T, N], comb [T, N, N].

    Raises:
        ValueError: shapes that do not fit together, N not a power of two, iters < 1, or not
            on CUDA (nor in Triton's interpreter).
    """
    if residual.dim() != 3 or not residual.dtype.is_floating_point:
        raise ValueError(f"residual must be float [T, N, D], got {residual.dtype} {residual.shape}")
    num_tokens, n, d = residual.shape
    mix = 2 * n + n * n
    if fn.shape != (mix, n * d) or base.shape != (mix,) or scale.shape != (3,):
        shapes = tuple(fn.shape), tuple(base.shape), tuple(scale.shape)
        raise ValueError(f"fn, base, scale must be [{mix}, {n * d}], [{mix}], [3], got {shapes}")
    if n < 1 or n & (n - 1) or iters < 1:
        raise ValueError(f"n must be a power of two and iters >= 1, got n={n}, iters={iters}")
    check_runnable(residual, "mhc_triplet")
    device = residual.device
    pre = torch.empty(num_tokens, n, dtype=torch.float32, device=device)
    post = torch.empty_like(pre)
    comb = torch.empty(num_tokens, n, n, dtype=torch.float32, device=device)
    if not num_tokens:
        return pre, post, comb
    width = n * d
    mix_pad = max(16, triton.next_power_of_2(mix + 1))
    num_splits = max(1, triton.cdiv(width, SPLIT_COLS))
    partials = torch.empty(num_splits, num_tokens, mix_pad, dtype=torch.float32, device=device)
    x = residual.reshape(num_tokens, width).contiguous()
    token_tiles = triton.cdiv(num_tokens, _BLOCK_T)
    _mhc_partials_kernel[(token_tiles, num_splits)](
        x,
        fn.contiguous(),
        partials,
        num_tokens,
        width,
        MIX=mix,
        MIX_PAD=mix_pad,
        BLOCK_T=_BLOCK_T,
        BLOCK_K=_BLOCK_K,
        SPLIT=SPLIT_COLS,
    )
    # torch's mean multiplies the sum by the fp32 reciprocal of the count: the float64 1/width
    # rounds to it (no double-rounding tie for integers below 2²⁴), as Triton passes it as fp32
    inv_width = 1.0 / width
    _mhc_finish_kernel[(token_tiles,)](
        partials,
        base.contiguous(),
        scale.contiguous(),
        pre,
        post,
        comb,
        num_tokens,
        num_splits,
        inv_width,
        norm_eps,
        hc_eps,
        ITERS=iters,
        N=n,
        MIX_PAD=mix_pad,
        BLOCK_T=_BLOCK_T,
    )
    return pre, post, comb


def mhc_logits_reference(mix: Tensor, base: Tensor, scale: Tensor, n: int) -> Tensor:
    """fp32 `mix · scales + base` [T, 2N + N²] with one rounding (scales: s0 for the N pre
    columns, s1 for the N post columns, s2 for the N² comb columns)."""
    scale = scale.float()
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    # One fused multiply-add, as the released kernel rounds it.
    return torch.addcmul(base.float(), mix, scales)


def mhc_triplet_reference(
    residual: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_triplet` in plain torch (BLAS's matmul, torch's mean)."""
    n = residual.shape[1]
    z = residual.flatten(1).float()
    mix = F.linear(z, fn.float()) * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)
    return mhc_mix_reference(mhc_logits_reference(mix, base, scale, n), n, hc_eps, iters)
