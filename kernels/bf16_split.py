"""An fp32 value split exactly into three bf16 parts, in one launch, as
`bf16_split_reference` (below) rounds them:

    hi = bf16(x),  mid = bf16(x − hi),  lo = bf16(x − hi − mid)      x = hi + mid + lo

Each cast rounds to nearest even; both differences are exact in fp32 (a value minus its
rounding to a shorter significand), and so is the last part: x's 24 significant bits fit in
three 8-bit parts (for |x| ≥ 2⁻¹¹⁰, where lo stays a normal bf16). The model multiplies the
parts, stacked as rows, by a bf16 weight in one tensor-core GEMM with fp32 output: three exact
partial products of f32(x) · f32(W)ᵀ (`dense.fp32_times_bf16`, `kernels.parts_sum`). The torch
form is ~8 launches (three casts down, two up, two subtractions, a stack).

The casts round from the bits (`kernels.rounding.round_to`): Triton's CPU interpreter truncates
an fp32 → bf16 cast where the GPU rounds to nearest, so a plain cast would test another
rounding in the interpreter than the GPU runs; the final casts then only narrow values already
exact in bf16. (`kernels.mhc_triplet` splits its own operands by truncation: other parts, the
same sum.)

    grid (rows, cdiv(K, BLOCK)): x rows [M, K] (fp32 or bf16, any row stride) → parts [3, M, K]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rounding import round_to

__all__ = ["bf16_split", "bf16_split_reference"]

_BLOCK = 1024


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one variant
def _bf16_split_kernel(x_ptr, parts_ptr, num_rows, width, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    x = tl.load(x_ptr + row * row_stride + cols, mask=keep, other=0.0).to(tl.float32)
    hi = round_to(x, tl.bfloat16)
    rest = x - hi
    mid = round_to(rest, tl.bfloat16)
    lo = round_to(rest - mid, tl.bfloat16)
    # NOTE: the part stride num_rows · width keeps the divisibility of the (specialised) width.
    out = parts_ptr + row * width + cols
    part_stride = num_rows.to(tl.int64) * width
    tl.store(out, hi.to(tl.bfloat16), mask=keep)
    tl.store(out + part_stride, mid.to(tl.bfloat16), mask=keep)
    tl.store(out + 2 * part_stride, lo.to(tl.bfloat16), mask=keep)


def bf16_split(x: Tensor) -> Tensor:
    """`bf16_split_reference(x)` in one launch: x [..., K] fp32 or bf16 → bf16 [3, ..., K]
    (contiguous; `parts.view(-1, K)` stacks them as rows). x's rows are read in place at their
    stride when its leading dimensions flatten to one (other layouts are copied first).

    Raises:
        ValueError: another dtype, or not on CUDA (nor in Triton's interpreter).
    """
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16_split takes fp32 or bf16 rows, got {x.dtype}")
    check_runnable(x, "bf16_split")
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    parts = torch.empty((3, *x.shape), dtype=torch.bfloat16, device=x.device)
    if num_rows and width:
        block = min(_BLOCK, triton.next_power_of_2(width))
        grid = (num_rows, triton.cdiv(width, block))
        _bf16_split_kernel[grid](rows, parts, num_rows, width, rows.stride(0), BLOCK=block)
    return parts


def bf16_split_reference(x: Tensor) -> Tensor:
    """x [..., K] (fp32, or bf16: then mid = lo = 0) → bf16 [3, ..., K] with
    f32(x) = Σ parts exactly (for |x| ≥ 2⁻¹¹⁰: the last part stays a normal bf16)."""
    x = x.float()
    hi = x.bfloat16()
    rest = x - hi.float()
    mid = rest.bfloat16()
    return torch.stack((hi, mid, (rest - mid.float()).bfloat16()))
