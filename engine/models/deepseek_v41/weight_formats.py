"""Checkpoint weight formats of DeepSeek-V4.1 (model.md §5.3, §5.4) as pure torch functions.

* FP8 block weights (every dense linear): ``weight`` float8_e4m3fn[n, k] plus ``scale``
  float8_e8m0fnu[ceil(n/32), ceil(k/32)], one power of two per 32x32 tile::

      W[i, j] = e4m3(W8[i, j]) * 2^(S[i // 32, j // 32] - 127)

* MXFP4 routed experts: ``weight`` int8[n, k/2] (two e2m1 codes per byte, column 2c in the LOW
  nibble, bit 3 of a code = sign) plus ``scale`` float8_e8m0fnu[n, k/32], one power of two per
  32 consecutive input columns::

      W[i, j] = e2m1(nibble j % 2 of byte B[i, j // 2]) * 2^(S[i, j // 32] - 127)

* Engram rows: ``embed.weight`` float8_e4m3fn[rows, d] plus ``embed.scale``
  float8_e8m0fnu[rows, d/32] (per row, per 32 columns; NOT 32x32 tiles). Rows are dequantised
  only when gathered (§5.4 item 7).

The dequantize functions are what the loader runs. The quantize functions exist to write random
test checkpoints; their scale rule is "the smallest power of two 2^e (e >= -127) with
amax / 2^e <= fmax" (fmax = 448 for e4m3, 6 for e2m1; an all-zero block gets e = -127, byte 0),
then codes round to nearest, ties to even.

NOTE (canonical bytes): rounding can pull a block's largest code down to fmax / 2 (e4m3: amax/2^e
in (224, 232] -> 224; e2m1: amax/2^e in (3, 3.5) -> 3). Such a block is re-expressed with exponent
e - 1 and doubled codes: the dequantized values are unchanged, and the bytes become a fixed point,
``quantize(dequantize(q)) == q`` bit for bit (which the loader tests rely on).

Byte helpers: safetensors stores float8_e8m0fnu as F8_E8M0 (torch >= 2.7); ``e8m0_to_bytes`` and
``bytes_to_e8m0`` reinterpret between it and uint8 exponent bytes without changing bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models.deepseek_v41.kv_formats import (
    E2M1_MAX,
    E4M3_MAX,
    UE8M0_BIAS,
    UE8M0_MAX_EXPONENT,
    UE8M0_MIN_EXPONENT,
    ceil_log2,
    decode_e2m1_bytes,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    e4m3_to_float,
    pack_nibbles,
    pow2,
    ue8m0_to_float,
)
from kernels import engram_rows as engram_rows_kernel
from kernels import runs_kernels

WEIGHT_BLOCK = 32  # quantization_config.weight_block_size (NOT V4's 128)
MXFP4_BLOCK = 32
ENGRAM_BLOCK = 32


# ------------------------------------------------------------------------------------------------
# Byte helpers
# ------------------------------------------------------------------------------------------------


def e8m0_to_bytes(scale: Tensor) -> Tensor:
    """float8_e8m0fnu (or uint8) tensor -> uint8 exponent bytes, same shape, same bits."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"expected float8_e8m0fnu or uint8 scales, got {scale.dtype}")
    return scale.view(torch.uint8)


def bytes_to_e8m0(exponent_bytes: Tensor) -> Tensor:
    """uint8 exponent bytes (b means 2^(b - 127)) -> float8_e8m0fnu, same shape, same bits."""
    if exponent_bytes.dtype != torch.uint8:
        raise TypeError(f"expected uint8 exponent bytes, got {exponent_bytes.dtype}")
    return exponent_bytes.view(torch.float8_e8m0fnu)


def _exponents_to_e8m0(exponent: Tensor) -> Tensor:
    return bytes_to_e8m0((exponent + UE8M0_BIAS).to(torch.uint8))


def _e4m3_bytes(weight: Tensor) -> Tensor:
    """float8_e4m3fn or uint8 -> uint8 view (gathers and pads on float8 are not portable)."""
    if weight.dtype == torch.float8_e4m3fn:
        return weight.view(torch.uint8)
    if weight.dtype != torch.uint8:
        raise TypeError(f"expected float8_e4m3fn or uint8 weights, got {weight.dtype}")
    return weight


# ------------------------------------------------------------------------------------------------
# Shared power-of-two block quantizer
# ------------------------------------------------------------------------------------------------


