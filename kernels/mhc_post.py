"""mHC residual update of one site in one launch (`model.md` §3.2):

    R'[t, i, :] = post[t, i] · y[t, :] + Σ_j comb[t, j, i] · R[t, j, :]   (fp32, cast to R's dtype)

The torch version (`mhc_post_reference`, below) materialises the
[T, N, N, D] fp32 products (1.3 GB for a 4K-token chunk at D = 5120) over ~7 launches; here each
program reads its token's N rows of R and y once and writes N rows of R'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rounding import round_to

__all__ = ["mhc_post", "mhc_post_reference"]

_BLOCK_D = 512


@triton.jit
def _mhc_post_kernel(
    residual_ptr,
    post_ptr,
    comb_ptr,
    y_ptr,
    out_ptr,
    dim,
    N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = d < dim
    streams = tl.arange(0, N)
    rows = token * N * dim + streams[:, None] * dim + d[None, :]
    residual = tl.load(residual_ptr + rows, mask=in_row[None, :], other=0.0).to(tl.float32)
    y = tl.load(y_ptr + token * dim + d, mask=in_row, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + token * N + streams)
    # comb[t, j, i]: j (source stream) on axis 0, i (target stream) on axis 1.
    comb = tl.load(comb_ptr + token * N * N + streams[:, None] * N + streams[None, :])
    mixed = tl.sum(comb[:, :, None] * residual[:, None, :], axis=0)  # [N (i), BLOCK_D]
    out = post[:, None] * y[None, :] + mixed
    tl.store(
        out_ptr + rows,
        round_to(out, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty),
        mask=in_row[None, :],
    )


def mhc_post(residual: Tensor, post: Tensor, comb: Tensor, y: Tensor) -> Tensor:
    """`mhc_post_reference` in one launch.

    residual [T, N, D] and y [T, D] in the model dtype; post fp32 [T, N]; comb fp32 [T, N, N].

    Raises:
        ValueError: shapes or dtypes other than those, N not a power of two, or not on CUDA.
    """
    num_tokens, n, dim = residual.shape
    if n < 1 or n & (n - 1) or y.shape != (num_tokens, dim):
        raise ValueError(f"need residual [T, N, D] with N a power of two and y [T, D]; got "
                         f"{tuple(residual.shape)}, {tuple(y.shape)}")  # fmt: skip
    if post.shape != (num_tokens, n) or comb.shape != (num_tokens, n, n):
        raise ValueError(f"post must be [T, {n}] and comb [T, {n}, {n}]")
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError("post and comb must be fp32")
    check_runnable(residual, "mhc_post")
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, _BLOCK_D))
        _mhc_post_kernel[grid](
            residual, post.contiguous(), comb.contiguous(), y, out, dim, N=n, BLOCK_D=_BLOCK_D
        )
    return out


def mhc_post_reference(residual: Tensor, post: Tensor, comb: Tensor, y: Tensor) -> Tensor:
    """`mhc_post` in plain torch."""
    update = post.unsqueeze(-1) * y.float().unsqueeze(1)
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(2)).sum(1)
    return (update + mixed).to(residual.dtype)
