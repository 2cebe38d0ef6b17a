"""Engram n-gram memory of one layer (`model.md` §3.9): gather, project, gate into each stream.

The tables stay FP8 (e4m3 + one ue8m0 scale per 32 columns of a row) and only the gathered rows
are dequantised; a real table has ~384 M rows and must never be materialised.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.weight_formats import fp8_row_dequantize


class EngramTable(nn.Module):
    """Quantised table buffers named as in the checkpoint: `engram.embed.{weight,scale}`."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(rows, dim // 32, dtype=torch.float8_e8m0fnu))

    def lookup(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return fp8_row_dequantize(self.weight, self.scale, ids, dtype=dtype)


class Engram(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, rows: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, n = cfg.hidden_size, cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        self.embed = EngramTable(rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(
            cfg.engram_lookups * cfg.engram_head_dim, (n + 1) * d, bias=False, dtype=dtype
        )
        self.q_weight = nn.Parameter(torch.ones(n, d, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n, d, dtype=dtype))

    def forward(self, residual: Tensor, hash_ids: Tensor, is_image: Tensor | None = None) -> Tensor:
        """residual [T, N, D], hash_ids [T, lookups] (rows into the table) → gated residual.

        `dot_k = Σ_d R_k·(q_k⊙k_k)·key_k · rsqrt(ms(R_k)+ε) · rsqrt(ms(key_k)+ε) · D^-½`,
        `g_k = sigmoid(sign(dot)·sqrt(max(|dot|, 1e-6)))`, `R'_k = R_k + g_k·v` in fp32.
        """
        num_tokens, n, d = residual.shape
        emb = self.embed.lookup(hash_ids, residual.dtype).flatten(1)
        kv = self.wkv(emb).float()
        key = kv[:, : n * d].view(num_tokens, n, d)
        value = kv[:, n * d :]
        r = residual.float()
        a = self.q_weight.float() * self.k_weight.float()
        rstd = torch.rsqrt(r.square().mean(-1) + self.eps)
        rstd = rstd * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (r * a * key).sum(-1) * rstd * d**-0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
        if is_image is not None:
            gate = gate.masked_fill(is_image[:, None], 0.0)
        return (r + gate.unsqueeze(-1) * value.unsqueeze(1)).to(residual.dtype)
