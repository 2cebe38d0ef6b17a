"""The in-register MXFP4 → bf16 unpack that both decode expert GEMMs run (the Triton kernels of
`grouped_mxfp4_gemm` and the Gluon kernel of `grouped_mxfp4_gluon`), and the attention's FP4
rows where `sparse_mqa.MqaTiles.unpack_rows` asks for it: four inline-PTX strings, one per
output register of a 32-bit word of codes. Their torch counterparts are
`element_codes.mxfp4_to_float` and `fp4_rows_to_float`; the kernels' `gpu` tests check them
against those, and `tests/kernels/test_mxfp4_unpack.py` runs the strings on the CPU through a
model of their instructions."""

from __future__ import annotations

import triton.language as tl
from torch import Tensor

# In-register dequantisation. One 32-bit word of codes holds 8 values v0..v7 (byte i: v2i low
# nibble, v2i+1 high). Masks and shifts place e2m1 magnitudes (e1 e0 m) at bf16 bits 8..6 and
# the sign at bit 15, which reads as e2m1 · 2^-126 (code 1, 0.5, becomes the bf16 subnormal
# 2^-127: exact); one bf16x2 multiply by 2^(scale - 1) restores the scale. Word j of the four
# outputs pairs values (vj, vj+4) in one register, the wgmma A operand's two adjacent K:
#
#     out j   low half   high half      shifts of the word (magnitude, sign)
#       0       v0         v4             << 6, << 12
#       1       v1         v5             << 2, << 8
#       2       v2         v6             >> 2, << 4
#       3       v3         v7             >> 6,    0
#
# NOTE: exact for e8m0 scales up to 128 (2^1); larger ones overflow 2^(scale - 1) in bf16.
_UNPACK = [
    tl.constexpr(
        "{ .reg .b32 t, m; " + magnitude + " t, $1, " + str(m_shift) + "; "
        "and.b32 m, t, 0x01C001C0; " + sign + "lop3.b32 m, m, " + sign_reg + ", 0x80008000, 0xF8; "
        "mul.rn.bf16x2 $0, m, $2; }"
    )
    for magnitude, m_shift, sign, sign_reg in (
        ("shl.b32", 6, "shl.b32 t, $1, 12; ", "t"),
        ("shl.b32", 2, "shl.b32 t, $1, 8; ", "t"),
        ("shr.b32", 2, "shl.b32 t, $1, 4; ", "t"),
        ("shr.b32", 6, "", "$1"),
    )
]
UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3 = _UNPACK


def reads_as_words(pool: Tensor) -> bool:
    """Whether a pool of FP4 rows (uint8 [blocks, rows, bytes]) has its start and its strides on
    4-byte boundaries, so that a kernel can read each row's codes as 32-bit words."""
    return not any(start % 4 for start in (pool.data_ptr(), pool.stride(0), pool.stride(1)))
