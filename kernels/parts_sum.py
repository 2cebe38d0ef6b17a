"""The three partial products of a split operand added up, and scaled, in one launch, as
`parts_sum_reference` (below) computes them:

    y = ((p[0] + p[1]) + p[2]) · s       fp32 partials [3, M, N], fp32 s → fp32 [M, N]

in that order, each add and the product rounding to nearest in fp32, so the result is the
torch form's `(out[0] + out[1] + out[2]) * s` (two launches, three with s ≠ 1: torch multiplies
an fp32 tensor by a Python float as by that float rounded to fp32, as the launch passes it)
bit for bit. s = 1 changes no bit. The partials are the fp32 output of one bf16 GEMM over the
three `kernels.bf16_split` parts of x stacked as rows (`dense.fp32_times_bf16`): hi·Wᵀ, mid·Wᵀ,
lo·Wᵀ, largest first. (The product follows the adds: nothing for the compiler to contract into
a fused multiply-add.)

    grid (rows, cdiv(N, BLOCK)); each element independent, so the result is batch-invariant
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["parts_sum", "parts_sum_reference"]

_BLOCK = 1024


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one variant
def _parts_sum_kernel(parts_ptr, out_ptr, num_rows, width, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    offsets = row * width + cols
    # NOTE: the part stride num_rows · width keeps the divisibility of the (specialised) width.
    part_stride = num_rows.to(tl.int64) * width
    hi = tl.load(parts_ptr + offsets, mask=keep, other=0.0)
    mid = tl.load(parts_ptr + part_stride + offsets, mask=keep, other=0.0)
    lo = tl.load(parts_ptr + 2 * part_stride + offsets, mask=keep, other=0.0)
    tl.store(out_ptr + offsets, ((hi + mid) + lo) * scale, mask=keep)


def parts_sum(parts: Tensor, scale: float = 1.0) -> Tensor:
    """`parts_sum_reference(parts, scale)` in one launch: fp32 [3, ..., N] → fp32 [..., N]
    (contiguous).

    Raises:
        ValueError: not fp32 with three parts in the leading dimension, or not on CUDA (nor in
            Triton's interpreter).
    """
    if parts.dtype != torch.float32 or parts.dim() < 2 or parts.shape[0] != 3:
        raise ValueError(
            f"parts_sum takes fp32 parts [3, ..., N], got {parts.dtype} {tuple(parts.shape)}"
        )
    check_runnable(parts, "parts_sum")
    parts = parts.contiguous()
    width = parts.shape[-1]
    out = torch.empty(parts.shape[1:], dtype=torch.float32, device=parts.device)
    num_rows = out.numel() // max(width, 1)
    if num_rows and width:
        block = min(_BLOCK, triton.next_power_of_2(width))
        grid = (num_rows, triton.cdiv(width, block))
        _parts_sum_kernel[grid](parts, out, num_rows, width, float(scale), BLOCK=block)
    return out


def parts_sum_reference(parts: Tensor, scale: float = 1.0) -> Tensor:
    """fp32 [3, ..., N] → `parts[0] + parts[1] + parts[2]` (left to right), times `scale`
    unless it is 1."""
    total = parts[0] + parts[1] + parts[2]
    return total if scale == 1.0 else total * scale
