"""RMSNorm of rows in one launch (`model.md` §3.1):

    y = cast_out(f32(x) · rsqrt(mean(f32(x)²) + eps) · f32(w))      (weightless when w is None)

The torch version (`rms_norm_reference`, below) is ~6 launches;
the model normalises ~8 times per layer. One program per row, the whole row in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["rms_norm", "rms_norm_reference"]

MAX_WIDTH = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, width, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=in_row, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=in_row)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`rms_norm_reference` in one launch, over the last dimension of `x` (any leading shape).

    Raises:
        ValueError: a last dimension wider than MAX_WIDTH, a weight of another width, or not on
            CUDA.
    """
    width = x.shape[-1]
    if width > MAX_WIDTH or (weight is not None and weight.shape != (width,)):
        got = None if weight is None else tuple(weight.shape)
        raise ValueError(f"rows of at most {MAX_WIDTH}, weight of their width; got {width}, {got}")
    check_runnable(x, "rms_norm")
    x = x.contiguous()
    out = torch.empty_like(x)
    num_rows = x.numel() // max(width, 1)
    if num_rows and width:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(num_rows,)](
            x,
            weight.contiguous() if weight is not None else x,
            out,
            width,
            eps,
            HAS_WEIGHT=weight is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`rms_norm` in plain torch."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
