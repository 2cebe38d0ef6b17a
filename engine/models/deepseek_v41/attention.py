"""CSA2 attention of one layer (`model.md` §3.4–§3.7): window + sink, KV sources, indexers.

Every function here is vectorised over tokens and sequences of a `StepBatch`; a step may carry
any number of new positions per sequence, so one-shot, chunked and token-by-token runs share this
code. The only loops are over query groups (the indexer's scores, the gathered global rows),
to bound their buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.decode_batch import PaddedDecodeBatch, is_padded_decode
from engine.models.deepseek_v41.dense import (
    Linear,
    bf16_mm_to_fp32_runs,
    bmm_exact_bf16,
    dense_matmul,
    fp32_on_tensor_cores,
    fp32_times_bf16,
    grouped_linear,
)
from engine.models.deepseek_v41.kv_formats import KVCodec
from engine.models.deepseek_v41.primitives import (
    apply_rope,
    mhc_combine_norm,
    mhc_post_combine_norm,
    pair_softmax,
    rms_norm,
    rms_norm_rope,
)
from engine.models.deepseek_v41.state import BLOCK_TOKENS, PAIR_RING, ModelState, StepBatch
from kernels import runs_kernels

# Upper bound on elements of one indexer score buffer [chunk, heads, J].
_INDEX_SCORE_ELEMS = 1 << 25
# Upper bound on elements of one group of gathered global rows [tokens, K, hd] (fp32).
_GLOBAL_ROW_ELEMS = 1 << 28
# Query tokens per group of the batch-invariant attention (every group padded to this).
_TOKEN_GROUP = 32


def _ascending_selection(sel: Tensor, width: int) -> Tensor:
    """A selection [..., k] (−1 = none) as [..., width]: the chosen positions ascending, then
    −1s. The order no longer depends on k (the batch's longest context) or on top-k's order."""
    missing = torch.iinfo(sel.dtype).max
    ordered = torch.where(sel < 0, missing, sel).sort(-1).values
    ordered = F.pad(ordered, (0, width - sel.shape[-1]), value=missing)
    return ordered.masked_fill(ordered == missing, -1)


@dataclass(frozen=True)
class KVCodecs:
    """How the three kinds of stored rows are encoded (quantised or exact)."""

    swa: KVCodec
    global_kv: KVCodec
    index: KVCodec


@dataclass
class StepContext:
    """Per-forward shared data: the batch, the state, and the selections published so far."""

    batch: StepBatch
    state: ModelState
    codecs: KVCodecs
    selection: dict[int, Tensor] = field(default_factory=dict)  # ratio → [T, K] (−1 = none)
    candidates: Tensor | None = None  # [B, T_max, J_max] bool, from the candidate source
    record: dict[str, Any] | None = None
    # The KV sources already wrote this step's rows (the decoder part of a decoder bounded
    # replay: the boundary source wrote every row of the whole step, `StepBatch.decoder_part`).
    sources_written: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def of_combination(self, residual: Tensor, weights: Tensor | None) -> Tensor:
        """`self(mhc_combine(residual, weights))`, a sublayer's input, in one launch on the
        kernel path (`primitives.mhc_combine_norm`)."""
        return mhc_combine_norm(residual, weights, self.weight, self.eps)

    def of_updated_combination(
        self,
        residual: Tensor,
        post: Tensor,
        comb: Tensor,
        y: Tensor,
        weights: Tensor,
        kernel_order: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(R' = `mhc_post(residual, post, comb, y)`, `self.of_combination(R', weights)`, that
        in the grouped GEMM's K order where asked for and on the kernel path, else None) in one
        launch on the kernel path (`primitives.mhc_post_combine_norm`)."""
        return mhc_post_combine_norm(
            residual, post, comb, y, weights, self.weight, self.eps, kernel_order
        )

    def rotated(self, x: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        """`apply_rope(self(x), positions, freqs)` (one position per row), in one launch on the
        kernel path (`primitives.rms_norm_rope`)."""
        return rms_norm_rope(x, self.weight, self.eps, positions, freqs)[0]

    def rotated_and_plain(
        self, x: Tensor, positions: Tensor, freqs: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(`self.rotated(x, positions, freqs)`, `self(x)`) from one launch on the kernel
        path."""
        rotated, normed = rms_norm_rope(x, self.weight, self.eps, positions, freqs, True)
        return rotated, normed

    def rotated_encoded(
        self,
        x: Tensor,
        positions: Tensor,
        freqs: Tensor,
        codec: KVCodec,
        copy_to: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """`codec.encode(self.rotated(x, positions, freqs))`, in one launch where the codec has
        a kernel for all three (`KVCodec.normed_rotated_encode`: MXFP8 window rows); copy_to:
        as that method's."""
        return codec.normed_rotated_encode(x, self.weight, self.eps, positions, freqs, copy_to)


def _linear(n_in: int, n_out: int, dtype: torch.dtype) -> Linear:
    return Linear(n_in, n_out, dtype)


def _global_row_address(
    batch: StepBatch, seq: Tensor, j: Tensor, ratio: int
) -> tuple[Tensor, Tensor]:
    """Pool (block, row) of compressed position `j` of sequence `seq` (j ≥ 0)."""
    rows_per_block = BLOCK_TOKENS // ratio
    block = batch.block_tables[seq, (j * ratio) // BLOCK_TOKENS]
    return block, j % rows_per_block


def _compressed_row_addresses(batch: StepBatch, ratio: int, num_j: int) -> tuple[Tensor, Tensor]:
    """Pool (block, row) [B, J] of compressed positions 0..J−1 of every sequence (block −1,
    unallocated, read as block 0: those positions are invisible)."""
    j = torch.arange(num_j, device=batch.block_tables.device)
    seq = torch.arange(batch.num_seqs, device=j.device)[:, None].expand(-1, num_j)
    block, row = _global_row_address(batch, seq, j[None, :].expand_as(seq), ratio)
    return block.clamp(min=0), row


def _index_visibility(batch: StepBatch, ratio: int, num_j: int) -> tuple[Tensor, Tensor]:
    """(compressed positions visible to each query [B, T_max], the hidden mask [B, T_max, J]):
    a query at position p sees j < (p + 1) // ratio; padding rows see none."""
    pos = batch.pad(batch.positions, fill=-1)
    num_visible = torch.div(pos + 1, ratio, rounding_mode="floor")
    j = torch.arange(num_j, device=pos.device)
    return num_visible, j[None, None, :] >= num_visible[..., None]


@dataclass(frozen=True)
class _TokenPairs:
    """Where a ratio-2 compressor finds and keeps token pairs (2i, 2i+1) in a step: the same
    for every such source layer, so built once per step (`StepBatch.shared`)."""

    odd: Tensor  # flat indices of the odd-position tokens (each closes a pair)
    partner: Tensor  # flat index of each one's even partner when that is in the step (else 0)
    in_call: Tensor  # [G, 1] bool: the partner is in this step (else in the pending ring)
    odd_slot: Tensor  # state slot of each odd token
    odd_ring_row: Tensor  # pending-ring row of each one's even partner
    group_position: Tensor  # RoPE position 2i of each pair
    kept_even: Tensor  # flat indices of the even tokens whose (k, gate) the ring keeps
    kept_slot: Tensor
    kept_ring_row: Tensor

    @classmethod
    def of(cls, batch: StepBatch) -> _TokenPairs:
        pos, seq = batch.positions, batch.seq_of_token
        slot = batch.slots[seq]
        local = torch.arange(pos.numel(), device=pos.device) - batch.pad_index[:, 0][seq]
        odd = batch.token_indices(parity=1)
        keep = batch.token_indices(tail=2 * PAIR_RING, parity=0)
        return cls(
            odd=odd,
            partner=(odd - 1).clamp(min=0),
            in_call=(local[odd] > 0)[:, None],
            odd_slot=slot[odd],
            odd_ring_row=((pos[odd] - 1) // 2) % PAIR_RING,
            group_position=pos[odd] - 1,
            kept_even=keep,
            kept_slot=slot[keep],
            kept_ring_row=(pos[keep] // 2) % PAIR_RING,
        )


class Compressor(nn.Module):
    """Global-KV producer of a KV source layer (`model.md` §3.5).

    Ratio 1: one latent per token. Ratio 2: per-channel softmax pooling of token pairs
    (2i, 2i+1); the latent appears when the odd token arrives and carries RoPE position 2i.
    The even token's fp32 (k, gate) waits in the pending ring until its partner arrives.
    `forward` returns the latents before `norm`: the KV source normalises and rotates them in
    one step (`Attention.write_source`, `RMSNorm.rotated_and_plain`).
    """

    def __init__(self, cfg: DeepseekV41Config, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = ratio
        self.eps = cfg.rms_norm_eps
        self.wkv = _linear(cfg.hidden_size, cfg.head_dim, dtype)
        if ratio == 2:
            self.wgate = _linear(cfg.hidden_size, cfg.head_dim, dtype)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.batch_invariant = False  # the pair softmax's; see `Numerics.batch_invariant`

    def forward(self, x: Tensor, ctx: StepContext, source_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (latents before `norm` [G, head_dim] in x's dtype, group positions [G], token
        index of each group [G])."""
        batch = ctx.batch
        pos = batch.positions
        if self.ratio == 1:
            return self.wkv(x), pos, torch.arange(pos.numel(), device=pos.device)
        kg = self.keys_and_gates(x)
        k, g = kg.unbind(1)
        pending = ctx.state.pending[source_id]
        if is_padded_decode(batch):
            return self._pool_every_row(kg, pending, batch, x.dtype)
        pairs = batch.shared("compressor pairs", lambda: _TokenPairs.of(batch))
        odd = pairs.odd
        carried = pending[pairs.odd_slot, pairs.odd_ring_row]  # [G, 2, D]
        k_even = torch.where(pairs.in_call, k[pairs.partner], carried[:, 0])
        g_even = torch.where(pairs.in_call, g[pairs.partner], carried[:, 1])
        weights = pair_softmax(g_even, g[odd], self.batch_invariant)
        pooled = weights[0] * k_even + weights[1] * k[odd]
        # Keep (k, gate) of recent even tokens: a later step may need any of them as a partner
        # (drafts past an accepted even position are recomputed from here).
        keep = pairs.kept_even
        pending[pairs.kept_slot, pairs.kept_ring_row] = kg[keep]
        return pooled.to(x.dtype), pairs.group_position, odd

    def pack_projections(self) -> None:
        """Ratio 2: stack the bf16 `wkv` and `wgate` weights, which both read the attention
        input, into one [2·hd, D] buffer (`wkv_gate_weight`, non-persistent); both weights
        become views of it, so memory does not grow and checkpoint names and state dicts stay.
        Then the tensor-core path runs the two fp32 products as one (`keys_and_gates`).

        NOTE: call it once the model is on its device (`Attention.pack_projections` does).
        Other linears (FP8, fp32 weights: no tensor-core product) stay apart."""
        if self.ratio != 2 or not (type(self.wkv) is Linear and type(self.wgate) is Linear):
            return
        if not self.wkv.weight.dtype == self.wgate.weight.dtype == torch.bfloat16:
            return
        packed = torch.cat((self.wkv.weight.detach(), self.wgate.weight.detach()))
        self.register_buffer("wkv_gate_weight", packed, persistent=False)
        hd = self.wkv.weight.shape[0]
        self.wkv.weight = nn.Parameter(packed[:hd], requires_grad=False)
        self.wgate.weight = nn.Parameter(packed[hd:], requires_grad=False)

    def keys_and_gates(self, x: Tensor) -> Tensor:
        """fp32 (`wkv.forward_fp32(x)`, `wgate.forward_fp32(x)`) stacked as [T, 2, hd]: the
        pending ring's row layout. Packed (`pack_projections`) and on the tensor-core path
        (`dense.fp32_on_tensor_cores`): one product over the packed weight (one split, one
        GEMM, one sum), whose output rows are [k | gate] already.

        NOTE: one GEMM of N = 2·hd columns may sum a column in another order than the GEMM of
        its own N (the library picks its kernel by shape), as `Attention.latents`'."""
        packed = getattr(self, "wkv_gate_weight", None)
        if packed is not None and fp32_on_tensor_cores(x, packed, self.wkv.batch_invariant):
            return fp32_times_bf16(x, packed).unflatten(-1, (2, -1))
        return torch.stack((self.wkv.forward_fp32(x), self.wgate.forward_fp32(x)), 1)

    def _pool_every_row(
        self, kg: Tensor, pending: Tensor, batch: PaddedDecodeBatch, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`forward`'s ratio-2 pooling for a padded decode step, over every row: an odd
        position pools with its even partner from the pending ring (a decode row's partner is
        never in the step), an even one only stores its (k, gate) there. Latents of even rows
        are garbage (`write_source` sends them to the trash block); group position p − 1."""
        k, g = kg.unbind(1)
        pos, slot = batch.positions, batch.slots
        carried = pending[slot, torch.div(pos - 1, 2, rounding_mode="floor") % PAIR_RING]
        weights = pair_softmax(carried[:, 1], g, self.batch_invariant)
        pooled = (weights[0] * carried[:, 0] + weights[1] * k).to(dtype)
        ring_row = torch.div(pos, 2, rounding_mode="floor") % PAIR_RING
        is_even = (pos % 2 == 0)[:, None, None]
        kept = torch.where(is_even, kg, pending[slot, ring_row])
        pending[slot, ring_row] = kept
        return pooled, pos - 1, torch.arange(pos.numel(), device=pos.device)


class Indexer(nn.Module):
    """Lightning indexer parameters (`model.md` §3.6).

    Key-side weights (`wk`, `k_norm`) exist on KV sources, query-side weights (`wq_b`,
    `weights_proj`) on index sources.
    """

    def __init__(
        self, cfg: DeepseekV41Config, has_keys: bool, has_queries: bool, dtype: torch.dtype
    ):
        super().__init__()
        if has_keys:
            self.wk = _linear(cfg.head_dim, cfg.index_head_dim, dtype)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)
        if has_queries:
            self.wq_b = _linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype)
            self.weights_proj = _linear(cfg.hidden_size, cfg.index_n_heads, dtype)


class Attention(nn.Module):
    """One layer's attention: projections, window store, optional source/indexer, sparse MQA."""

    def __init__(
        self, cfg: DeepseekV41Config, layer_id: int, freqs: Tensor, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = cfg.ratio(layer_id) if layer_id < cfg.num_hidden_layers else 0
        self.source_id = cfg.kv_source_of(layer_id) if self.ratio else None
        self.is_source = self.ratio > 0 and layer_id in cfg.kv_source_layer_ids
        self.is_index = self.ratio > 0 and layer_id in cfg.index_source_layer_ids
        self.is_candidate_source = self.ratio > 0 and layer_id == cfg.candidate_source_layer_id
        self.is_candidate_consumer = self.ratio > 0 and cfg.is_candidate_consumer(layer_id)
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.register_buffer("freqs", freqs, persistent=False)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.wq_a = _linear(d, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = _linear(cfg.q_lora_rank, h * hd, dtype)
        self.wkv = _linear(d, hd, dtype)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.wo_a = _linear(h * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, d, dtype)
        if self.is_source:
            self.compressor = Compressor(cfg, self.ratio, dtype)
        if self.is_source or self.is_index:
            self.indexer = Indexer(cfg, self.is_source, self.is_index, dtype)
        # Set by the model (`Numerics.batch_invariant`): one fixed reduction order per token
        # in the attention and the indexer (the `*_fixed_order` methods).
        self.batch_invariant = False

    def pack_projections(self) -> None:
        """Stack the dense `wq_a` and `wkv` weights, which both read the attention input, into
        one [q_lora + hd, D] buffer (`wq_a_kv_weight`, non-persistent); both weights become
        views of it, so memory does not grow and checkpoint names and state dicts stay. Then
        the kernel path runs the two projections as one GEMM (`latents`). A ratio-2 KV source
        packs its compressor's `wkv` and `wgate` likewise (`Compressor.pack_projections`).

        NOTE: call it once the model is on its device (as `MoE.pack_experts`). FP8 dense
        linears (`FP8BlockLinear`) stay apart, as the shared expert's do."""
        if hasattr(self, "compressor"):
            self.compressor.pack_projections()
        if not (type(self.wq_a) is Linear and type(self.wkv) is Linear):
            return
        packed = torch.cat((self.wq_a.weight.detach(), self.wkv.weight.detach()))
        self.register_buffer("wq_a_kv_weight", packed, persistent=False)
        rank = self.wq_a.weight.shape[0]
        self.wq_a.weight = nn.Parameter(packed[:rank], requires_grad=False)
        self.wkv.weight = nn.Parameter(packed[rank:], requires_grad=False)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, x: Tensor, ctx: StepContext) -> Tensor:
        ring_rows = self._ring_rows_written_in_projection(x, ctx)
        qa, q, window_rows = self.project(x, ctx.batch.positions, ctx.codecs.swa, ring_rows)
        return self.output(self.attend(x, qa, q, window_rows, ctx, ring_rows is not None))

    def project(
        self,
        x: Tensor,
        positions: Tensor,
        window_codec: KVCodec,
        ring_rows: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(query latent qa [T, q_lora], queries [T, H, hd] before their RoPE (`attend`
        rotates them), encoded window rows). Pure and token-parallel (CUDA graphs may replay
        it), unless ring_rows (the ring's rows, each token's row index: from
        `_ring_rows_written_in_projection`) asks for the window rows to be stored there too."""
        cfg = self.cfg
        q_latent, kv_latent = self.latents(x)
        qa = self.q_norm(q_latent)
        q = self.wq_b(qa).view(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
        window_rows = self.kv_norm.rotated_encoded(
            kv_latent, positions, self.freqs, window_codec, ring_rows
        )
        return qa, q, window_rows

    def _ring_rows_written_in_projection(
        self, x: Tensor, ctx: StepContext
    ) -> tuple[Tensor, Tensor] | None:
        """Where a kernel-path decode step (one token per sequence, every token's row kept)
        has the window rows' encoding launch store them into the ring directly: (the ring's
        rows [slots · ring_len, row bytes], each token's row index), else None (`attend`
        writes them). Such a step's attention reads the window from the ring only, after its
        own rows are in (`_sparse_mqa_kernel`), and nothing reads the ring before."""
        batch = ctx.batch
        if not self._attends_in_kernel(x, ctx) or batch.max_len != 1 or self.batch_invariant:
            return None
        ring = ctx.state.swa[self.layer_id]
        keep, _, _ = batch.ring_writes(ring.shape[1])
        if keep is not None:
            return None
        return ring.view(-1, ring.shape[-1]), batch.ring_flat_rows(ring.shape[1])

    def latents(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(`wq_a(x)`, `wkv(x)`). Packed (`pack_projections`), on the kernel path and outside
        batch-invariant mode: one GEMM over the packed weight, the two as column views of its
        output (the norms read strided rows), as the shared expert's gate and up.

        NOTE: one GEMM of N = q_lora + hd columns may sum a column in another order than the
        GEMM of its own N (the library picks its kernel by shape), as the shared expert's."""
        if hasattr(self, "wq_a_kv_weight") and runs_kernels(x) and not self.batch_invariant:
            rank = self.wq_a.weight.shape[0]
            both = dense_matmul(x, self.wq_a_kv_weight)
            return both[..., :rank], both[..., rank:]
        return self.wq_a(x), self.wkv(x)

    def attend(
        self,
        x: Tensor,
        qa: Tensor,
        q: Tensor,
        window_rows: Tensor,
        ctx: StepContext,
        window_written: bool = False,
    ) -> Tensor:
        """Store this step's rows (window, KV source), select, attend with the queries q
        (`project`'s, before RoPE) rotated by each token's RoPE angle: [T, H, hd] in x's
        dtype, rotated back by that angle. The kernel path rotates the queries as it loads them
        and the output as it stores it (`sparse_mqa(rotate_q=..., rotate_back=...)`), bit for
        bit the separate rotations. window_written: `project` stored the window rows in the
        ring already (`_ring_rows_written_in_projection`)."""
        if self.is_source and not ctx.sources_written:
            self.write_source(x, ctx)
        if self.is_index:
            self._select(x, qa, ctx)
        if self._attends_in_kernel(q, ctx):
            return self._sparse_mqa_kernel(q, window_rows, ctx, window_written)
        q = apply_rope(q, ctx.batch.positions, self.freqs)
        attend = self._sparse_mqa_fixed_order if self.batch_invariant else self._sparse_mqa
        o = attend(q, window_rows, ctx).to(x.dtype)
        self._write_window(window_rows, ctx)
        return apply_rope(o, ctx.batch.positions, self.freqs, inverse=True)

    def output(self, o: Tensor) -> Tensor:
        """The grouped output projection of `attend`'s output. Pure and token-parallel."""
        u = grouped_linear(self.wo_a, o.flatten(1), self.cfg.o_groups)
        return self.wo_b(u)

    # ---- window -------------------------------------------------------------------------------

    def _write_window(self, rows: Tensor, ctx: StepContext) -> None:
        """Store each sequence's newest rows in its ring (only the last ring_len positions)."""
        ring = ctx.state.swa[self.layer_id]
        keep, slots, ring_rows = ctx.batch.ring_writes(ring.shape[1])
        ring[slots, ring_rows] = rows if keep is None else rows[keep]

    def _window_keys(self, window_rows: Tensor, ctx: StepContext) -> tuple[Tensor, Tensor]:
        """Per-sequence key rows `[B, W−1+T_max, hd]` (fp32) and their positions.

        The first W−1 rows come from the ring (positions before this step), the rest are this
        step's rows, so query i of a sequence sees extended rows i .. i+W−1.
        """
        batch, ring = ctx.batch, ctx.state.swa[self.layer_id]
        window = self.cfg.sliding_window
        device = window_rows.device
        start = batch.start_position_tensor
        back = torch.arange(-(window - 1), 0, device=device)
        prev_pos = start[:, None] + back[None, :]
        prev = ring[batch.slots[:, None], prev_pos.clamp(min=0) % ring.shape[1]]
        prev = ctx.codecs.swa.decode(prev)
        new = batch.pad(ctx.codecs.swa.decode(window_rows))
        keys = torch.cat((prev, new), 1)
        key_pos = start[:, None] - (window - 1) + torch.arange(keys.shape[1], device=device)
        if batch.window_floor_tensor is not None:  # rows below a replay's floor are invisible
            key_pos = key_pos.masked_fill(key_pos < batch.window_floor_tensor[:, None], -1)
        return keys, key_pos

    # ---- attention ----------------------------------------------------------------------------

    def _sparse_mqa(self, q: Tensor, window_rows: Tensor, ctx: StepContext) -> Tensor:
        """Softmax over {window rows} ∪ {selected global rows} ∪ {sink} per head (`§3.7`)."""
        cfg, batch = self.cfg, ctx.batch
        window, scale = cfg.sliding_window, cfg.head_dim**-0.5
        keys, key_pos = self._window_keys(window_rows, ctx)
        # Banded layout: query chunk c (C rows) reads extended rows [cC, cC + C + W − 1).
        chunk = min(window, batch.max_len)
        num_chunks = -(-batch.max_len // chunk)
        t_pad = num_chunks * chunk
        span = chunk + window - 1
        extra = (window - 1 + t_pad) - keys.shape[1]
        keys = F.pad(keys, (0, 0, 0, extra))
        key_pos = F.pad(key_pos, (0, extra), value=-1)
        band_keys = keys.unfold(1, span, chunk).transpose(-1, -2)  # [B, n, span, hd]
        band_pos = key_pos.unfold(1, span, chunk)  # [B, n, span]
        qp = F.pad(batch.pad(q.float()), (0, 0, 0, 0, 0, t_pad - batch.max_len))
        qp = qp.view(batch.num_seqs, num_chunks, chunk, *q.shape[1:])
        band = torch.einsum("bnchd,bnkd->bnchk", qp, band_keys) * scale
        rel = (
            torch.arange(span, device=q.device)[None, :]
            - torch.arange(chunk, device=q.device)[:, None]
        )
        visible = (rel >= 0) & (rel < window)  # [C, span]
        visible = visible[None, None] & (band_pos >= 0)[:, :, None, :]
        band = band.masked_fill(~visible[:, :, :, None, :], float("-inf"))
        band_flat = batch.unpad(band.flatten(1, 2)[:, : batch.max_len])  # [T, H, span]
        sink = self.attn_sink.float()[None, :, None].expand(q.shape[0], -1, 1)
        if not self.ratio:
            p_band = torch.cat((band_flat, sink), -1).softmax(-1)[..., :span]
            o_global = None
        else:
            p_band, o_global = self._global_attention(q, band_flat, sink, ctx)
        p_band = F.pad(batch.pad(p_band), (0, 0, 0, 0, 0, t_pad - batch.max_len))
        p_band = p_band.view(batch.num_seqs, num_chunks, chunk, *p_band.shape[2:])
        o = torch.einsum("bnchk,bnkd->bnchd", p_band, band_keys).flatten(1, 2)
        o = batch.unpad(o[:, : batch.max_len])
        return o if o_global is None else o + o_global

    def _global_attention(
        self, q: Tensor, band: Tensor, sink: Tensor, ctx: StepContext
    ) -> tuple[Tensor, Tensor]:
        """The joint softmax of window, selected global rows and sink, token by token.

        Returns the window rows' probabilities [T, H, span] and the selected rows' output
        [T, H, hd]. Tokens go in groups, so the gathered rows ([tokens, K, hd] fp32) stay within
        `_GLOBAL_ROW_ELEMS` elements at any chunk length.
        """
        sel = ctx.selection[self.ratio]
        scale = self.cfg.head_dim**-0.5
        span = band.shape[-1]
        step = max(1, _GLOBAL_ROW_ELEMS // max(1, sel.shape[1] * q.shape[-1]))
        p_band = torch.empty_like(band)
        o_global = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for lo in range(0, q.shape[0], step):
            tokens = slice(lo, lo + step)
            rows = self._gather_global(sel[tokens], ctx.batch.seq_of_token[tokens], ctx)
            glob = torch.einsum("thd,tkd->thk", q[tokens].float(), rows) * scale
            glob = glob.masked_fill((sel[tokens] < 0)[:, None, :], float("-inf"))
            probs = torch.cat((band[tokens], glob, sink[tokens]), -1).softmax(-1)
            p_band[tokens] = probs[..., :span]
            o_global[tokens] = torch.einsum("thk,tkd->thd", probs[..., span:-1], rows)
        return p_band, o_global

    def _sparse_mqa_fixed_order(self, q: Tensor, window_rows: Tensor, ctx: StepContext) -> Tensor:
        """`_sparse_mqa` with one reduction per query token whose shape and order depend on
        nothing else in the batch (batch-invariant mode).

        A token at position p attends over S = window + K rows: the window positions
        p − window + 1 .. p, then the K = index_topk selected rows in ascending position (the
        indexer pads and sorts them, −1 = none), then the sink, in one softmax; invisible rows
        are zeros with −inf scores. Tokens go in groups of `_TOKEN_GROUP` (the last one
        padded), so every matmul of every step has the same shape; `_sparse_mqa` instead
        pads to the batch's longest sequence, which moves a row's reduction lengths.
        """
        cfg, batch = self.cfg, ctx.batch
        window, scale = cfg.sliding_window, cfg.head_dim**-0.5
        keys, key_pos = self._window_keys(window_rows, ctx)
        seq = batch.seq_of_token
        first = batch.positions - batch.start_position_tensor[seq]
        offsets = torch.arange(window, device=q.device)
        sel = ctx.selection[self.ratio] if self.ratio else None
        num_tokens, heads, dim = q.shape
        out = torch.empty(num_tokens, heads, dim, dtype=torch.float32, device=q.device)
        for lo in range(0, num_tokens, _TOKEN_GROUP):
            tokens = torch.arange(lo, lo + _TOKEN_GROUP, device=q.device).clamp(max=num_tokens - 1)
            rows_at = first[tokens, None] + offsets[None, :]  # [G, window] extended rows
            rows = keys[seq[tokens, None], rows_at]
            visible = key_pos[seq[tokens, None], rows_at] >= 0
            if sel is not None:
                rows = torch.cat((rows, self._gather_global(sel[tokens], seq[tokens], ctx)), 1)
                visible = torch.cat((visible, sel[tokens] >= 0), 1)
            rows = rows.masked_fill(~visible[..., None], 0.0)
            scores = torch.matmul(q[tokens].float(), rows.transpose(1, 2)) * scale
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            sink = self.attn_sink.float()[None, :, None].expand(_TOKEN_GROUP, -1, 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
            count = min(_TOKEN_GROUP, num_tokens - lo)
            out[lo : lo + count] = torch.matmul(probs, rows)[:count]
        return out

    def _attends_in_kernel(self, q: Tensor, ctx: StepContext) -> bool:
        """`kernels.sparse_mqa` takes this step: CUDA, rows stored encoded (MXFP8 window, FP4
        global), so that every row decodes exactly to bf16 (prefix-cache replay floors
        included: the kernel hides the window rows below them). q: any of the step's tensors
        on its device (the queries, or the attention input before them)."""
        codecs = ctx.codecs
        return (
            runs_kernels(q)
            and codecs.swa.storage_dtype == torch.uint8
            and (not self.ratio or codecs.global_kv.storage_dtype == torch.uint8)
        )

    def _sparse_mqa_kernel(
        self, q: Tensor, window_rows: Tensor, ctx: StepContext, window_written: bool = False
    ) -> Tensor:
        """`_sparse_mqa` of the queries q before RoPE, rotated as the kernel loads them
        (`sparse_mqa`'s `rotate_q`), reading the encoded rows in place; the output rounded to
        q's dtype and rotated back (`rotate_back`). Writes the step's window rows.

        Decode steps read the window from the ring after writing their own rows (the ring is
        longer than the window, so writing position p never overwrites a row p reads); longer
        chunks, and every step in batch-invariant mode, read [ring rows before the chunk, the
        chunk's rows] decoded to bf16 (exact).
        """
        from kernels.sparse_mqa import sparse_mqa

        batch, state = ctx.batch, ctx.state
        global_rows = None
        if self.ratio:
            pool = state.global_kv[self.source_id]
            global_rows = (pool, ctx.selection[self.ratio], batch.block_tables, self.ratio)
        args = (
            q,
            batch.seq_of_token,
            batch.positions,
            self.attn_sink.float(),
            self.cfg.sliding_window,
            self.cfg.head_dim**-0.5,
        )
        fixed = self.batch_invariant
        # Batch-invariant mode reads every window from decoded rows: on the H200 the ring and
        # the rows compile to different MMA operand paths whose results differ in the last bit
        # (`test_sparse_mqa.py`), and a decode row meets both (alone, and beside a chunk).
        sources = {"global_rows": global_rows, "window_floor": batch.window_floor_tensor}
        sources["rotate_q"] = sources["rotate_back"] = self.freqs
        sources["q_scratch"] = True  # this step's projection, read by nothing else
        if batch.max_len == 1 and not fixed:
            if not window_written:
                self._write_window(window_rows, ctx)
            ring = (state.swa[self.layer_id], batch.slots)
            return sparse_mqa(*args, ring=ring, fixed_tiles=fixed, **sources)
        keys, _ = self._window_keys(window_rows, ctx)
        first = batch.positions - batch.start_position_tensor[batch.seq_of_token]
        rows = (keys.bfloat16(), first)
        out = sparse_mqa(*args, window_rows=rows, fixed_tiles=fixed, **sources)
        self._write_window(window_rows, ctx)
        return out

    def _gather_global(self, sel: Tensor, seq_of_token: Tensor, ctx: StepContext) -> Tensor:
        seq = seq_of_token[:, None].expand_as(sel)
        block, row = _global_row_address(ctx.batch, seq, sel.clamp(min=0), self.ratio)
        stored = ctx.state.global_kv[self.source_id][block.clamp(min=0), row]
        return ctx.codecs.global_kv.decode(stored)

    # ---- KV source ----------------------------------------------------------------------------

    def write_source(self, x: Tensor, ctx: StepContext) -> None:
        """Compress this step's attention inputs `x` into global KV + index keys (none below
        `reuse_ends`: cached blocks are shared and read-only)."""
        pooled, group_pos, token_idx = self.compressor(x, ctx, self.layer_id)
        batch = ctx.batch
        if batch.reuse_end_tensor is not None:  # cached blocks are shared and read-only
            writes = group_pos >= batch.reuse_end_tensor[batch.seq_of_token[token_idx]]
            pooled, group_pos, token_idx = pooled[writes], group_pos[writes], token_idx[writes]
        if pooled.shape[0] == 0:
            return
        emits = None
        if is_padded_decode(batch):  # every row pooled; only rows closing a group write
            emits = batch.positions % self.ratio == self.ratio - 1
            group_pos = group_pos.clamp(min=0)
        # NOTE: the norm runs on the written rows only; a row's norm does not depend on the
        # other rows (the kernel's program per row; the torch reference's row reductions).
        kv, lat = self.compressor.norm.rotated_and_plain(pooled, group_pos, self.freqs)
        ik = self.indexer.k_norm.rotated(self.indexer.wk(lat), group_pos, self.freqs)
        seq = batch.seq_of_token[token_idx]
        block, row = _global_row_address(batch, seq, group_pos // self.ratio, self.ratio)
        if emits is not None:
            block = torch.where(emits, block, batch.trash_block)
        ctx.state.global_kv[self.layer_id][block, row] = ctx.codecs.global_kv.encode(kv)
        ctx.state.index_keys[self.layer_id][block, row] = ctx.codecs.index.encode(ik)

    # ---- indexer ------------------------------------------------------------------------------

    def _select(self, x: Tensor, qa: Tensor, ctx: StepContext) -> None:
        """Score visible compressed positions and publish this ratio's top-k selection."""
        cfg, batch, r = self.cfg, ctx.batch, self.ratio
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        iq = self.indexer.wq_b(qa).view(-1, heads, dim)
        iq = ctx.codecs.index.rotated_round_trip(iq, batch.positions, self.freqs)
        hw = self.indexer.weights_proj.forward_fp32(x, scale=dim**-0.5 * heads**-0.5)
        if is_padded_decode(batch):  # fixed shapes: the block tables' key capacity
            num_visible_max = batch.key_capacity(r)
        else:
            num_visible_max = max((e + 1) // r for e in batch.end_positions())

        def visibility() -> tuple[Tensor, Tensor]:
            return batch.shared(
                ("index visibility", r, num_visible_max),
                lambda: _index_visibility(batch, r, num_visible_max),
            )

        if self._scores_in_kernel(iq, ctx):
            scores = self._index_scores_kernel(iq, hw, num_visible_max, ctx)
        else:
            keys = self._gather_index_keys(num_visible_max, ctx)  # [B, J, dim]
            if self.batch_invariant:
                scores = self._index_scores_fixed_order(iq, hw, keys, batch)
            else:
                exact_in_bf16 = ctx.codecs.index.storage_dtype in (torch.uint8, torch.bfloat16)
                on_tensor_cores = (
                    keys.is_cuda and exact_in_bf16 and bf16_mm_to_fp32_runs(keys.device)
                )
                scores = self._index_scores(batch.pad(iq), batch.pad(hw), keys, on_tensor_cores)
            scores = scores.masked_fill(visibility()[1], float("-inf"))
        if self.is_candidate_consumer and ctx.candidates is not None:
            scores = scores.masked_fill(~ctx.candidates[..., :num_visible_max], float("-inf"))
        k = min(cfg.index_topk, num_visible_max)
        if self._selects_in_kernel(scores):
            from kernels.index_topk import index_topk

            sel = index_topk(scores, k)  # one launch; equal scores by the lower position
        elif k:
            top = torch.topk(scores, k, dim=-1)
            sel = torch.where(torch.isfinite(top.values), top.indices, -1)
        else:
            sel = torch.full((*scores.shape[:2], 0), -1, dtype=torch.long, device=x.device)
        if self.batch_invariant:
            sel = _ascending_selection(sel, cfg.index_topk)
        ctx.selection[r] = batch.unpad(sel)
        if self.is_candidate_source:
            ctx.candidates = self._candidate_blocks(scores, visibility()[0])
        if ctx.record is not None:
            ctx.record[f"layers.{self.layer_id}.selection"] = batch.unpad(sel)
            if ctx.candidates is not None:
                ctx.record[f"layers.{self.layer_id}.candidates"] = batch.unpad(ctx.candidates)

    def _selects_in_kernel(self, scores: Tensor) -> bool:
        """`kernels.index_topk` selects: the kernel path, not batch-invariant, and a shape
        where it is no slower than torch's top-k (`index_topk_pays`: many rows, short ones)."""
        from kernels.index_topk import index_topk_pays

        rows = math.prod(scores.shape[:-1])
        return (
            runs_kernels(scores)
            and not self.batch_invariant
            and index_topk_pays(rows, scores.shape[-1])
        )

    def _scores_in_kernel(self, iq: Tensor, ctx: StepContext) -> bool:
        """`kernels.index_scores` scores: the kernel path, FP4 index rows (decoded exactly to
        bf16 in registers), not batch-invariant (its tiles and tuned config follow the step's
        shapes, so a score's summation order may too)."""
        return (
            runs_kernels(iq)
            and not self.batch_invariant
            and ctx.codecs.index.storage_dtype == torch.uint8
        )

    def _index_scores_kernel(self, iq: Tensor, hw: Tensor, num_j: int, ctx: StepContext) -> Tensor:
        """`_index_scores` with the hidden positions at −inf, read from the paged key pool."""
        from kernels.index_scores import index_scores

        batch = ctx.batch
        pool = ctx.state.index_keys[self.source_id]
        return index_scores(
            iq, hw, pool, batch.block_tables, self.ratio, batch.pad_index, batch.positions, num_j
        )

    def _gather_index_keys(self, num_j: int, ctx: StepContext) -> Tensor:
        batch, r = ctx.batch, self.ratio
        block, row = batch.shared(
            ("compressed rows", r, num_j), lambda: _compressed_row_addresses(batch, r, num_j)
        )
        stored = ctx.state.index_keys[self.source_id][block, row]
        return ctx.codecs.index.decode(stored)

    @staticmethod
    def _index_scores(
        iq: Tensor, hw: Tensor, keys: Tensor, on_tensor_cores: bool = False
    ) -> Tensor:
        """`score[b, t, j] = Σ_h hw[b,t,h] · relu(iq[b,t,h] · keys[b,j])` in fp32 [B, T_max, J].

        on_tensor_cores: iq and keys hold values exact in bf16 (FP4-decoded or bf16 rows), so
        the dots run as bf16 GEMMs with fp32 output (`bmm_exact_bf16`): the same products, in
        another summation order than the fp32 CUDA-core GEMM."""
        b, t_max, heads, dim = iq.shape
        num_j = keys.shape[1]
        step = max(1, _INDEX_SCORE_ELEMS // max(1, heads * num_j * b))
        out = []
        for lo in range(0, t_max, step):
            q = iq[:, lo : lo + step].float()
            if on_tensor_cores:
                rows = q.shape[1]
                flat = bmm_exact_bf16(q.reshape(b, rows * heads, dim), keys.transpose(1, 2))
                dots = flat.view(b, rows, heads, num_j)
            else:
                dots = torch.einsum("bthd,bjd->bthj", q, keys.float())
            out.append(torch.einsum("bthj,bth->btj", dots.relu(), hw[:, lo : lo + step].float()))
        return out[0] if len(out) == 1 else torch.cat(out, 1)

    def _index_scores_fixed_order(
        self, iq: Tensor, hw: Tensor, keys: Tensor, batch: StepBatch
    ) -> Tensor:
        """`_index_scores` [B, T_max, J] (−inf where not scored) sequence by sequence over
        that sequence's own visible keys: the dots through the batch-invariant
        `dense_matmul`, the head sum in head order. A score's operations depend only on its
        own sequence (batch padding changes J and T_max, never them)."""
        num_seqs, num_j = keys.shape[:2]
        heads = iq.shape[1]
        scores = torch.full(
            (num_seqs, batch.max_len, num_j), float("-inf"), dtype=torch.float32, device=iq.device
        )
        seqs = zip(batch.starts, batch.lengths, batch.end_positions(), strict=False)
        for b, (first, n, end) in enumerate(seqs):
            own_j = (end + 1) // self.ratio
            if not own_j:
                continue
            q_rows = iq[first : first + n].float().reshape(n * heads, -1)
            dots = dense_matmul(q_rows, keys[b, :own_j].float(), True).view(n, heads, own_j)
            dots = dots.relu()
            weights = hw[first : first + n].float()
            total = dots[:, 0] * weights[:, 0, None]
            for h in range(1, heads):
                total = total + dots[:, h] * weights[:, h, None]
            scores[b, :n, :own_j] = total
        return scores

    def _candidate_blocks(self, scores: Tensor, num_visible: Tensor) -> Tensor:
        """Allowed-position mask [B, T_max, J] from the candidate source's scores (`§3.6`).

        Block b covers positions [8b, 8b+7]; its key is the max visible score; the block holding
        the last visible position is always kept; the top min(2048, #blocks) blocks survive.
        """
        cfg = self.cfg
        size = cfg.candidate_block_size
        num_j = scores.shape[-1]
        num_blocks = -(-num_j // size)
        padded = F.pad(scores, (0, num_blocks * size - num_j), value=float("-inf"))
        block_keys = padded.view(*scores.shape[:2], num_blocks, size).amax(-1)
        last_block = torch.div(num_visible - 1, size, rounding_mode="floor").clamp(min=0)
        block_keys = block_keys.scatter(-1, last_block[..., None], float("inf"))
        visible_blocks = torch.div(num_visible + size - 1, size, rounding_mode="floor")
        blk = torch.arange(num_blocks, device=scores.device)
        block_keys = block_keys.masked_fill(blk >= visible_blocks[..., None], float("-inf"))
        keep = min(cfg.candidate_topk_blocks, num_blocks)
        # NOTE: a mask needs no order: unsorted selects the same set (the sort only reorders it)
        top = torch.topk(block_keys, keep, dim=-1, sorted=False)
        chosen = torch.zeros_like(block_keys, dtype=torch.bool)
        chosen.scatter_(-1, top.indices, top.values > float("-inf"))
        return chosen.repeat_interleave(size, -1)[..., :num_j]
