"""An Engram layer's gate into the residual streams in one launch (`model.md` §3.9):

    a_k   = f32(q_k) ⊙ f32(k_k)                         (the layer's two [N, D] weights)
    dot_k = Σ_d R_k·a_k·key_k · rsqrt(ms(R_k) + eps) · rsqrt(ms(key_k) + eps) · D^-½
    g_k   = sigmoid(sign(dot_k) · sqrt(max(|dot_k|, 1e-6)))      (0 for an image token)
    R'_k  = cast_out(R_k + g_k · value)

with R [T, N, D] the residual, `key_k` and `value` the slices of the projected lookups
`kv` [T, (N+1)·D] (stream k's key at columns k·D, the value last), everything in fp32 and
one rounding to R's dtype. The torch form (`engine/models/deepseek_v41/engram.py`, which
`tests/kernels/test_engram_gate.py` compares; `kernels` cannot import it) is ~25 launches.

    grid (T, N): one program per token and stream, the whole row in registers, so a token's
    result depends on nothing else in the batch (batch-invariant by construction)

The three row sums run in another order than torch's, so results agree to a few ulps, not
bit for bit; the mean squares use `rms_norm.inv_rms`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.rms_norm import MAX_WIDTH, inv_rms, norm_warps
from kernels.rounding import round_to

__all__ = ["engram_gate"]


@triton.jit
def _engram_gate_kernel(
    residual_ptr,
    kv_ptr,
    q_weight_ptr,
    k_weight_ptr,
    is_image_ptr,
    out_ptr,
    width,
    eps,
    inv_sqrt_width,
    STREAMS: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    keep = cols < width
    row = (token * STREAMS + stream) * width
    kv_row = token * (STREAMS + 1) * width
    r = tl.load(residual_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + kv_row + stream * width + cols, mask=keep, other=0.0).to(tl.float32)
    q = tl.load(q_weight_ptr + stream * width + cols, mask=keep, other=0.0).to(tl.float32)
    k = tl.load(k_weight_ptr + stream * width + cols, mask=keep, other=0.0).to(tl.float32)
    rstd = inv_rms(r, width, eps) * inv_rms(key, width, eps)
    dot = tl.sum(r * (q * k) * key, axis=0) * rstd * inv_sqrt_width
    magnitude = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6))
    signed = tl.where(dot > 0, magnitude, tl.where(dot < 0, -magnitude, 0.0))
    signed = tl.where(dot != dot, dot, signed)  # torch's sign keeps a NaN
    gate = 1.0 / (1.0 + tl.exp(-signed))
    if HAS_IMAGE:
        gate = tl.where(tl.load(is_image_ptr + token) != 0, 0.0, gate)
    value = tl.load(kv_ptr + kv_row + STREAMS * width + cols, mask=keep, other=0.0)
    updated = r + gate * value.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row + cols, round_to(updated, dtype).to(dtype), mask=keep)


def engram_gate(
    residual: Tensor,
    kv: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    is_image: Tensor | None = None,
) -> Tensor:
    """residual [T, N, D]; kv [T, (N+1)·D] (the lookups' projection, any float dtype);
    q_weight, k_weight [N, D]; is_image bool [T] or None → the gated residual [T, N, D] in
    residual's dtype (module docstring)."""
    if residual.dim() != 3:
        raise ValueError(f"residual must be [T, N, D], got {tuple(residual.shape)}")
    tokens, streams, width = residual.shape
    if kv.shape != (tokens, (streams + 1) * width):
        raise ValueError(f"kv {tuple(kv.shape)} does not match residual {tuple(residual.shape)}")
    if q_weight.shape != (streams, width) or k_weight.shape != (streams, width):
        raise ValueError(f"q and k weights must be [{streams}, {width}]")
    if is_image is not None and is_image.shape != (tokens,):
        raise ValueError(f"is_image must be [{tokens}], got {tuple(is_image.shape)}")
    if width > MAX_WIDTH:
        raise ValueError(f"rows of at most {MAX_WIDTH}, got {width}")
    check_runnable(residual, "engram_gate")
    residual, kv = residual.contiguous(), kv.contiguous()
    out = torch.empty_like(residual)
    if tokens and width:
        block = triton.next_power_of_2(width)
        image = is_image.contiguous().view(torch.uint8) if is_image is not None else residual
        _engram_gate_kernel[(tokens, streams)](
            residual,
            kv,
            q_weight.contiguous(),
            k_weight.contiguous(),
            image,
            out,
            width,
            eps,
            width**-0.5,
            STREAMS=streams,
            HAS_IMAGE=is_image is not None,
            BLOCK=block,
            num_warps=norm_warps(block),
        )
    return out
