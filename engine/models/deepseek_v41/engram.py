"""Engram n-gram memory of one layer (`model.md` §3.9): gather, project, gate into each stream.

The tables stay FP8 (e4m3 + one ue8m0 scale per 32 columns of a row) and only the gathered rows
are dequantised; a real table has ~384 M rows and must never be materialised.

Two placements of a table (`engram_store.ENGRAM_PLACEMENTS`):

    device  EngramTable      buffers on the model's device; gather + dequantise there
    host    HostEngramTable  host tensors mapped from the checkpoint (one copy per node);
                             rows gathered on the host into a staging buffer (pinned on CUDA),
                             copied to the device on a side stream, dequantised there

Both dequantise the same bytes with the same ops (`fp8_row_dequantize`), so they give the
same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.dense import Linear, row_sum
from engine.models.deepseek_v41.primitives import sigmoid
from engine.models.deepseek_v41.weight_formats import fp8_row_dequantize
from kernels import engram_gate as engram_gate_kernel
from kernels import runs_kernels


class EngramTable(nn.Module):
    """Quantised table buffers named as in the checkpoint: `engram.embed.{weight,scale}`."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(rows, dim // 32, dtype=torch.float8_e8m0fnu))

    def lookup(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return fp8_row_dequantize(self.weight, self.scale, ids, dtype=dtype)


class HostEngramTable(nn.Module):
    """A table held in host memory: `weight` uint8 [rows, dim], `scale` uint8 [rows, dim/32]
    (the stored e4m3 / ue8m0 bytes), typically zero-copy views of the checkpoint's mapped file
    (`engram_store.map_engram_tables`). Holds no buffer: `Module.to` leaves it on the host and
    `state_dict` does not list it.

    `prefetch(ids, device)` gathers the rows of `ids` on the host and starts their copy to
    `device` (a side stream on CUDA); `lookup` with the same `ids` tensor then waits for that
    copy only. `lookup` of other ids gathers synchronously.

    NOTE: one step in flight per table: `prefetch` first waits for the previous copy out of the
    staging buffer to finish before overwriting it.
    """

    def __init__(self, weight: Tensor, scale: Tensor, keepalive: object = None) -> None:
        super().__init__()
        if weight.device.type != "cpu" or scale.device.type != "cpu":
            raise ValueError("a host Engram table must be on the CPU")
        self.host_weight = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
        self.host_scale = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
        self._keepalive = keepalive  # the mapping the views point into
        self._staging: tuple[Tensor, Tensor] | None = None
        self._on_device: tuple[Tensor, Tensor] | None = None
        self._copied = None  # torch.cuda.Event of the last copy out of staging
        self._stream = None
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None  # (ids, weight, scale)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host_weight, self.host_scale))

    def prefetch(self, ids: Tensor, device: torch.device) -> None:
        """Gather the rows of `ids` (any shape, any device) and start their copy to `device`."""
        rows = ids.reshape(-1).cpu()
        if device.type != "cuda":
            weight = self.host_weight.index_select(0, rows)
            scale = self.host_scale.index_select(0, rows)
            self._pending = (ids, weight.to(device), scale.to(device))
            return
        if self._copied is not None:
            self._copied.synchronize()
        staged_w, staged_s = self._staging_pair(len(rows), device)
        torch.index_select(self.host_weight, 0, rows, out=staged_w[0][: len(rows)])
        torch.index_select(self.host_scale, 0, rows, out=staged_s[0][: len(rows)])
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
            self._copied = torch.cuda.Event()
        self._stream.wait_stream(torch.cuda.current_stream(device))  # last step's reads done
        with torch.cuda.stream(self._stream):
            weight = staged_w[1][: len(rows)]
            scale = staged_s[1][: len(rows)]
            weight.copy_(staged_w[0][: len(rows)], non_blocking=True)
            scale.copy_(staged_s[0][: len(rows)], non_blocking=True)
            self._copied.record(self._stream)
        self._pending = (ids, weight, scale)

    def _staging_pair(self, num_rows: int, device: torch.device) -> tuple[tuple, tuple]:
        """((pinned weight, device weight), (pinned scale, device scale)) of >= num_rows rows."""
        if self._staging is None or self._staging[0].shape[0] < num_rows:
            capacity = 1 << max(num_rows - 1, 1).bit_length()
            dim, blocks = self.host_weight.shape[1], self.host_scale.shape[1]
            self._staging = (
                torch.empty(capacity, dim, dtype=torch.uint8, pin_memory=True),
                torch.empty(capacity, blocks, dtype=torch.uint8, pin_memory=True),
            )
            self._on_device = (
                torch.empty(capacity, dim, dtype=torch.uint8, device=device),
                torch.empty(capacity, blocks, dtype=torch.uint8, device=device),
            )
        return (self._staging[0], self._on_device[0]), (self._staging[1], self._on_device[1])

    def lookup(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        if self._pending is None or self._pending[0] is not ids:
            self.prefetch(ids, ids.device)
        _, weight, scale = self._pending
        self._pending = None
        if weight.device.type == "cuda":
            torch.cuda.current_stream(weight.device).wait_event(self._copied)
        rows = fp8_row_dequantize(weight, scale, dtype=dtype)
        return rows.view(*ids.shape, rows.shape[-1])


class Engram(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, rows: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, n = cfg.hidden_size, cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        self.embed = EngramTable(rows, cfg.engram_head_dim)
        self.wkv = Linear(cfg.engram_lookups * cfg.engram_head_dim, (n + 1) * d, dtype)
        self.q_weight = nn.Parameter(torch.ones(n, d, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(n, d, dtype=dtype))
        self.batch_invariant = False  # the gate's sigmoid; see `Numerics.batch_invariant`

    def forward(self, residual: Tensor, hash_ids: Tensor, is_image: Tensor | None = None) -> Tensor:
        """residual [T, N, D], hash_ids [T, lookups] (rows into the table) → gated residual.

        `dot_k = Σ_d R_k·(q_k⊙k_k)·key_k · rsqrt(ms(R_k)+ε) · rsqrt(ms(key_k)+ε) · D^-½`,
        `g_k = sigmoid(sign(dot)·sqrt(max(|dot|, 1e-6)))`, `R'_k = R_k + g_k·v` in fp32.
        """
        emb = self.embed.lookup(hash_ids, residual.dtype).flatten(1)
        kv = self.wkv(emb)
        if runs_kernels(residual):
            return engram_gate_kernel.engram_gate(
                residual, kv, self.q_weight, self.k_weight, self.eps, is_image
            )
        return engram_gate_reference(
            residual, kv, self.q_weight, self.k_weight, self.eps, is_image, self.batch_invariant
        )


def engram_gate_reference(
    residual: Tensor,
    kv: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    is_image: Tensor | None = None,
    batch_invariant: bool = False,
) -> Tensor:
    """The gate's torch form (`kernels.engram_gate` on the kernel path: one launch, a program
    per token, so batch-invariant in both modes): residual [T, N, D], the lookups' projection
    kv [T, (N+1)·D], the [N, D] weights, is_image bool [T] or None → the gated residual;
    batch_invariant: the row sums and the sigmoid in their fixed forms."""
    num_tokens, n, d = residual.shape
    kv = kv.float()
    key = kv[:, : n * d].view(num_tokens, n, d)
    value = kv[:, n * d :]
    r = residual.float()
    a = q_weight.float() * k_weight.float()
    if batch_invariant:
        r_ms, key_ms = row_sum(r.square(), True) / d, row_sum(key.square(), True) / d
    else:
        r_ms, key_ms = r.square().mean(-1), key.square().mean(-1)
    rstd = torch.rsqrt(r_ms + eps) * torch.rsqrt(key_ms + eps)
    dot = row_sum(r * a * key, batch_invariant) * rstd * d**-0.5
    gate = sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt(), batch_invariant)
    if is_image is not None:
        gate = gate.masked_fill(is_image[:, None], 0.0)
    return (r + gate.unsqueeze(-1) * value.unsqueeze(1)).to(residual.dtype)
