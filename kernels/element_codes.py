"""Torch decoders of the element and scale codes the kernels decode in registers.

The kernels' torch references decode their operands with these (so `kernels` needs nothing from
the model); `tests/kernels/test_element_codes.py` pins them to the model's own codecs
(`kv_formats`, `weight_formats`) over every byte value.

    e2m1   4-bit float (sign, 2 exponent bits, 1 mantissa bit): ±{0, .5, 1, 1.5, 2, 3, 4, 6};
           two per byte, the even element in the low nibble
    e4m3   8-bit float (float8_e4m3fn)
    ue8m0  8-bit power of two: byte b means 2^(b − 127), b = 255 is NaN
"""

from __future__ import annotations

import torch
from torch import Tensor

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_pairs_to_float(packed: Tensor) -> Tensor:
    """uint8/int8 [..., n] packed e2m1 pairs → float32 [..., 2n]."""
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    values = torch.cat((magnitudes, -magnitudes))
    codes = packed.view(torch.uint8).to(torch.int64)
    return torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=-1).flatten(-2)


def e4m3_to_float(codes: Tensor) -> Tensor:
    """uint8 (or float8_e4m3fn) e4m3 codes → float32 of the same shape."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def ue8m0_to_float(codes: Tensor) -> Tensor:
    """uint8 (or float8_e8m0fnu) power-of-two codes → float32 2^(b − 127) (NaN for 255)."""
    return codes.view(torch.float8_e8m0fnu).to(torch.float32)


def mxfp8_rows_to_float(packed: Tensor) -> Tensor:
    """uint8 [..., 33·D/32] MXFP8 window rows (D e4m3 codes, then a ue8m0 scale per 32) →
    float32 [..., D]."""
    dim = packed.shape[-1] * 32 // 33
    elements = e4m3_to_float(packed[..., :dim]).unflatten(-1, (-1, 32))
    return (elements * ue8m0_to_float(packed[..., dim:]).unsqueeze(-1)).flatten(-2)


def fp4_rows_to_float(packed: Tensor) -> Tensor:
    """uint8 [..., 9·D/16] FP4 global rows (D/2 bytes of e2m1 pairs, then an e4m3 scale per 16)
    → float32 [..., D]."""
    half = packed.shape[-1] * 8 // 9
    values = e2m1_pairs_to_float(packed[..., :half]).unflatten(-1, (-1, 16))
    return (values * e4m3_to_float(packed[..., half:]).unsqueeze(-1)).flatten(-2)


def mxfp4_to_float(codes: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 weights: int8 [..., k/2] e2m1 pairs and e8m0 [..., k/32] scales → float32 [..., k]."""
    values = e2m1_pairs_to_float(codes).unflatten(-1, (-1, 32))
    return (values * ue8m0_to_float(scales).unsqueeze(-1)).flatten(-2)
