"""Mixture of experts of one layer (`model.md` §3.8): sqrt-softplus routing, clamped SwiGLU.

Routed experts hold their weights either dequantised (`nn.Linear` in the model dtype) or as
stored in the checkpoint (`MXFP4Linear`: e2m1 codes + e8m0 scales, a quarter of the bf16 bytes),
which is what lets the full-width model fit one GPU; the shared expert is always dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.deepseek_v41.primitives import clamped_swiglu, sqrtsoftplus_route
from engine.models.deepseek_v41.weight_formats import MXFP4_BLOCK, mxfp4_dequantize


class MXFP4Linear(nn.Module):
    """`y = x · Wᵀ` with W stored as MXFP4 along the input dim (checkpoint layout, `model.md`):
    `weight` int8 [out, in/2] (byte c: code of column 2c | code of column 2c+1 << 4) and
    `scale` float8_e8m0fnu [out, in/32].

    Reference path: W is dequantised to the activation dtype for each call (exactly the values
    the dense path holds); a fused kernel replaces it on the GPU.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        if in_features % MXFP4_BLOCK:
            raise ValueError(f"in_features must be a multiple of {MXFP4_BLOCK}, got {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        packed = torch.zeros(out_features, in_features // 2, dtype=torch.int8)
        self.register_buffer("weight", packed)
        self.register_buffer(
            "scale",
            torch.zeros(out_features, in_features // MXFP4_BLOCK, dtype=torch.float8_e8m0fnu),
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, mxfp4_dequantize(self.weight, self.scale, dtype=x.dtype))


class Expert(nn.Module):
    """`w2 · (silu(min(w1·x, L)) ⊙ clamp(w3·x, −L, L))`; names match `ffn.experts.{e}.w{1,2,3}`.

    quantized: hold the three projections as `MXFP4Linear` (routed experts only).
    """

    def __init__(
        self, dim: int, inter: int, limit: float, dtype: torch.dtype, quantized: bool = False
    ) -> None:
        super().__init__()
        self.limit = limit
        if quantized:
            self.w1 = MXFP4Linear(dim, inter)
            self.w3 = MXFP4Linear(dim, inter)
            self.w2 = MXFP4Linear(inter, dim)
        else:
            self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype)
            self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype)
            self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """`weight` [T, 1], when given, scales the activation before the down projection."""
        act = clamped_swiglu(self.w1(x), self.w3(x), self.limit)
        if weight is not None:
            act = (act.float() * weight).to(act.dtype)
        return self.w2(act)


class Gate(nn.Module):
    def __init__(self, dim: int, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))


class MoE(nn.Module):
    """Routed experts (top-k of `num_experts`) plus one always-on shared expert."""

    def __init__(
        self,
        dim: int,
        inter: int,
        num_experts: int,
        top_k: int,
        route_scale: float,
        limit: float,
        dtype: torch.dtype,
        quantized_experts: bool = False,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.route_scale = route_scale
        self.weight_before_down = False  # see `Numerics.moe_weight_before_down`
        self.gate = Gate(dim, num_experts, dtype)
        self.shared_experts = Expert(dim, inter, limit, dtype)
        self.experts = nn.ModuleList(
            Expert(dim, inter, limit, dtype, quantized_experts) for _ in range(num_experts)
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(expert ids [T, k], fp32 weights [T, k]); gate logits are computed in fp32."""
        logits = x.float() @ self.gate.weight.float().t()
        return sqrtsoftplus_route(logits, self.gate.bias, self.top_k, self.route_scale)

    def forward(self, x: Tensor) -> Tensor:
        ids, weights = self.route(x)
        out = self.shared_experts(x).float()
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        routed = torch.zeros_like(out)
        lo = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                rows = token_of[lo : lo + count]
                w = weights.flatten()[order[lo : lo + count], None]
                if self.weight_before_down:
                    y = expert(x[rows], w).float()
                else:
                    y = expert(x[rows]).float() * w
                routed.index_add_(0, rows, y)
            lo += count
        return (out + routed).to(x.dtype)
