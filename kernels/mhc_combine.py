"""mHC stream combination in one launch (`model.md` §3.2):

    x[t, :] = Σ_k w[t, k] · R[t, k, :]     (fp32, cast to R's dtype)

The torch version (`mhc_combine_reference`, below) upcasts R, forms the [T, N, D] products
and reduces them over ~4 launches; here each program reads its token's N rows once.
`mhc_combine_norm` also applies the RMSNorm that always follows (`kernels.rms_norm`), one
program per whole row: one launch instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rms_norm import MAX_WIDTH, inv_rms, norm_warps, rms_norm_reference
from kernels.rounding import round_to

__all__ = ["mhc_combine", "mhc_combine_norm", "mhc_combine_norm_reference", "mhc_combine_reference"]

_BLOCK_D = 1024


@triton.jit
def _combine_streams(residual_ptr, weights_ptr, token, d, in_row, dim, N: tl.constexpr):
    """fp32 `Σ_k w[k] · R[k, d]` of one token over the columns d, as one fixed chain: w₀·r₀,
    then a fused multiply-add per further stream in stream order.

    NOTE: no plain add of products, so nothing is left for the compiler to contract into
    fused multiply-adds its own way (it did so differently per kernel and per column): every
    kernel that calls this gets the same bits for a column, whatever its tile or layout."""
    rows = residual_ptr + token * N * dim + d
    weights = weights_ptr + token * N
    acc = tl.load(weights) * tl.load(rows, mask=in_row, other=0.0).to(tl.float32)
    for k in tl.static_range(1, N):
        r = tl.load(rows + k * dim, mask=in_row, other=0.0).to(tl.float32)
        acc = tl.fma(r, tl.load(weights + k), acc)
    return acc


@triton.jit
def _mhc_combine_kernel(
    residual_ptr, weights_ptr, out_ptr, dim, N: tl.constexpr, BLOCK_D: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = d < dim
    out = _combine_streams(residual_ptr, weights_ptr, token, d, in_row, dim, N)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * dim + d, round_to(out, dtype).to(dtype), mask=in_row)


@triton.jit
def _mhc_combine_norm_kernel(
    residual_ptr, weights_ptr, norm_ptr, out_ptr, dim, eps, N: tl.constexpr, BLOCK: tl.constexpr
):
    """One token's whole row: the combination rounded to the model dtype (`_combine_streams`,
    as `_mhc_combine_kernel`), then `rms_norm`'s exact steps on it: `inv_rms` over the same
    [BLOCK] row, loaded from rows of the same dtype, with rms_norm's num_warps."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_row = d < dim
    dtype = out_ptr.dtype.element_ty
    x = round_to(_combine_streams(residual_ptr, weights_ptr, token, d, in_row, dim, N), dtype)
    y = x * inv_rms(x, dim, eps)
    y = y * tl.load(norm_ptr + d, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * dim + d, round_to(y, dtype).to(dtype), mask=in_row)


def _check(residual: Tensor, weights: Tensor) -> None:
    num_tokens, n, _ = residual.shape
    if n < 1 or n & (n - 1) or weights.shape != (num_tokens, n):
        raise ValueError(f"need residual [T, N, D] with N a power of two and weights [T, N]; "
                         f"got {tuple(residual.shape)}, {tuple(weights.shape)}")  # fmt: skip
    if weights.dtype != torch.float32:
        raise ValueError("weights must be fp32")
    check_runnable(residual, "mhc_combine")


def mhc_combine_norm(residual: Tensor, weights: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """`rms_norm(mhc_combine(residual, weights), norm_weight, eps)` in one launch, bit for bit
    the two kernels (the norm's input is the combination rounded to the model dtype).

    Raises:
        ValueError: as `mhc_combine`, a norm weight not of the row's width, rows wider than
            `rms_norm.MAX_WIDTH`.
    """
    num_tokens, n, dim = residual.shape
    if norm_weight.shape != (dim,) or dim > MAX_WIDTH:
        raise ValueError(f"norm weight [{dim}] for rows of at most {MAX_WIDTH}, got "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    _check(residual, weights)
    residual = residual.contiguous()
    out = torch.empty(num_tokens, dim, dtype=residual.dtype, device=residual.device)
    if num_tokens and dim:
        size = triton.next_power_of_2(dim)
        _mhc_combine_norm_kernel[(num_tokens,)](
            residual,
            weights.contiguous(),
            norm_weight.contiguous(),
            out,
            dim,
            eps,
            N=n,
            BLOCK=size,
            num_warps=norm_warps(size),  # rms_norm's: the same reduction
        )
    return out


def mhc_combine_norm_reference(
    residual: Tensor, weights: Tensor, norm_weight: Tensor, eps: float
) -> Tensor:
    """`mhc_combine_norm` in plain torch: the two references in turn."""
    return rms_norm_reference(mhc_combine_reference(residual, weights), norm_weight, eps)


def mhc_combine(residual: Tensor, weights: Tensor) -> Tensor:
    """`mhc_combine_reference` (with weights) in one launch: residual [T, N, D] in the model
    dtype, weights fp32 [T, N] → [T, D] in the model dtype.

    Raises:
        ValueError: other shapes or dtypes, N not a power of two, or not on CUDA.
    """
    num_tokens, n, dim = residual.shape
    _check(residual, weights)
    residual = residual.contiguous()
    out = torch.empty(num_tokens, dim, dtype=residual.dtype, device=residual.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, _BLOCK_D))
        _mhc_combine_kernel[grid](residual, weights.contiguous(), out, dim, N=n, BLOCK_D=_BLOCK_D)
    return out


def mhc_combine_reference(residual: Tensor, weights: Tensor) -> Tensor:
    """`mhc_combine` with weights, in plain torch."""
    return (weights.unsqueeze(-1) * residual.float()).sum(1).to(residual.dtype)
