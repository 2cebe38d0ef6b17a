"""A MoE layer's output in one launch: the shared expert plus the routed experts' slots,

    y[t] = cast_out(f32(shared[t]) + Σ_j slots[t, j])        slots [T, k, D] fp32, j = 0 .. k−1

with the slots added in slot order from 0.0 and one rounding to the output dtype
(`kernels.rounding`). The torch form (`moe_combine_reference`) is three launches after the
grouped down GEMM: the slot sum, the add, the cast.

    grid (tokens, cdiv(D, BLOCK)); a token's sum depends on nothing else in the batch
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rounding import round_to

__all__ = ["check_parts", "moe_combine", "moe_combine_reference"]

_BLOCK = 1024


@triton.jit
def _moe_combine_kernel(
    shared_ptr, slots_ptr, out_ptr, dim, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < dim
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(slots_ptr + (token * TOP_K + j) * dim + cols, mask=keep, other=0.0)
    shared = tl.load(shared_ptr + token * dim + cols, mask=keep, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * dim + cols, round_to(shared + total, dtype).to(dtype), mask=keep)


def check_parts(shared: Tensor, slots: Tensor) -> None:
    """Raise ValueError unless `slots` are fp32 [T, k, D] beside `shared` [T, D] (what
    `moe_combine` and the update that adds the parts itself, `mhc_post(slots=)`, take)."""
    if slots.dim() != 3 or slots.shape[0] != shared.shape[0] or slots.shape[2] != shared.shape[1]:
        raise ValueError(f"slots {tuple(slots.shape)} do not match shared {tuple(shared.shape)}")
    if slots.dtype != torch.float32:
        raise ValueError(f"slots must be float32, got {slots.dtype}")


def moe_combine(shared: Tensor, slots: Tensor) -> Tensor:
    """`shared` [T, D] (the shared expert's output, the layer's dtype) and the routed `slots`
    [T, k, D] fp32 (weighted) → [T, D] in `shared`'s dtype."""
    check_parts(shared, slots)
    check_runnable(shared, "moe_combine")
    shared, slots = shared.contiguous(), slots.contiguous()
    tokens, top_k, dim = slots.shape
    out = torch.empty_like(shared)
    if tokens and dim:
        block = min(_BLOCK, triton.next_power_of_2(dim))
        grid = (tokens, triton.cdiv(dim, block))
        _moe_combine_kernel[grid](shared, slots, out, dim, TOP_K=top_k, BLOCK=block)
    return out


def moe_combine_reference(shared: Tensor, slots: Tensor) -> Tensor:
    """The torch form: slots added in slot order, plus the shared output, one cast."""
    total = torch.zeros_like(slots[:, 0])
    for j in range(slots.shape[1]):
        total = total + slots[:, j]
    return (shared.float() + total).to(shared.dtype)
