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
    """fp32 `x` → the nearest value of `dtype` (ties to even; past the largest finite value,
    infinity), still as fp32; a NaN stays NaN. (fp32 subnormals round exactly on the GPU; the
    interpreter flushes them to zero first.)"""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(is_nan, bits | 0x00400000, rounded).to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)
