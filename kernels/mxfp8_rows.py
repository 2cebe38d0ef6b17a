"""MXFP8 window rows in one launch: the model's ``swa_mxfp8_quantize`` (reference:
`engine/models/deepseek_v41/kv_formats.py`, which `tests/kernels/test_mxfp8_rows.py` compares
bit for bit; `kernels` cannot import it).

Per block of 32 elements with amax = max |x| (all in float32):

    spec:        s = 2^ceil(log2(max(amax / 448, 1e-4)))
    nemo_floor:  s = 2^ceil(log2(max(amax, 1e-4) / 448))
    element = e4m3(x / s), nearest even, saturating at ±448

    row of D elements -> | e4m3 x[0] ... x[D-1] | ue8m0 s[0] ... s[D/32-1] |  (D + D/32 bytes)

The torch codec is ~25 launches per call; this is one. The divisions by 448 are IEEE
(`div_rn`); x / s is x * 2^-s, exact like the reference's division by a power of two; codes
and scales come from bits (`kernels.row_codes`).

NOTE: no code depends on float32 subnormals surviving (compiled for sm90 they do: `div.rn.f32`,
`mul.f32`): a subnormal amax ratio lies below the scale floor, a subnormal quotient below the
first e4m3 step, and signs come from x's bits. Rows holding NaN are not pinned to the reference.

    grid (rows / BLOCK_R): x viewed as [N, D], a tile of BLOCK_R rows per program
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.row_codes import ceil_log2, e4m3_code, load_float32, pow2

__all__ = ["AMAX_FLOOR", "mxfp8_rows_quantize", "scale_exponent"]

_BLOCK = 32
_TILE_ELEMENTS = 4096
AMAX_FLOOR = 1e-4  # kv_formats.SWA_AMAX_FLOOR


@triton.jit
def scale_exponent(amax, NEMO_FLOOR: tl.constexpr, FLOOR: tl.constexpr):
    """int32 exponent s of the scale 2^s of blocks whose largest |x| is `amax` (fp32), by the
    spec's rule or NeMo's floor (module docstring); every kernel writing MXFP8 rows calls it
    (`kernels.rms_norm_rope`'s encoded rows)."""
    if NEMO_FLOOR:
        ratio = tl.math.div_rn(tl.maximum(amax, FLOOR), 448.0)
    else:
        ratio = tl.maximum(tl.math.div_rn(amax, 448.0), FLOOR)
    return ceil_log2(ratio, -127, 127)


@triton.jit(do_not_specialize=["num_rows"])  # step-varying: one variant
def _mxfp8_quantize_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    x_row_stride,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NEMO_FLOOR: tl.constexpr,
    FLOOR: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    NUM_BLOCKS: tl.constexpr = BLOCK_D // 32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_row = rows < num_rows
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = is_row[:, None] & (cols < DIM)[None, :]
    x = load_float32(x_ptr, rows[:, None] * x_row_stride + cols[None, :], mask, BF16_BITS)
    x = tl.reshape(x, [BLOCK_R, NUM_BLOCKS, 32])
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_R, NUM_BLOCKS]
    exponent = scale_exponent(amax, NEMO_FLOOR, FLOOR)
    y = tl.reshape(x * pow2(-exponent)[:, :, None], [BLOCK_R, BLOCK_D])
    out_rows = rows * (DIM + DIM // 32)
    tl.store(out_ptr + out_rows[:, None] + cols[None, :], e4m3_code(y).to(tl.uint8), mask=mask)
    blocks = tl.arange(0, NUM_BLOCKS)
    scale_mask = is_row[:, None] & (blocks < DIM // 32)[None, :]
    scale_offsets = out_rows[:, None] + DIM + blocks[None, :]
    tl.store(out_ptr + scale_offsets, (exponent + 127).to(tl.uint8), mask=scale_mask)


def mxfp8_rows_quantize(x: Tensor, *, nemo_floor: bool = False) -> Tensor:
    """``kv_formats.swa_mxfp8_quantize`` in one launch: float[..., D] -> uint8[..., D + D/32].

    Raises:
        TypeError: x not floating point.
        ValueError: D not a positive multiple of 32, or not on CUDA (or the interpreter).
    """
    if not x.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {x.dtype}")
    dim = x.shape[-1] if x.dim() else 0
    if dim <= 0 or dim % _BLOCK:
        raise ValueError(f"row width {dim} must be a positive multiple of {_BLOCK}")
    check_runnable(x, "mxfp8_rows_quantize")
    if x.dtype == torch.float64:
        x = x.to(torch.float32)  # the reference rounds float64 to float32 first
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], dim + dim // _BLOCK), dtype=torch.uint8, device=x.device)
    num_rows = rows.shape[0]
    if num_rows:
        block_d = triton.next_power_of_2(dim)
        # a function of the width alone: one compiled variant for every row count
        block_r = max(1, _TILE_ELEMENTS // block_d)
        _mxfp8_quantize_kernel[(triton.cdiv(num_rows, block_r),)](
            rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows,
            out,
            num_rows,
            rows.stride(0),
            DIM=dim,
            BLOCK_D=block_d,
            BLOCK_R=block_r,
            NEMO_FLOOR=nemo_floor,
            FLOOR=AMAX_FLOOR,
            BF16_BITS=rows.dtype == torch.bfloat16,
        )
    return out