def _quantize_pow2_blocks(
    blocks: Tensor,
    fmax: float,
    encode: Callable[[Tensor], Tensor],
    decode: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """Quantize float32[..., block] groups with one power-of-two scale each (canonical form).

    Args:
        blocks: float32 tensor; the last dim is one scale group.
        fmax: largest element magnitude (448 or 6).
        encode: float32 -> element codes (rounding to nearest even, saturating at ±fmax).
        decode: element codes -> float32 values.
    Returns:
        (codes shaped like blocks, int32 exponents [..., 1]) -- see the module NOTE.
    """
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = ceil_log2(amax / fmax, UE8M0_MIN_EXPONENT, UE8M0_MAX_EXPONENT)
    codes = encode(blocks / pow2(exponent))
    values = decode(codes)
    is_loose = (values.abs().amax(dim=-1, keepdim=True) <= fmax / 2) & (
        exponent > UE8M0_MIN_EXPONENT
    )
    codes = torch.where(is_loose, encode(values * 2), codes)
    return codes, exponent - is_loose.to(torch.int32)


def _e4m3_codes(y: Tensor) -> Tensor:
    return e4m3_round(y).view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# FP8 block weights (dense linears)
# ------------------------------------------------------------------------------------------------


def _tile_grid(n: int, k: int, block: int) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def fp8_block_quantize(w: Tensor, block: int = WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize a dense weight to FP8 with one power-of-two scale per block x block tile.

    Args:
        w: float[n, k] (any n, k >= 1; partial edge tiles use only their own elements).
        block: tile side (32 in V4.1).
    Returns:
        (weight float8_e4m3fn[n, k], scale float8_e8m0fnu[ceil(n/block), ceil(k/block)]) with the
        rule and canonical form of the module docstring; fp8_block_dequantize inverts it.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a floating 2-D weight, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    num_row_tiles, num_col_tiles = _tile_grid(n, k, block)
    padded = F.pad(
        w.to(torch.float32), (0, num_col_tiles * block - k, 0, num_row_tiles * block - n)
    )
    # [n_pad, k_pad] -> [row tile, col tile, block * block]
    tiles = padded.view(num_row_tiles, block, num_col_tiles, block).transpose(1, 2)
    codes, exponent = _quantize_pow2_blocks(tiles.flatten(-2), E4M3_MAX, _e4m3_codes, e4m3_to_float)
    codes = codes.view(num_row_tiles, num_col_tiles, block, block).transpose(1, 2)
    weight = codes.reshape(num_row_tiles * block, num_col_tiles * block)[:n, :k].contiguous()
    return weight.view(torch.float8_e4m3fn), _exponents_to_e8m0(exponent.squeeze(-1))


def fp8_block_dequantize(
    weight: Tensor, scale: Tensor, block: int = WEIGHT_BLOCK, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dequantize an FP8 block weight: ``W[i,j] = e4m3(W8[i,j]) * 2^(S[i//block, j//block] - 127)``.

    Args:
        weight: float8_e4m3fn (or uint8 bytes) [n, k].
        scale: float8_e8m0fnu (or uint8 exponent bytes) [ceil(n/block), ceil(k/block)].
        block: tile side; must match the checkpoint's ``weight_block_size`` (32 for V4.1).
        dtype: output dtype (computed in float32, cast once).
    Returns:
        dtype[n, k].
    Raises:
        ValueError: the scale grid does not match the weight shape and block.
    """
    data = _e4m3_bytes(weight)
    scale_bytes = e8m0_to_bytes(scale)
    n, k = data.shape
    num_row_tiles, num_col_tiles = _tile_grid(n, k, block)
    if tuple(scale_bytes.shape) != (num_row_tiles, num_col_tiles):
        raise ValueError(
            f"scale shape {tuple(scale_bytes.shape)} != ({num_row_tiles}, {num_col_tiles}) "
            f"for weight {(n, k)} with block {block}"
        )
    values = e4m3_to_float(data)
    values = F.pad(values, (0, num_col_tiles * block - k, 0, num_row_tiles * block - n))
    tiles = values.view(num_row_tiles, block, num_col_tiles, block)
    tiles = tiles * ue8m0_to_float(scale_bytes)[:, None, :, None]
    return tiles.reshape(num_row_tiles * block, num_col_tiles * block)[:n, :k].to(dtype)


# ------------------------------------------------------------------------------------------------
# MXFP4 routed experts
# ------------------------------------------------------------------------------------------------


def mxfp4_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize expert weights to MXFP4 along the input (last) dim.

    Args:
        w: float[..., n, k] with k a multiple of 32 (2304 and 5120 in V4.1).
    Returns:
        (packed int8[..., n, k/2], scale float8_e8m0fnu[..., n, k/32]); byte c of a row is
        code(col 2c) | code(col 2c+1) << 4. Scale rule and canonical form: module docstring.
    """
    if not w.is_floating_point() or w.dim() < 1 or w.shape[-1] % MXFP4_BLOCK != 0:
        raise ValueError(f"expected floating [..., k] with k % 32 == 0, got {tuple(w.shape)}")
    blocks = w.to(torch.float32).unflatten(-1, (-1, MXFP4_BLOCK))
    codes, exponent = _quantize_pow2_blocks(blocks, E2M1_MAX, e2m1_encode, e2m1_decode)
    packed = pack_nibbles(codes.flatten(-2)).view(torch.int8)
    return packed, _exponents_to_e8m0(exponent.squeeze(-1))


def mxfp4_dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize MXFP4 experts: int8/uint8[..., n, k/2] + e8m0[..., n, k/32] -> dtype[..., n, k].

    Raises:
        ValueError: scale shape is not packed.shape[:-1] + (k/32,).
    """
    values = decode_e2m1_bytes(packed)
    scale_bytes = e8m0_to_bytes(scale)
    expected = (*values.shape[:-1], values.shape[-1] // MXFP4_BLOCK)
    if values.shape[-1] % MXFP4_BLOCK != 0 or tuple(scale_bytes.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_bytes.shape)} != {expected}")
    values = values.unflatten(-1, (-1, MXFP4_BLOCK))
    return (values * ue8m0_to_float(scale_bytes).unsqueeze(-1)).flatten(-2).to(dtype)


# ------------------------------------------------------------------------------------------------
# Engram rows
# ------------------------------------------------------------------------------------------------


def fp8_row_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize Engram table rows: float[rows, d] -> (float8_e4m3fn[rows, d], e8m0[rows, d/32]).

    One power-of-two scale per 32 consecutive columns of a row (d a multiple of 32); scale rule
    and canonical form: module docstring.
    """
    if not w.is_floating_point() or w.dim() != 2 or w.shape[-1] % ENGRAM_BLOCK != 0:
        raise ValueError(f"expected floating [rows, d] with d % 32 == 0, got {tuple(w.shape)}")
    blocks = w.to(torch.float32).unflatten(-1, (-1, ENGRAM_BLOCK))
    codes, exponent = _quantize_pow2_blocks(blocks, E4M3_MAX, _e4m3_codes, e4m3_to_float)
    return codes.flatten(-2).view(torch.float8_e4m3fn), _exponents_to_e8m0(exponent.squeeze(-1))


def fp8_row_dequantize(
    weight: Tensor,
    scale: Tensor,
    rows_idx: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`fp8_row_dequantize_reference`'s rows; on the kernel path (`kernels.engram_rows`) the
    same bits in one launch (bf16 or fp32 out, a power-of-two width), without the reference's
    IndexError for an id past the table (no host sync)."""
    data, scale_bytes = _e4m3_bytes(weight), e8m0_to_bytes(scale)
    width = data.shape[-1]
    if (
        runs_kernels(data)
        and dtype in (torch.bfloat16, torch.float32)
        and width >= ENGRAM_BLOCK
        and width & (width - 1) == 0
        and tuple(scale_bytes.shape) == (data.shape[0], width // ENGRAM_BLOCK)
        and (rows_idx is None or rows_idx.dtype == torch.int64)
    ):
        return engram_rows_kernel.engram_rows(data, scale_bytes, rows_idx, dtype)
    return fp8_row_dequantize_reference(weight, scale, rows_idx, dtype)


def fp8_row_dequantize_reference(
    weight: Tensor,
    scale: Tensor,
    rows_idx: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Dequantize gathered Engram rows: ``out[..., j] = e4m3(W8[r, j]) * 2^(S[r, j // 32] - 127)``.

    Args:
        weight: float8_e4m3fn (or uint8) table [rows, d]; never converted as a whole.
        scale: float8_e8m0fnu (or uint8) [rows, d/32].
        rows_idx: int64 row indices of any shape (same device as the table), or None for all rows.
        dtype: output dtype (computed in float32, cast once).
    Returns:
        dtype[*rows_idx.shape, d] (or [rows, d] when rows_idx is None). Only the gathered rows
        are read and converted.
    Raises:
        ValueError: scale shape is not [rows, d/32]. Out-of-range indices raise IndexError.
    """
    data = _e4m3_bytes(weight)
    scale_bytes = e8m0_to_bytes(scale)
    num_rows, d = data.shape
    if d % ENGRAM_BLOCK != 0 or tuple(scale_bytes.shape) != (num_rows, d // ENGRAM_BLOCK):
        raise ValueError(
            f"scale shape {tuple(scale_bytes.shape)} does not match weight {(num_rows, d)}"
        )
    if rows_idx is not None:
        data, scale_bytes = data[rows_idx], scale_bytes[rows_idx]
    values = e4m3_to_float(data).unflatten(-1, (-1, ENGRAM_BLOCK))
    return (values * ue8m0_to_float(scale_bytes).unsqueeze(-1)).flatten(-2).to(dtype)
