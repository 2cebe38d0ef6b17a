"""Rounding helpers shared by kernels (Triton device functions, no launcher).

Triton's CPU interpreter truncates an fp32 → bf16 cast (the GPU rounds to nearest even, and
ignores `fp_downcast_rounding` there), so a kernel that rounds through a cast tests another
rounding in the interpreter than it runs on the GPU. `round_to` rounds from the bits instead:
the same on both.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` → the nearest value of `dtype` (ties to even), still as fp32 (finite x)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)
