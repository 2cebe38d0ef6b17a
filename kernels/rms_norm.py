"""RMSNorm of rows in one launch (`model.md` §3.1):

    y = cast_out(f32(x) · rsqrt(mean(f32(x)²) + eps) · f32(w))      (weightless when w is None)

The torch version (`rms_norm_reference`, below) is ~6 launches;
the model normalises ~8 times per layer. One program per row, the whole row in registers.

Rows may be strided (one stride between rows, unit stride within: a view of a wider GEMM
output, such as the attention's packed `wq_a`/`wkv` projection); the output is contiguous.

`rms_norm_fp8` also emits the FP8 activation codes and per-32 scales of its output for the FP8
dense GEMM that follows a norm (`kernels.fp8_block_gemm`, the codes input): the same bytes as
`quantize_activations(rms_norm(x, w, eps))` in one launch instead of two.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.fp8_block_gemm import quantize_slab
from kernels.rounding import round_to

__all__ = ["as_rows", "inv_rms", "norm_warps", "rms_norm", "rms_norm_fp8", "rms_norm_reference"]

MAX_WIDTH = 16384


def as_rows(x: Tensor) -> Tensor:
    """x [..., D] as rows [N, D] with unit column stride: a view where x's leading dims merge
    into one row stride (a column slice of a wider tensor does), else a contiguous copy."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return rows if rows.stride(-1) == 1 or x.shape[-1] <= 1 else rows.contiguous()


def norm_warps(block: int) -> int:
    """num_warps of a program holding a whole row of `block` (a power of two) elements: the
    launch option `inv_rms`'s reduction order depends on (its NOTE)."""
    return min(16, max(1, block // 512))


@triton.jit
def inv_rms(x, width, eps):
    """`rsqrt(Σ x² / width + eps)` of one row held as a [BLOCK] fp32 tensor (zeros past width).

    NOTE: each square is an explicit fused multiply-add onto +0 (exactly the rounded x²), so the
    compiler has no multiply to contract into the sum's adds; it contracts plain `x * x` into
    some of them, picked per program, so two kernels could sum the same row differently. Any
    kernel calling this on a row in the same layout (same BLOCK, num_warps and load dtype) gets
    the same bits (`kernels.mhc_combine.mhc_combine_norm` relies on it)."""
    return tl.rsqrt(tl.sum(tl.fma(x, x, 0.0), axis=0) / width + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    codes_ptr,
    scale_ptr,
    width,
    x_row_stride,
    eps,
    HAS_WEIGHT: tl.constexpr,
    EMIT_FP8: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    y = x * inv_rms(x, width, eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    y = round_to(y, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, y, mask=in_row)
    if EMIT_FP8:
        # the codes of the rounded output, as a consumer reading `out` would quantize it
        codes, biased = quantize_slab(tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP)))
        group_cols = tl.reshape(cols, (BLOCK // GROUP, GROUP))
        tl.store(codes_ptr + row * width + group_cols, codes, mask=group_cols < width)
        groups = tl.arange(0, BLOCK // GROUP)
        num_groups = width // GROUP
        scales = biased.to(tl.uint8)
        tl.store(scale_ptr + row * num_groups + groups, scales, mask=groups < num_groups)


def _launch(
    x: Tensor, weight: Tensor | None, eps: float, fp8_block: int | None, name: str
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Check, allocate and run `_rms_norm_kernel`: (out, codes, raw scale bytes); the codes
    and scales only when `fp8_block` is given."""
    width = x.shape[-1]
    if width > MAX_WIDTH or (weight is not None and weight.shape != (width,)):
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"rows of at most {MAX_WIDTH}, weight of their width; got {width}, {got}")
    if fp8_block is not None and (
        fp8_block < 16 or fp8_block & (fp8_block - 1) or width % fp8_block
    ):
        raise ValueError(f"the width ({width}) must be a multiple of the block ({fp8_block})")
    check_runnable(x, name)
    rows = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    codes = scales = None
    if fp8_block is not None:
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty(
            (*x.shape[:-1], width // fp8_block), dtype=torch.uint8, device=x.device
        )
    num_rows = rows.shape[0]
    if num_rows and width:
        size = max(triton.next_power_of_2(width), fp8_block or 1)
        _rms_norm_kernel[(num_rows,)](
            rows,
            weight.contiguous() if weight is not None else x,
            out,
            codes if codes is not None else x,
            scales if scales is not None else x,
            width,
            rows.stride(0),
            eps,
            HAS_WEIGHT=weight is not None,
            EMIT_FP8=fp8_block is not None,
            BLOCK=size,
            GROUP=fp8_block or 1,
            num_warps=norm_warps(size),
        )
    return out, codes, scales


def rms_norm_fp8(
    x: Tensor, weight: Tensor | None, eps: float, block: int = 32
) -> tuple[Tensor, Tensor, Tensor]:
    """(`rms_norm(x, weight, eps)`, its FP8 codes, its float8_e8m0fnu scales per `block`
    columns) in one launch; codes and scales equal `quantize_activations` of the output.

    Raises:
        ValueError: as `rms_norm`, or a width that is not a multiple of `block` (a power of
            two ≥ 16).
    """
    out, codes, scales = _launch(x, weight, eps, block, "rms_norm_fp8")
    return out, codes, scales.view(torch.float8_e8m0fnu)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`rms_norm_reference` in one launch, over the last dimension of `x` (any leading shape).

    Raises:
        ValueError: a last dimension wider than MAX_WIDTH, a weight of another width, or not on
            CUDA.
    """
    return _launch(x, weight, eps, None, "rms_norm")[0]


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`rms_norm` in plain torch."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
