"""mHC stream combination in one launch (`model.md` §3.2):

    x[t, :] = Σ_k w[t, k] · R[t, k, :]     (fp32, cast to R's dtype)

The torch version (`mhc_combine_reference`, below) upcasts R, forms the [T, N, D] products
and reduces them over ~4 launches; here each program reads its token's N rows once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rounding import round_to

__all__ = ["mhc_combine", "mhc_combine_reference"]

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


def mhc_combine(residual: Tensor, weights: Tensor) -> Tensor:
    """`mhc_combine_reference` (with weights) in one launch: residual [T, N, D] in the model
    dtype, weights fp32 [T, N] → [T, D] in the model dtype.

    Raises:
        ValueError: other shapes or dtypes, N not a power of two, or not on CUDA.
    """
    num_tokens, n, dim = residual.shape
    if n < 1 or n & (n - 1) or weights.shape != (num_tokens, n):
        raise ValueError(f"need residual [T, N, D] with N a power of two and weights [T, N]; "
                         f"got {tuple(residual.shape)}, {tuple(weights.shape)}")  # fmt: skip
    if weights.dtype != torch.float32:
        raise ValueError("weights must be fp32")
    check_runnable(residual, "mhc_combine")
    residual = residual.contiguous()
    out = torch.empty(num_tokens, dim, dtype=residual.dtype, device=residual.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, _BLOCK_D))
        _mhc_combine_kernel[grid](residual, weights.contiguous(), out, dim, N=n, BLOCK_D=_BLOCK_D)
    return out


def mhc_combine_reference(residual: Tensor, weights: Tensor) -> Tensor:
    """`mhc_combine` with weights, in plain torch."""
    return (weights.unsqueeze(-1) * residual.float()).sum(1).to(residual.dtype)
