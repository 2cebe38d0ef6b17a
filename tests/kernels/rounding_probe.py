"""A probe kernel for `kernels.rounding.round_to`: fp32 in, bf16 out through `round_to`.

A module of its own (not a string that a test `exec`s) because compiled Triton reads a kernel's
source from its file; the interpreter test and the CUDA test both import it from here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to

_BLOCK = 1024


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    x = tl.load(x_ptr + i, mask=keep, other=0.0)
    tl.store(out_ptr + i, round_to(x, tl.bfloat16).to(tl.bfloat16), mask=keep)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` (contiguous) rounded to bf16 by `round_to` in one launch."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _round_kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, out, x.numel(), BLOCK=_BLOCK)
    return out
