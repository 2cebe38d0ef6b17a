"""Sqrt-softplus top-k routing (`model.md` §3.8) in one launch: one program per token.

    s        = sqrt(softplus(f32(logit)))          softplus(x) = x if x > 20 else log1p(exp(x))
    choice   = s + f32(bias)                       (the bias steers the choice, never the weights)
    ids      = top-k of choice by repeated argmax  (best first; ties: the lowest expert id)
    weights  = s[ids] / (Σ_slots s[ids] + 1e-20) · route_scale   (the sum in slot order)

The torch version is ~9 launches (cast, softplus, sqrt, bias add, topk, gather, sum, divide,
scale) per layer. Rounding on CUDA: exp and log1p are libdevice's (`expf` / `log1pf`, what torch's
CUDA softplus calls), compiled without libdevice's flush-to-zero, sqrt and the division
round to nearest (`sqrt.rn`, `div.rn`, as nvcc's defaults), so each score is torch's on CUDA
bit for bit; the weights then differ from `sqrtsoftplus_route_reference` only by the order of
torch's sum over the k scores (a 4-thread tree on CUDA: up to k + 1 ulps, see the CUDA test;
none against its batch-invariant form, which sums in slot order too). Triton's CPU interpreter
has no libdevice: there numpy's exp and log, with
log1p(e) = log(1 + e) · e / ((1 + e) − 1) (exact to a few ulps), stand in.

A token's result depends on its own row only (one program reads one row, in the same order for
every batch): the kernel is batch-invariant by construction, and serves both modes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from kernels import check_runnable, interpreting

__all__ = ["CUDA_OPTIONS", "sqrtsoftplus_route", "sqrtsoftplus_route_reference"]

_LIBDEVICE = not interpreting()
# NOTE: libdevice's expf / log1pf without flush-to-zero, as torch's (nvcc's default).
CUDA_OPTIONS = {"enable_reflect_ftz": False}
_SOFTPLUS_THRESHOLD = 20.0  # torch's default


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    num_experts,
    stride_t,
    route_scale,
    TOP_K: tl.constexpr,
    E_PAD: tl.constexpr,
    SLOTS: tl.constexpr,
    THRESHOLD: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    inside = experts < num_experts
    x = tl.load(logits_ptr + token * stride_t + experts, mask=inside, other=0.0).to(tl.float32)
    below = tl.minimum(x, THRESHOLD)
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(below))
    else:
        e = tl.exp(below)
        u = 1.0 + e
        exact = u == 1.0
        soft = tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))
    scores = tl.sqrt_rn(tl.where(x > THRESHOLD, x, soft))
    bias = tl.load(bias_ptr + experts, mask=inside, other=0.0).to(tl.float32)
    choice = scores + bias
    slots = tl.arange(0, SLOTS)
    ids = tl.zeros([SLOTS], dtype=tl.int32)
    chosen = tl.zeros([SLOTS], dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    available = inside
    for slot in tl.static_range(TOP_K):
        best = tl.max(tl.where(available, choice, -float("inf")), axis=0)
        pick = tl.min(tl.where(available & (choice == best), experts, E_PAD), axis=0)
        # a NaN choice matches nothing: take the lowest expert still available
        pick = tl.where(pick == E_PAD, tl.min(tl.where(available, experts, E_PAD), axis=0), pick)
        is_pick = experts == pick
        score = tl.sum(tl.where(is_pick, scores, 0.0), axis=0)  # the one score, exactly
        total = total + score
        ids = tl.where(slots == slot, pick, ids)
        chosen = tl.where(slots == slot, score, chosen)
        available = available & ~is_pick
    weights = tl.div_rn(chosen, total + 1e-20) * route_scale
    in_top = slots < TOP_K
    tl.store(ids_ptr + token * TOP_K + slots, ids.to(tl.int64), mask=in_top)
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=in_top)


def sqrtsoftplus_route(
    logits: Tensor, bias: Tensor, top_k: int, route_scale: float
) -> tuple[Tensor, Tensor]:
    """(expert ids int64 [T, k], fp32 weights [T, k]) of the routing rule above, one launch.

    logits: float [T, E] (unit column stride); bias: float [E].

    Raises:
        ValueError: other shapes, top_k outside 1..E, or not on CUDA (or Triton's interpreter).
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point or logits.stride(-1) != 1:
        raise ValueError(f"logits must be float [T, E], unit column stride; got {logits.shape}")
    num_tokens, num_experts = logits.shape
    if bias.shape != (num_experts,) or not bias.dtype.is_floating_point:
        raise ValueError(f"bias must be float [{num_experts}], got {tuple(bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    check_runnable(logits, "sqrtsoftplus_route")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens:
        options = {} if interpreting() else CUDA_OPTIONS
        _route_kernel[(num_tokens,)](
            logits,
            bias.contiguous(),
            ids,
            weights,
            num_experts,
            logits.stride(0),
            float(route_scale),
            TOP_K=top_k,
            E_PAD=triton.next_power_of_2(num_experts),
            SLOTS=triton.next_power_of_2(top_k),
            THRESHOLD=_SOFTPLUS_THRESHOLD,
            LIBDEVICE=_LIBDEVICE,
            num_warps=4 if num_experts > 256 else 2,
            **options,
        )
    return ids, weights


def sqrtsoftplus_route_reference(
    logits: Tensor, bias: Tensor, top_k: int, route_scale: float, batch_invariant: bool = False
) -> tuple[Tensor, Tensor]:
    """The rule in torch (any device): `torch.topk` (ties in torch's order), torch's sum.

    batch_invariant: softplus spelled `log1p(exp(x))` (x above 20) and the sum in slot order,
    which round alike wherever an element sits in the tensor (`primitives.softplus`'s note:
    torch's CPU softplus rounds its vector loop and its scalar tail differently).
    """
    x = logits.float()
    if batch_invariant:
        soft = torch.where(x > _SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp(max=20))))
    else:
        soft = F.softplus(x)
    scores = torch.sqrt(soft)
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    chosen = scores.gather(-1, ids)
    if batch_invariant:  # slot order, as elementwise adds
        total = chosen[:, :1]
        for slot in range(1, top_k):
            total = total + chosen[:, slot : slot + 1]
    else:
        total = chosen.sum(-1, keepdim=True)
    weights = chosen / (total + 1e-20) * route_scale
    return ids, weights
