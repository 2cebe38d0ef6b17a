"""`@triton.jit` helpers that build the KV row codes from integer bits (no kernels here).

The row codecs' torch references (`engine/models/deepseek_v41/kv_formats.py`) build powers of two
from exponent bits and read ``ceil(log2 v)`` from ``frexp``; these helpers do the same on int32
views of float32 values, so a compiler cannot rewrite them (no libm, no float rounding tricks):

    pow2(e)            float32 2^e for int32 e in [-149, 127] (subnormals included)
    ceil_log2(v)       smallest e with v <= 2^e, clamped (kv_formats.ceil_log2)
    e4m3_code(y)       e4m3 byte of y: nearest, ties to even, saturating at ±448; NaN -> 0x7F
    e4m3_value(c)      float32 value of a non-negative e4m3 byte
    e2m1_code(y, x)    3-bit e2m1 magnitude of |y| (kv_formats.e2m1_encode's boundaries) with
                       the sign of x as bit 3
    e2m1_value(c)      float32 e2m1(c), exact
    ue8m0_value(b)     float32 2^(b - 127) of a scale byte, NaN for 255
    e2m1_scaled(c, e)  float32 e2m1(c) * 2^e, exact (subnormal results included)
    load_float32 / store_float32   rows of float32, or of bfloat16 through their int16 bits

NOTE: bfloat16 moves as bits (its upper half of a float32) because Triton's interpreter converts
bfloat16 subnormals wrongly; on the GPU both ways are the same exact conversion.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX_BITS = tl.constexpr(0x43E00000)  # 448.0
E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # 2^-6


@triton.jit
def pow2(e):
    """float32 2^e, from bits (e int32 in [-149, 127])."""
    normal = tl.maximum(e + 127, 1) << 23
    subnormal = tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2(v, LO: tl.constexpr, HI: tl.constexpr):
    """int32 ceil(log2 v) of float32 v >= 0, clamped to [LO, HI]; 0 and NaN -> LO, inf -> HI.

    NOTE: a float32 subnormal v is resolved only down to -127, so LO must be >= -127.
    """
    tl.static_assert(LO >= -127)
    bits = v.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    e = tl.where(mantissa == 0, biased - 127, biased - 126)
    e = tl.where(biased == 0, tl.where(mantissa > 0x400000, -126, -127), e)
    e = tl.where(v > 0, e, LO)
    e = tl.where((bits & 0x7FFFFFFF) == 0x7F800000, HI, e)
    return tl.minimum(tl.maximum(e, LO), HI)


@triton.jit
def _round_shift(m, s):
    """m >> s rounded to nearest, ties to even (int32 m >= 0, s in [1, 30])."""
    q = m >> s
    rem = m & ((tl.full(m.shape, 1, tl.int32) << s) - 1)
    half = tl.full(m.shape, 1, tl.int32) << (s - 1)
    return q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)


@triton.jit
def e4m3_code(y):
    """int32 e4m3 byte (float8_e4m3fn) of float32 y: clamp to ±448, round to nearest even.

    Normal range (|y| >= 2^-6): round the float32 mantissa to 3 bits; the exponent rebiases from
    127 to 7. Below: the subnormal step 2^-9, so the code is |y| * 2^9 rounded to an integer
    (8 is the smallest normal, 0x08, so the two ranges meet).
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    magnitude = tl.minimum(magnitude, E4M3_MAX_BITS)
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    biased = magnitude >> 23
    subnormal = _round_shift((magnitude & 0x7FFFFF) | 0x800000, tl.minimum(141 - biased, 25))
    code = tl.where(magnitude >= E4M3_MIN_NORMAL_BITS, normal, subnormal)
    return tl.where(is_nan, 0x7F, code) | sign


@triton.jit
def e4m3_round_wide(v):
    """float32 v > 0 rounded to 3 mantissa bits, nearest even, without e4m3's 448 ceiling
    (kv_formats._e4m3_round_unbounded above 448)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(code):
    """float32 value of a non-negative e4m3 byte 0x00..0x7E (int32)."""
    biased = code >> 3
    mantissa = code & 7
    normal = ((biased + 120) << 23) | (mantissa << 20)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    return tl.where(biased > 0, normal.to(tl.float32, bitcast=True), subnormal)


@triton.jit
def e2m1_code(y, x):
    """int32 e2m1 code of float32 y = x / scale (scale > 0): the magnitude index of |y| with
    kv_formats' boundaries (ties to the even code), saturating at 6; bit 3 = sign bit of x."""
    a = tl.abs(y)
    code = (a > 0.25).to(tl.int32)
    code += (a >= 0.75).to(tl.int32)
    code += (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32)
    code += (a > 2.5).to(tl.int32)
    code += (a >= 3.5).to(tl.int32)
    code += (a > 5.0).to(tl.int32)
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def e2m1_value(code):
    """float32 e2m1(code), exact (code int32 0..15).

    The code's exponent and mantissa bits placed at float32's lowest exponent bits give
    e2m1(code) · 2^-126 (the code 0.5: the subnormal 2^-127); one multiply by 2^126 scales it
    back. Four integer operations and a multiply, no select."""
    bits = ((code & 8) << 28) | ((code & 7) << 22)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def ue8m0_value(byte):
    """float32 2^(byte − 127) of a ue8m0 scale byte (int32 0..255; NaN for 255)."""
    return tl.where(byte == 255, float("nan"), pow2(byte - 127))


@triton.jit
def e2m1_scaled(code, e):
    """float32 e2m1(code) * 2^e (code int32 0..15, e int32 in [-127, 127]): exact, inf where
    it overflows (a value with two significant bits at 2^-128 or above is a float32, so the
    multiply by the power of two never rounds). Give `e` unbroadcast ([..., 1] per block):
    its power of two is then built once per block."""
    return e2m1_value(code) * pow2(e)


@triton.jit
def load_float32(ptr, offsets, mask, BF16_BITS: tl.constexpr):
    """float32 values at ptr + offsets (0 where masked); with BF16_BITS, ptr holds the int16
    bits of bfloat16 values."""
    if BF16_BITS:
        bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_float32(ptr, offsets, value, mask, BF16_BITS: tl.constexpr):
    """Store float32 `value` in ptr's dtype; with BF16_BITS, ptr takes the int16 bits of the
    bfloat16 values, truncated: `value` must be exact in bfloat16."""
    if BF16_BITS:
        bits = value.to(tl.int32, bitcast=True) >> 16
        tl.store(ptr + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


__all__ = [
    "ceil_log2",
    "e2m1_code",
    "e2m1_scaled",
    "e2m1_value",
    "e4m3_code",
    "e4m3_round_wide",
    "e4m3_value",
    "load_float32",
    "pow2",
    "store_float32",
    "ue8m0_value",
]
