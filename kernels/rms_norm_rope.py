"""RMSNorm, then RoPE of the normalised row, in one launch (`model.md` §3.1, §3.3):

    y = cast(f32(x) · rsqrt(mean(f32(x)²) + eps) · f32(w))          (`kernels.rms_norm`)
    out = y with its trailing 2·len(freqs) channels rotated by pos·f  (`kernels.rope`)

The attention normalises and then rotates the same rows several times a layer: its window row
(`kv_norm`), and in KV-source layers the compressed latent (`compressor.norm`) and the index
key (`indexer.k_norm`); two launches each before. The rotation reads the norm's output rounded to
the row's dtype, as the rope kernel reads it from memory, so the result is bit for bit
`apply_rope(rms_norm(x, w, eps), positions, freqs)` of the two kernels: the same `inv_rms` over
the same [BLOCK] row with rms_norm's num_warps (its NOTE), the same products, and the angle,
cos/sin and rotation through `kernels.rope`'s device functions. `keep_normed` also returns the
unrotated norm output (the compressor's latent feeds the index key's projection).

    grid (rows,): one program per row of x [N, D], positions [N]; the row whole in registers
    for the norm, then as [D/2] even and odd halves for the pairs
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting
from kernels.rms_norm import MAX_WIDTH, as_rows, inv_rms, norm_warps, rms_norm_reference
from kernels.rope import apply_rope_reference, cos_sin, rotate
from kernels.rounding import round_to

__all__ = ["rms_norm_rope", "rms_norm_rope_reference"]

# Triton's CPU interpreter has no libdevice (`kernels.rope`).
_LIBDEVICE = not interpreting()


@triton.jit
def _normed_channels(x_ptr, weight_ptr, row_start, cols, mask, scale, dtype: tl.constexpr):
    """rms_norm's output at columns `cols` of one row, rounded to `dtype` (held as fp32): the
    kernel's `(x · scale) · w`, element by element."""
    x = tl.load(x_ptr + row_start + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return round_to(x * scale * weight, dtype)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,
    weight_ptr,
    position_ptr,
    freq_ptr,
    out_ptr,
    normed_ptr,
    width,
    x_row_stride,
    pass_pairs,
    eps,
    BLOCK: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < width, other=0.0).to(tl.float32)
    scale = inv_rms(x, width, eps)  # rms_norm's reduction: the whole [BLOCK] row
    dtype = out_ptr.dtype.element_ty
    pairs = tl.arange(0, BLOCK // 2)
    in_row = pairs < width // 2
    even = 2 * pairs
    a = _normed_channels(x_ptr, weight_ptr, row * x_row_stride, even, in_row, scale, dtype)
    b = _normed_channels(x_ptr, weight_ptr, row * x_row_stride, even + 1, in_row, scale, dtype)
    if KEEP_NORMED:
        tl.store(normed_ptr + row * width + even, a.to(dtype), mask=in_row)
        tl.store(normed_ptr + row * width + even + 1, b.to(dtype), mask=in_row)
    is_rotated = in_row & (pairs >= pass_pairs)
    freq = tl.load(freq_ptr + pairs - pass_pairs, mask=is_rotated, other=0.0)
    c, s = cos_sin(tl.load(position_ptr + row).to(tl.float32) * freq, 1.0, LIBDEVICE)
    rotated_even, rotated_odd = rotate(a, b, c, s)
    a = tl.where(is_rotated, round_to(rotated_even, dtype), a)
    b = tl.where(is_rotated, round_to(rotated_odd, dtype), b)
    tl.store(out_ptr + row * width + even, a.to(dtype), mask=in_row)
    tl.store(out_ptr + row * width + even + 1, b.to(dtype), mask=in_row)


def rms_norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    keep_normed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(`apply_rope(rms_norm(x, weight, eps), positions, freqs)`, the unrotated
    `rms_norm(x, weight, eps)` when `keep_normed`, else None) in one launch, bit for bit the two
    kernels.

    x: [..., D] rows (strided rows too, as `rms_norm`); weight: [D]; positions: int [...],
    x's leading shape (one per row); freqs: fp32 [D_rot / 2], the rotated tail's frequencies
    (`rope_frequencies`). Outputs are contiguous.

    Raises:
        ValueError: positions not of x's leading shape, a weight of another width, rows wider
            than `rms_norm.MAX_WIDTH` or odd, a rotated tail wider than the row, or not on CUDA
            (or Triton's interpreter).
    """
    width, half = x.shape[-1], freqs.numel()
    if tuple(positions.shape) != tuple(x.shape[:-1]) or weight.shape != (width,):
        raise ValueError(
            f"need positions of x's leading shape and a weight of its width; got x "
            f"{tuple(x.shape)}, positions {tuple(positions.shape)}, weight {tuple(weight.shape)}"
        )
    if width > MAX_WIDTH or width % 2 or 2 * half > width:
        raise ValueError(f"rows of an even width up to {MAX_WIDTH} holding the {2 * half} "
                         f"rotated channels; got {width}")  # fmt: skip
    check_runnable(x, "rms_norm_rope")
    rows = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(out) if keep_normed else None
    num_rows = rows.shape[0]
    if num_rows and width:
        block = triton.next_power_of_2(width)
        _rms_norm_rope_kernel[(num_rows,)](
            rows,
            weight.contiguous(),
            positions.contiguous(),
            freqs.to(device=x.device, dtype=torch.float32).contiguous(),
            out,
            normed if normed is not None else out,
            width,
            rows.stride(0),
            width // 2 - half,
            eps,
            BLOCK=block,
            KEEP_NORMED=keep_normed,
            LIBDEVICE=_LIBDEVICE,
            num_warps=norm_warps(block),  # rms_norm's: the same reduction
        )
    return out, normed


def rms_norm_rope_reference(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    keep_normed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`rms_norm_rope` in plain torch: the two references in turn."""
    normed = rms_norm_reference(x, weight, eps)
    return apply_rope_reference(normed, positions, freqs), normed if keep_normed else None
