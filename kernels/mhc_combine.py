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
from kernels.rms_norm import MAX_WIDTH, rms_norm_reference
from kernels.rounding import round_to

__all__ = ["mhc_combine", "mhc_combine_norm", "mhc_combine_norm_reference", "mhc_combine_reference"]

_BLOCK_D = 1024


@triton.jit
def _mhc_combine_kernel(
    residual_ptr, weights_ptr, out_ptr, dim, N: tl.constexpr, BLOCK_D: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = d < dim
    streams = tl.arange(0, N)
    rows = token * N * dim + streams[:, None] * dim + d[None, :]
    residual = tl.load(residual_ptr + rows, mask=in_row[None, :], other=0.0).to(tl.float32)
    weights = tl.load(weights_ptr + token * N + streams)
    out = tl.sum(weights[:, None] * residual, axis=0)
    tl.store(
        out_ptr + token * dim + d,
        round_to(out, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
        mask=in_row,
    )


@triton.jit
def _mhc_combine_norm_kernel(
    residual_ptr, weights_ptr, norm_ptr, out_ptr, dim, eps, N: tl.constexpr, BLOCK: tl.constexpr
):
    """One token's whole row: the combination rounded to the model dtype, then `rms_norm`'s
    exact steps on it (`kernels.rms_norm`: the same sum over the same [BLOCK] row)."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_row = d < dim
    streams = tl.arange(0, N)
    rows = token * N * dim + streams[:, None] * dim + d[None, :]
    residual = tl.load(residual_ptr + rows, mask=in_row[None, :], other=0.0).to(tl.float32)
    weights = tl.load(weights_ptr + token * N + streams)
    dtype = out_ptr.dtype.element_ty
    x = round_to(tl.sum(weights[:, None] * residual, axis=0), dtype)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
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
            num_warps=min(16, max(1, size // 512)),  # rms_norm's: the same reduction
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
