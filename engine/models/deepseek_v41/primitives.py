"""Numerical primitives of DeepSeek-V4.1 (`model.md` §2, §3.2, §3.8): pure functions.

RMSNorm with eps 1e-20 in fp32, interleaved partial RoPE with the plain and YaRN tables, the mHC
triplet with Sinkhorn normalisation, and sqrt-softplus routing. No module state lives here.

RMSNorm, RoPE and the mHC mix / combine / post run as one Triton launch each on CUDA; elsewhere
their torch references, which live beside the kernels (`kernels.rms_norm`, ...). An RMSNorm whose
rows are rotated next runs as one launch with the rotation (`rms_norm_rope`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models.deepseek_v41.config import RopeScaling
from engine.models.deepseek_v41.dense import dense_matmul, row_sum
from kernels import mhc_combine as mhc_combine_kernel
from kernels import mhc_mix as mhc_mix_kernel
from kernels import mhc_post as mhc_post_kernel
from kernels import mhc_triplet as mhc_triplet_kernel
from kernels import moe_routing as moe_routing_kernel
from kernels import rms_norm as rms_norm_kernel
from kernels import rms_norm_rope as rms_norm_rope_kernel
from kernels import rope as rope_kernel
from kernels import runs_kernels


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """`cast_out((f32(x) · rsqrt(mean(f32(x)²) + eps)) · f32(w))`; weightless when `weight` is None
    (`kernels.rms_norm` on CUDA: one launch).

    NOTE: eps = 1e-20 underflows nothing in fp32 (rsqrt(1e-20) = 1e10), so an all-zero row maps
    to zeros, never NaN.
    """
    if runs_kernels(x):
        return rms_norm_kernel.rms_norm(x, weight, eps)
    return rms_norm_kernel.rms_norm_reference(x, weight, eps)


# ---- RoPE ------------------------------------------------------------------------------------


def rope_frequencies(dim: int, theta: float, yarn: RopeScaling | None) -> Tensor:
    """fp32 frequencies `f_i = θ^(−2i/d)` for i < d/2, YaRN-corrected when `yarn` is given.

    YaRN (`model.md` §2.2): `c(β) = d·ln(L0/(2πβ)) / (2 ln θ)`, `lo = max(floor(c(β_fast)), 0)`,
    `hi = min(ceil(c(β_slow)), d − 1)`, `ramp_i = clamp((i − lo)/(hi − lo), 0, 1)`,
    `f_i ← f_i·ramp_i/s + f_i·(1 − ramp_i)`. No attention-scale (mscale) factor is applied.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs

    def corr(beta: float) -> float:
        return (
            dim
            * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi))
            / (2 * math.log(theta))
        )

    lo = max(math.floor(corr(yarn.beta_fast)), 0)
    hi = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return freqs * ramp / yarn.factor + freqs * (1 - ramp)


