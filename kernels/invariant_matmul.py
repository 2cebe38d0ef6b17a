"""A dense matmul whose every output element has one fixed reduction order (batch invariance).

    out[m, n] = Σ_k x[m, k] · w[n, k]        x [M, K], w [N, K] (a linear layer's weight)

cuBLAS (and MKL) pick a kernel per shape: a small M may run split-K, another tile, another
instruction shape, so a row's result changes with the number of rows it is computed with. Here
the tile shape is a constant (`BLOCK_M` × `BLOCK_N`), K is walked in steps of the constant
`BLOCK_K` from 0 up, one program per output tile, no split-K and no atomics: element (m, n) is
the same sequence of tile dots whatever M is and whatever the other rows hold (rows past M are
masked to zero and never mix into a row: a dot's rows are independent).

    grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); acc fp32 [BLOCK_M, BLOCK_N]; out in x's dtype

fp32 operands use IEEE fp32 dots (no TF32), bf16 / fp16 ones tensor cores with fp32
accumulation. `invariant_matmul` is the launcher; `invariant_matmul_reference` the torch
reference (same maths, the backend's own order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "invariant_matmul", "invariant_matmul_reference"]

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
_NUM_WARPS, _NUM_STAGES = 4, 3
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])  # step-varying: one variant
def _invariant_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_row = rows < M
    is_col = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=is_row[:, None] & in_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + k[:, None],
            mask=is_col[None, :] & in_k[:, None],
            other=0.0,
        )
        acc = tl.dot(x, w, acc, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_col[None, :])


def invariant_matmul(x: Tensor, weight: Tensor) -> Tensor:
    """`x · weightᵀ` [M, N] in x's dtype, each element in one fixed order (module docstring).

    x: [M, K]; weight: [N, K], both fp32, bf16 or fp16 of one dtype, unit column stride.

    Raises:
        ValueError: other ranks, dtypes or strides, K mismatch, or neither CUDA nor Triton's
            CPU interpreter.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need x [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_DTYPES}; got {x.dtype}, {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need unit column stride")
    check_runnable(x, "invariant_matmul")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _invariant_matmul_kernel[grid](
            x,
            weight,
            out,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            num_warps=_NUM_WARPS,
            num_stages=_NUM_STAGES,
        )
    return out


def invariant_matmul_reference(x: Tensor, weight: Tensor) -> Tensor:
    """`invariant_matmul` in plain torch (fp32 accumulation; the backend's reduction order)."""
    return (x.float() @ weight.float().t()).to(x.dtype)
