"""The clamped SwiGLU of packed gate/up rows in one launch (`model.md` §3.8):

    y = silu(min(gate, L)) ⊙ clamp(up, −L, L)        rows [..., 2I] = [gate | up] → [..., I]

as the torch form rounds it in a 16-bit dtype: SiLU evaluated in fp32 and rounded to the
output dtype, then the product of the two rounded factors in fp32, rounded again (both from the
bits, `kernels.rounding`) (torch's bf16 `silu` and `mul` each compute in fp32 and round). The
torch version (`clamped_swiglu_reference`) is four launches on two separate inputs; the shared
expert's gate and up projections are one GEMM whose output this kernel reads in place.

Rounding on CUDA: SiLU is torch's CUDA spelling `x / (1 + expf(−x))` with libdevice's `expf`
(what torch's kernel calls; without its flush-to-zero, as nvcc) and a division that rounds to
nearest (`div.rn`, nvcc's default), so each element is torch's bit for bit in every dtype.
Triton's own `tl.exp` (`ex2.approx` of x·log2 e, whose error grows with |x|: ~10 fp32 ulps at
x = −30) and `/` (`div.full`, 2 ulps) are not. (libdevice's `expf` ends in `ex2 · 2^j`, a
product by a power of two, so whether `1 + e` fuses into it cannot change the sum.) Triton's
CPU interpreter has no libdevice: numpy's exp stands in there.

    grid (rows, cdiv(I, BLOCK)); each element independent, so the result is batch-invariant
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from kernels import check_runnable, interpreting
from kernels.rounding import round_to

__all__ = ["CUDA_OPTIONS", "clamped_swiglu", "clamped_swiglu_reference"]

_BLOCK = 1024
_LIBDEVICE = not interpreting()
# NOTE: libdevice's expf without flush-to-zero, as torch's (nvcc's default).
CUDA_OPTIONS = {"enable_reflect_ftz": False}


@triton.jit
def _clamped_swiglu_kernel(
    gate_up_ptr, out_ptr, inter, limit, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < inter
    base = gate_up_ptr + row * 2 * inter
    gate = tl.load(base + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=keep, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    dtype = out_ptr.dtype.element_ty
    e = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)
    silu = round_to(tl.math.div_rn(gate, 1.0 + e), dtype)
    tl.store(out_ptr + row * inter + cols, round_to(silu * up, dtype).to(dtype), mask=keep)


def clamped_swiglu(gate_up: Tensor, limit: float) -> Tensor:
    """`gate_up` [..., 2I] (gate then up, as one GEMM writes them) → [..., I] in its dtype."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up rows must hold gate and up halves, got {gate_up.shape[-1]}")
    check_runnable(gate_up, "clamped_swiglu")
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // max(2 * inter, 1)
    if rows and inter:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        options = {} if interpreting() else CUDA_OPTIONS
        _clamped_swiglu_kernel[grid](
            gate_up, out, inter, float(limit), BLOCK=block, LIBDEVICE=_LIBDEVICE, **options
        )
    return out


def clamped_swiglu_reference(gate_up: Tensor, limit: float) -> Tensor:
    """The torch form on the packed halves (`primitives.clamped_swiglu`'s default path)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
