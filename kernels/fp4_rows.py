"""FP4 (e2m1) KV rows in one launch: the model's index rows (ue8m0 scale per 32) and global
rows (e4m3 scale per 16). References: `engine/models/deepseek_v41/kv_formats.py`
(``index_fp4_quantize`` / ``index_fp4_round_trip`` / ``index_fp4_dequantize`` /
``global_fp4_quantize``), compared bit for bit by `tests/kernels/test_fp4_rows.py` (`kernels`
cannot import them).

Per block of G elements with amax = max |x| (all in float32):

    index (G = 32):   s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))
    global (G = 16):  s = e4m3(clamp(amax / 6, 2^-9, 448))       (clamp_scale, the spec)
                      s = amax / 6 >= 2^-9 rounded to 3 mantissa bits  (NeMo: no 448 ceiling)
    code = e2m1(x / s), nearest, ties to the even code, saturating at ±6

    row of D elements -> | c1<<4|c0 ... c[D-1]<<4|c[D-2] | scale bytes, one per G |

The torch codec is ~20 launches per call (~40 for the round trip decode(encode(x)) the
indexer's queries take); each of these is one. The indexer's queries are rotated just before
their round trip: `index_fp4_rows_rotated_round_trip` takes the RoPE in the same launch, on the
loaded pairs, rounded to the input dtype as `kernels.rope` stores them (its device functions),
so it is bit for bit the two launches. Divisions are IEEE (`div_rn`), a division by a
power of two is a product with its exact inverse, codes and values come from bits
(`kernels.row_codes`).

NOTE: compiled for sm90 the divisions are `div.rn.f32` and the products `mul.f32`, neither
flushing subnormals (`test_fp4_rows.py` reads the PTX). Index rows whose elements are
subnormal (scales near 2^-126) depend on that; elsewhere a flush would change no code (a
subnormal ratio lies below the scale floor, a subnormal quotient below the first e2m1 step, and
signs come from x's bits). Rows holding NaN are not pinned to the
reference.

    grid (rows / BLOCK_R): rows viewed as [N, D] (or [N, row bytes]), a tile of BLOCK_R rows
    per program; a row tile is loaded whole and split into its even and odd elements
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting
from kernels.rope import cos_sin, rotate
from kernels.rounding import round_to
from kernels.row_codes import (
    ceil_log2,
    e2m1_code,
    e2m1_scaled,
    e2m1_value,
    e4m3_code,
    e4m3_round_wide,
    e4m3_value,
    load_float32,
    pow2,
    store_float32,
    ue8m0_value,
)

__all__ = [
    "global_fp4_rows_quantize",
    "index_fp4_rows_dequantize",
    "index_fp4_rows_quantize",
    "index_fp4_rows_rotated_round_trip",
    "index_fp4_rows_round_trip",
]

INDEX_BLOCK = 32
GLOBAL_BLOCK = 16
_TILE_PAIRS = 2048
_INDEX_AMAX_FLOOR = 6.0 * 2.0**-126  # kv_formats.INDEX_AMAX_FLOOR
_GLOBAL_SCALE_MIN = 2.0**-9  # kv_formats.GLOBAL_SCALE_MIN
_NAN_BYTE = 0x7F  # an e4m3 scale byte no finite scale <= 448 encodes to
# Triton's CPU interpreter has no libdevice (`kernels.rope`).
_LIBDEVICE = not interpreting()


@triton.jit
def _rotated_pairs(
    x_even, x_odd, rows, is_row, pairs, mask, position_ptr, freq_ptr, rows_per_position,
    pass_pairs, DTYPE: tl.constexpr, ONE_POSITION: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    """`kernels.rope`'s rotation of the pairs [BLOCK_R, BLOCK_HALF] at or past `pass_pairs`
    (row r at position `position[r // rows_per_position]`), rounded to `DTYPE` as that kernel
    stores it; the other pairs unchanged. ONE_POSITION: every row of the tile shares the first
    row's position, whose angles are taken once for the tile (the same values)."""
    is_rotated = mask & (pairs >= pass_pairs)[None, :]
    freq = tl.load(freq_ptr + pairs - pass_pairs, mask=pairs >= pass_pairs, other=0.0)
    if ONE_POSITION:
        position = tl.load(position_ptr + tl.min(rows) // rows_per_position)
        c, s = cos_sin(position.to(tl.float32) * freq, 1.0, LIBDEVICE)
        c, s = c[None, :], s[None, :]
    else:
        position = tl.load(position_ptr + rows // rows_per_position, mask=is_row, other=0)
        c, s = cos_sin(position.to(tl.float32)[:, None] * freq[None, :], 1.0, LIBDEVICE)
    rotated_even, rotated_odd = rotate(x_even, x_odd, c, s)
    x_even = tl.where(is_rotated, round_to(rotated_even, DTYPE), x_even)
    return x_even, tl.where(is_rotated, round_to(rotated_odd, DTYPE), x_odd)


@triton.jit(do_not_specialize=["num_rows"])  # step-varying: one variant
def _fp4_quantize_kernel(
    x_ptr,
    out_ptr,
    position_ptr,
    freq_ptr,
    num_rows,
    x_row_stride,
    rows_per_position,
    pass_pairs,
    DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
    E4M3_SCALE: tl.constexpr,
    CLAMP_SCALE: tl.constexpr,
    ROUND_TRIP: tl.constexpr,
    ROTATE: tl.constexpr,
    ONE_POSITION: tl.constexpr,
    IN_BF16_BITS: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    PAIRS: tl.constexpr = GROUP // 2
    NUM_BLOCKS: tl.constexpr = BLOCK_HALF // PAIRS
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_row = rows < num_rows
    rows = rows.to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    mask = is_row[:, None] & (pairs < DIM // 2)[None, :]
    # the row as one contiguous [BLOCK_R, 2 · BLOCK_HALF] tile (wide loads), pairs split in
    # registers
    channels = tl.arange(0, 2 * BLOCK_HALF)
    row_mask = is_row[:, None] & (channels < DIM)[None, :]
    x = load_float32(
        x_ptr, rows[:, None] * x_row_stride + channels[None, :], row_mask, IN_BF16_BITS
    )
    x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_R, BLOCK_HALF, 2]))
    if ROTATE:  # the indexer's queries: RoPE first, as `kernels.rope` (rows masked past the end)
        x_even, x_odd = _rotated_pairs(
            x_even, x_odd, rows, is_row, pairs, mask, position_ptr, freq_ptr, rows_per_position,
            pass_pairs, tl.bfloat16 if IN_BF16_BITS else tl.float32, ONE_POSITION, LIBDEVICE,
        )  # fmt: skip
    x_even = tl.reshape(x_even, [BLOCK_R, NUM_BLOCKS, PAIRS])
    x_odd = tl.reshape(x_odd, [BLOCK_R, NUM_BLOCKS, PAIRS])
    amax = tl.maximum(tl.max(tl.abs(x_even), axis=2), tl.max(tl.abs(x_odd), axis=2))
    if E4M3_SCALE:
        ratio = tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125)  # 2^-9
        if CLAMP_SCALE:
            ratio = tl.minimum(ratio, 448.0)
        # NeMo's unclamped scale: above 464 it rounds above 448 and has no byte (0x7F, which
        # the launcher raises for); up to 464 it rounds to 448 as e4m3 saturates.
        scale_byte = tl.where(e4m3_round_wide(ratio) > 448.0, 0x7F, e4m3_code(ratio))
        scale = e4m3_value(scale_byte)
        y_even = tl.math.div_rn(x_even, scale[:, :, None])
        y_odd = tl.math.div_rn(x_odd, scale[:, :, None])
    else:
        ratio = tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0)
        exponent = ceil_log2(ratio, -127, 127)
        inverse = pow2(-exponent)[:, :, None]
        y_even = x_even * inverse
        y_odd = x_odd * inverse
        scale_byte = exponent + 127
    code_even = e2m1_code(y_even, x_even)
    code_odd = e2m1_code(y_odd, x_odd)
    if ROUND_TRIP:
        tl.static_assert(not E4M3_SCALE)  # index rows only
        value_even = e2m1_scaled(code_even, exponent[:, :, None])
        value_odd = e2m1_scaled(code_odd, exponent[:, :, None])
        value = tl.join(
            tl.reshape(value_even, [BLOCK_R, BLOCK_HALF]),
            tl.reshape(value_odd, [BLOCK_R, BLOCK_HALF]),
        )
        value = tl.reshape(value, [BLOCK_R, 2 * BLOCK_HALF])
        out = rows[:, None] * DIM + channels[None, :]
        store_float32(out_ptr, out, value, row_mask, OUT_BF16_BITS)
    else:
        out_rows = rows * (DIM // 2 + DIM // GROUP)
        packed = tl.reshape(code_even | (code_odd << 4), [BLOCK_R, BLOCK_HALF])
        tl.store(out_ptr + out_rows[:, None] + pairs[None, :], packed.to(tl.uint8), mask=mask)
        blocks = tl.arange(0, NUM_BLOCKS)
        scale_mask = is_row[:, None] & (blocks < DIM // GROUP)[None, :]
        scale_offsets = out_rows[:, None] + DIM // 2 + blocks[None, :]
        tl.store(out_ptr + scale_offsets, scale_byte.to(tl.uint8), mask=scale_mask)


@triton.jit(do_not_specialize=["num_rows"])  # step-varying: one variant
def _index_fp4_dequantize_kernel(
    packed_ptr,
    out_ptr,
    num_rows,
    packed_row_stride,
    DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
):
    NUM_BLOCKS: tl.constexpr = BLOCK_HALF // 16
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    is_row = rows < num_rows
    rows = rows.to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    mask = is_row[:, None] & (pairs < DIM // 2)[None, :]
    row_start = rows[:, None] * packed_row_stride
    data = tl.load(packed_ptr + row_start + pairs[None, :], mask=mask, other=0).to(tl.int32)
    blocks = tl.arange(0, NUM_BLOCKS)
    scale_mask = is_row[:, None] & (blocks < DIM // 32)[None, :]
    scale = tl.load(packed_ptr + row_start + DIM // 2 + blocks[None, :], mask=scale_mask, other=0)
    power = ue8m0_value(scale.to(tl.int32))[:, :, None]  # [BLOCK_R, NUM_BLOCKS, 1], NaN at 255
    data = tl.reshape(data, [BLOCK_R, NUM_BLOCKS, 16])
    value_even = e2m1_value(data & 0x0F) * power
    value_odd = e2m1_value(data >> 4) * power
    out_even = rows[:, None] * DIM + 2 * pairs[None, :]
    value_even = tl.reshape(value_even, [BLOCK_R, BLOCK_HALF])
    store_float32(out_ptr, out_even, value_even, mask, OUT_BF16_BITS)
    value_odd = tl.reshape(value_odd, [BLOCK_R, BLOCK_HALF])
    store_float32(out_ptr, out_even + 1, value_odd, mask, OUT_BF16_BITS)


def _bits_if_bf16(t: Tensor) -> Tensor:
    """bfloat16 tensors travel as their int16 bits (`row_codes.load_float32`)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _rows(x: Tensor, group: int, kernel: str) -> Tensor:
    """x float[..., D] -> float32/bf16/fp16 [N, D] with unit stride along D (checked)."""
    if not x.is_floating_point():
        raise TypeError(f"expected a floating tensor, got {x.dtype}")
    dim = x.shape[-1] if x.dim() else 0
    if dim <= 0 or dim % group:
        raise ValueError(f"row width {dim} must be a positive multiple of {group}")
    check_runnable(x, kernel)
    if x.dtype == torch.float64:
        x = x.to(torch.float32)  # the reference rounds float64 to float32 first
    rows = x.reshape(-1, dim)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _tile(dim: int) -> tuple[int, int]:
    """(BLOCK_HALF, BLOCK_R) for rows of `dim` elements: a function of the width alone, so one
    compiled variant serves every row count (few rows leave a tile's other rows masked)."""
    block_half = triton.next_power_of_2(dim // 2)
    return block_half, max(1, _TILE_PAIRS // block_half)


def _quantize(
    x: Tensor,
    group: int,
    clamp_scale: bool,
    round_trip: torch.dtype | None,
    kernel: str,
    rotation: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Run `_fp4_quantize_kernel` on x's rows; `rotation` (positions, freqs): RoPE them first
    (`index_fp4_rows_rotated_round_trip`)."""
    rows = _rows(x, group, kernel)
    dim, num_rows = rows.shape[1], rows.shape[0]
    positions, freqs = rotation if rotation is not None else (rows, rows)
    if round_trip is None:
        shape = (*x.shape[:-1], dim // 2 + dim // group)
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    else:
        out = torch.empty(x.shape, dtype=round_trip, device=x.device)
    if num_rows:
        block_half, block_r = _tile(dim)
        rows_per_position = num_rows // max(1, positions.numel()) if rotation is not None else 1
        _fp4_quantize_kernel[(triton.cdiv(num_rows, block_r),)](
            _bits_if_bf16(rows),
            _bits_if_bf16(out),
            positions,
            freqs,
            num_rows,
            rows.stride(0),
            rows_per_position,
            dim // 2 - freqs.numel() if rotation is not None else 0,
            DIM=dim,
            BLOCK_HALF=block_half,
            BLOCK_R=block_r,
            GROUP=group,
            E4M3_SCALE=group == GLOBAL_BLOCK,
            CLAMP_SCALE=clamp_scale,
            ROUND_TRIP=round_trip is not None,
            ROTATE=rotation is not None,
            ONE_POSITION=rotation is not None and rows_per_position % block_r == 0,
            IN_BF16_BITS=rows.dtype == torch.bfloat16,
            OUT_BF16_BITS=out.dtype == torch.bfloat16,
            LIBDEVICE=_LIBDEVICE,
        )
    return out


def index_fp4_rows_quantize(x: Tensor) -> Tensor:
    """``kv_formats.index_fp4_quantize`` in one launch: float[..., D] -> uint8[..., D/2 + D/32].

    Raises:
        TypeError: x not floating point.
        ValueError: D not a positive multiple of 32, or not on CUDA (or the interpreter).
    """
    return _quantize(x, INDEX_BLOCK, True, None, "index_fp4_rows_quantize")


def index_fp4_rows_round_trip(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``index_fp4_dequantize(index_fp4_quantize(x), dtype)`` in one launch, without the bytes
    (``kv_formats.index_fp4_round_trip`` for dtype None = x's dtype). Raises as quantize."""
    return _quantize(x, INDEX_BLOCK, True, dtype or x.dtype, "index_fp4_rows_round_trip")


def index_fp4_rows_rotated_round_trip(
    x: Tensor, positions: Tensor, freqs: Tensor, dtype: torch.dtype | None = None
) -> Tensor:
    """`index_fp4_rows_round_trip(kernels.rope.apply_rope(x, positions, freqs), dtype)` in one
    launch, bit for bit the two: x bf16 or fp32 [..., D], positions leading x (any dims between
    them and D share their angle, as `apply_rope`), freqs fp32 [≤ D/2] for the rotated tail.

    Raises:
        TypeError: x not bf16 or fp32.
        ValueError: as quantize, or positions not leading x, or a rotated tail wider than D.
    """
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the rotated round trip takes bf16 or fp32 rows, got {x.dtype}")
    lead = positions.dim()
    if tuple(x.shape[:lead]) != tuple(positions.shape) or lead >= x.dim():
        raise ValueError(f"positions {tuple(positions.shape)} must lead x {tuple(x.shape)}")
    if 2 * freqs.numel() > x.shape[-1]:
        raise ValueError(f"{2 * freqs.numel()} rotated channels do not fit rows of {x.shape[-1]}")
    rotation = (
        positions.contiguous(),
        freqs.to(device=x.device, dtype=torch.float32).contiguous(),
    )
    kernel = "index_fp4_rows_rotated_round_trip"
    return _quantize(x, INDEX_BLOCK, True, dtype or x.dtype, kernel, rotation)


def index_fp4_rows_dequantize(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``kv_formats.index_fp4_dequantize`` in one launch: uint8[..., 17·D/32] -> dtype[..., D].

    Raises:
        TypeError: packed not uint8.
        ValueError: a row width that is not a multiple of 17, or not on CUDA (or the
            interpreter).
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed rows must be uint8, got {packed.dtype}")
    width = packed.shape[-1] if packed.dim() else 0
    if width <= 0 or width % 17:
        raise ValueError(f"packed row width {width} is not a positive multiple of 17")
    check_runnable(packed, "index_fp4_rows_dequantize")
    dim = width // 17 * 32
    rows = packed.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*packed.shape[:-1], dim), dtype=dtype, device=packed.device)
    num_rows = rows.shape[0]
    if num_rows:
        block_half, block_r = _tile(dim)
        _index_fp4_dequantize_kernel[(triton.cdiv(num_rows, block_r),)](
            rows,
            _bits_if_bf16(out),
            num_rows,
            rows.stride(0),
            DIM=dim,
            BLOCK_HALF=block_half,
            BLOCK_R=block_r,
            OUT_BF16_BITS=out.dtype == torch.bfloat16,
        )
    return out


def global_fp4_rows_quantize(x: Tensor, *, clamp_scale: bool = True) -> Tensor:
    """``kv_formats.global_fp4_quantize`` in one launch: float[..., D] -> uint8[..., 9·D/16].

    Raises:
        TypeError: x not floating point.
        ValueError: D not a positive multiple of 16, not on CUDA (or the interpreter), or (only
            with clamp_scale=False, at the cost of a device sync) a block scale above 448.
    """
    out = _quantize(x, GLOBAL_BLOCK, clamp_scale, None, "global_fp4_rows_quantize")
    if not clamp_scale and bool((out[..., x.shape[-1] // 2 :] == _NAN_BYTE).any()):
        raise ValueError("an FP4 block scale above 448 has no e4m3 byte (amax > 2784)")
    return out