def apply_rope(x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the trailing `2·len(freqs)` channels of `x[..., D]` by `exp(±j·pos·f_i)`
    (`kernels.rope`: one launch instead of ~8 on CUDA; its torch reference elsewhere)."""
    if runs_kernels(x):
        return rope_kernel.apply_rope(x, positions, freqs, inverse)
    return rope_kernel.apply_rope_reference(x, positions, freqs, inverse)


def rms_norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    positions: Tensor,
    freqs: Tensor,
    keep_normed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(`apply_rope(rms_norm(x, weight, eps), positions, freqs)`, the unrotated norm output when
    `keep_normed`, else None); positions: one per row of x [..., D]
    (`kernels.rms_norm_rope` on the kernel path: one launch, bit for bit the two; elsewhere the
    two references in turn)."""
    if runs_kernels(x):
        return rms_norm_rope_kernel.rms_norm_rope(x, weight, eps, positions, freqs, keep_normed)
    return rms_norm_rope_kernel.rms_norm_rope_reference(
        x, weight, eps, positions, freqs, keep_normed
    )


# ---- mHC ---------------------------------------------------------------------------------------


def mhc_triplet(
    residual: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    batch_invariant: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mixing coefficients of one hyper-connection site (`model.md` §3.2).

    residual: [T, N, D]; batch_invariant: the mix matmul's fixed-order path (`dense_matmul`).
    Outside that mode `kernels.mhc_triplet` runs the whole site in two launches (CUDA or
    Triton's interpreter), or its torch reference.
    Returns fp32 `pre [T, N]`, `post [T, N]` and the doubly-stochastic
    `comb [T, N, N]` indexed `comb[t, j, i]` (row j = source stream, column i = target stream).
    """
    if not batch_invariant:
        if runs_kernels(residual):
            return mhc_triplet_kernel.mhc_triplet(
                residual, fn, base, scale, norm_eps, hc_eps, iters
            )
        return mhc_triplet_kernel.mhc_triplet_reference(
            residual, fn, base, scale, norm_eps, hc_eps, iters
        )
    n = residual.shape[1]
    z = residual.flatten(1).float()
    mean_square = row_sum(z.square(), True)[:, None] / z.shape[-1]
    mix = dense_matmul(z, fn.float(), True) * torch.rsqrt(mean_square + norm_eps)
    logits = mhc_triplet_kernel.mhc_logits_reference(mix, base, scale, n)
    if runs_kernels(logits):
        return mhc_mix_kernel.mhc_mix(logits, n, hc_eps, iters)
    return mhc_mix_kernel.mhc_mix_reference(logits, n, hc_eps, iters)


def mhc_combine(residual: Tensor, weights: Tensor | None) -> Tensor:
    """`Σ_k w[k] · R[k]` in fp32, cast to R's dtype; `weights=None` means stream 0
    (`kernels.mhc_combine` on CUDA: one launch)."""
    if weights is None:
        return residual[:, 0]
    if runs_kernels(residual):
        return mhc_combine_kernel.mhc_combine(residual, weights)
    return mhc_combine_kernel.mhc_combine_reference(residual, weights)


def mhc_combine_norm(
    residual: Tensor, weights: Tensor | None, norm_weight: Tensor, eps: float
) -> Tensor:
    """`rms_norm(mhc_combine(residual, weights), norm_weight, eps)`: a sublayer's input
    (`kernels.mhc_combine.mhc_combine_norm` on the kernel path: one launch, bit for bit the
    two)."""
    if weights is not None and runs_kernels(residual):
        return mhc_combine_kernel.mhc_combine_norm(residual, weights, norm_weight, eps)
    return rms_norm(mhc_combine(residual, weights), norm_weight, eps)


def mhc_post_combine_norm(
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    y: Tensor,
    weights: Tensor,
    norm_weight: Tensor,
    eps: float,
    kernel_order: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(R' = `mhc_post(residual, post, comb, y)`, `mhc_combine_norm(R', weights, norm_weight,
    eps)`, and with `kernel_order` on the kernel path the latter in the grouped MXFP4 GEMM's K
    order, else None): a site's residual update and the next sublayer's input
    (`kernels.mhc_post.mhc_post_combine_norm` on the kernel path: one launch, bit for bit the
    two)."""
    if runs_kernels(residual):
        return mhc_post_kernel.mhc_post_combine_norm(
            residual, post, comb, y, weights, norm_weight, eps, kernel_order
        )
    updated = mhc_post(residual, post, comb, y)
    return updated, mhc_combine_norm(updated, weights, norm_weight, eps), None


def mhc_post(
    residual: Tensor, post: Tensor, comb: Tensor, y: Tensor, slots: Tensor | None = None
) -> Tensor:
    """`R'[i] = post[i]·y + Σ_j comb[j][i]·R[j]` in fp32, cast to R's dtype (`kernels.mhc_post`
    on CUDA: one launch, no [T, N, N, D] intermediate). slots: y is a MoE layer's unreduced
    output (`MoE.forward(unreduced=True)`: the shared output and the routed slots), combined
    first.

    NOTE: the contraction runs over the FIRST index of comb (combᵀ·R); comb·R is a silent bug.
    """
    if runs_kernels(residual):
        return mhc_post_kernel.mhc_post(residual, post, comb, y, slots)
    return mhc_post_kernel.mhc_post_reference(residual, post, comb, y, slots)


# ---- MoE routing -------------------------------------------------------------------------------


# ---- pointwise functions whose rounding does not depend on where an element sits ---------------
#
# torch's CPU kernels run a tensor's elements through a vector loop and its last
# numel % (2 · vector width) elements through a scalar loop; for sigmoid, SiLU and softplus the
# two round differently, so the same value gets another last bit when the rows behind it
# change (measured). exp, log1p, +, / round alike in both loops, so the forms below are a
# function of the element alone (batch-invariant mode); CUDA computes every element alike.


def sigmoid(x: Tensor, batch_invariant: bool = False) -> Tensor:
    """`torch.sigmoid`; batch_invariant: `1 / (1 + exp(−x))` (see above)."""
    return 1 / (1 + torch.exp(-x)) if batch_invariant else torch.sigmoid(x)


def silu(x: Tensor, batch_invariant: bool = False) -> Tensor:
    """`F.silu`; batch_invariant: `x / (1 + exp(−x))` (see above)."""
    return x / (1 + torch.exp(-x)) if batch_invariant else F.silu(x)


def softplus(x: Tensor, batch_invariant: bool = False) -> Tensor:
    """`F.softplus` (threshold 20); batch_invariant: `log1p(exp(x))`, x above 20 (see above)."""
    if not batch_invariant:
        return F.softplus(x)
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def pair_softmax(a: Tensor, b: Tensor, batch_invariant: bool = False) -> Tensor:
    """Softmax of two tensors against each other: [2, ...] (torch's softmax over a leading
    dim rounds like the pointwise functions above; batch_invariant spells it out)."""
    if not batch_invariant:
        return torch.stack((a, b)).softmax(0)
    top = torch.maximum(a, b)
    ea, eb = torch.exp(a - top), torch.exp(b - top)
    total = ea + eb
    return torch.stack((ea / total, eb / total))


def sqrtsoftplus_route(
    logits: Tensor, bias: Tensor, top_k: int, route_scale: float, batch_invariant: bool = False
) -> tuple[Tensor, Tensor]:
    """Top-k routing (`model.md` §3.8): returns (expert ids [T, k], fp32 weights [T, k]).

    `s = sqrt(softplus(logits))`; choice = s + bias; weights = s_top / (Σ s_top + 1e-20) · scale.
    The correction bias steers the choice only and never scales the weights.
    `kernels.moe_routing` on CUDA: one launch, a program per token, so batch-invariant by
    construction (both modes take it); elsewhere its torch reference (softplus and the sum
    spelled out in batch-invariant mode, see above).
    """
    if runs_kernels(logits):
        return moe_routing_kernel.sqrtsoftplus_route(logits, bias, top_k, route_scale)
    return moe_routing_kernel.sqrtsoftplus_route_reference(
        logits, bias, top_k, route_scale, batch_invariant
    )


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float, batch_invariant: bool = False) -> Tensor:
    """`silu(min(gate, limit)) ⊙ clamp(up, −limit, limit)`."""
    return silu(gate.clamp(max=limit), batch_invariant) * up.clamp(-limit, limit)
