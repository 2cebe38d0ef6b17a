"""The DeepSeek-V4.1 text network: lagged mHC blocks over CSA2 attention and MoE (`model.md` §3).

Two entry points share every layer:

* `forward_step(batch, state)` — incremental: any number of new positions for several
  sequences, reading and extending their `ModelState`.
* `logits(token_lists)` — exact mode: whole prompts from position 0 (a fresh state and one
  `forward_step`), logits for every position.

Module and parameter names equal the released checkpoint's tensor names (`layers.{L}.attn.wq_a`,
`layers.{L}.ffn.experts.{E}.w1`, ...), so a loaded state dict maps one to one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from engine.distributed.dispatch import Dispatcher
from engine.distributed.expert_parallel import ExpertParallel
from engine.models.deepseek_v41.attention import (
    Attention,
    Compressor,
    KVCodecs,
    RMSNorm,
    StepContext,
)
from engine.models.deepseek_v41.block_layout import LAYOUT_NAME
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.decode_batch import is_padded_decode
from engine.models.deepseek_v41.dense import Linear, keep_dense_fp8
from engine.models.deepseek_v41.dspark import DraftOutput, DSpark
from engine.models.deepseek_v41.engram import Engram, HostEngramTable
from engine.models.deepseek_v41.engram_hash import (
    EngramHashTables,
    build_engram_hash_tables,
    engram_hash_ids,
)
from engine.models.deepseek_v41.inventory import full_inventory, text_inventory
from engine.models.deepseek_v41.kv_formats import KVCodec, make_codec
from engine.models.deepseek_v41.moe import Expert, MoE, MXFP4Linear
from engine.models.deepseek_v41.primitives import (
    mhc_combine,
    mhc_post,
    mhc_triplet,
    rope_frequencies,
)
from engine.models.deepseek_v41.state import (
    BLOCK_TOKENS,
    PAIR_RING,
    TOKEN_RING,
    ModelState,
    StepBatch,
    sequential_batch,
)
from engine.models.graphed import DEFAULT_BUCKETS, GraphedSegment

if TYPE_CHECKING:
    from engine.models.deepseek_v41.step_graph import StepGraphs


@dataclass(frozen=True)
class Numerics:
    """Numerical choices where implementations of the same model legitimately differ.

    kv_quantize: store window rows MXFP8, global rows FP4 and index keys/queries FP4 (the
        released numerics, `model.md` §2.3); False keeps exact float rows (parity with
        references that do not quantise).
    kv_nemo_variant: NeMo AutoModel's FP8 scale floor and unclamped FP4 scale (§14 items 2–3).
    moe_weight_before_down: apply the routing weight to the SwiGLU activation before the down
        projection (NeMo, §14 item 4) instead of to the expert output (spec §3.8). The same
        maths; only the rounding point moves.
    moe_batch_invariant: routed experts compute each row alone and expert-parallel combines
        add a token's expert outputs in ascending expert id (`moe.py`): the MoE output of a
        token does not depend on the other tokens of the step nor on where experts live
        (`scaleout.md` §2.3 (b)). Slower (one expert call per row).
    dense_fp8: keep the checkpoint's FP8 dense linears as stored and run them on FP8 tensor
        cores with activations quantized per (row, 32 columns) (`dense.py`; `model.md` §13 item
        4: the activation quantization of FP8 GEMMs is backend-dependent). False dequantizes
        them to the compute dtype (the reference numerics).
    dense_fp8_activations: with `dense_fp8`, quantize the activations (above); False keeps
        them in the compute dtype (W8A16: the FP8 weights decoded to exactly the values the
        default path holds, so the products are its own; `dense.py`).
    batch_invariant: a request's logits do not depend on what else is in the step: every
        dense matmul through `dense.dense_matmul`'s fixed-order path (a Triton kernel with
        constant tiles on CUDA, constant row tiles on the CPU), attention and indexer with one
        reduction per token of a shape of its own (`Attention._sparse_mqa_fixed_order`, the
        selection in ascending position, the attention kernel's fixed tiles), the grouped
        expert kernel's fixed tiles and the EP combine order of `moe_batch_invariant`
        (`--batch-invariant`; its cost is in docs/performance.md).
    """

    kv_quantize: bool = True
    kv_nemo_variant: bool = False
    moe_weight_before_down: bool = False
    moe_batch_invariant: bool = False
    dense_fp8: bool = False
    dense_fp8_activations: bool = True
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.dense_fp8 and self.batch_invariant:
            raise ValueError("batch_invariant has no FP8 dense GEMM path (dense_fp8)")

    @classmethod
    def nemo_reference(cls, kv_quantize: bool = True) -> Numerics:
        """The settings that reproduce NeMo AutoModel 0.7.0 bit for bit in fp32 (tiny)."""
        return cls(kv_quantize=kv_quantize, kv_nemo_variant=True, moe_weight_before_down=True)

    def codecs(self, cfg: DeepseekV41Config) -> KVCodecs:
        def make(kind: str, dim: int):
            return make_codec(
                kind, dim, quantize=self.kv_quantize, nemo_variant=self.kv_nemo_variant
            )

        return KVCodecs(
            swa=make("swa_mxfp8", cfg.head_dim),
            global_kv=make("global_fp4", cfg.head_dim),
            index=make("index_fp4", cfg.index_head_dim),
        )


@dataclass
class StepOutput:
    """logits: fp32 [L, vocab] for `batch.logits_indices` (all rows when None).
    hidden: the final collapsed hidden state before the norm [T, D] (DSpark confidence input).
    dspark_features: [T, 3·D] stream means of the residual entering the DSpark target layers.
    rows: None when those T rows are the step's batch; under a decoder bounded replay
        (`StepBatch.decoder_floors`) the batch of the rows the decoder computed
        (`StepBatch.decoder_part`), which `hidden`, `dspark_features` and, without
        `logits_indices`, `logits` hold.
    """

    logits: Tensor
    hidden: Tensor
    dspark_features: Tensor
    rows: StepBatch | None = None


class Block(nn.Module):
    """One transformer block with lagged (single-pass) mHC (`model.md` §3.3)."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        layer_id: int,
        freqs: Tensor,
        num_experts: int,
        top_k: int,
        dtype: torch.dtype,
        quantized_experts: bool = False,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        """dispatcher: expert parallelism for this block's MoE (see `MoE`)."""
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        d, n = cfg.hidden_size, cfg.hc_mult
        mix = 2 * n + n * n
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, n * d)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.zeros(3)))
        self.attn = Attention(cfg, layer_id, freqs, dtype)
        self.ffn = MoE(
            d,
            cfg.moe_intermediate_size,
            num_experts,
            top_k,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            dtype,
            quantized_experts,
            dispatcher,
        )
        if layer_id in cfg.engram_layer_ids:
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer_id)]
            self.engram = Engram(cfg, rows, dtype)
        self.graphs: BlockGraphs | None = None  # set by `enable_cuda_graphs`
        self.batch_invariant = False  # the mHC mix matmul's; see `Numerics.batch_invariant`

    def triplet(self, site: str, residual: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        return mhc_triplet(
            residual,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_base"),
            getattr(self, f"hc_{site}_scale"),
            cfg.rms_norm_eps,
            cfg.hc_eps,
            cfg.hc_sinkhorn_iters,
            self.batch_invariant,
        )

    def forward(
        self, residual: Tensor, pre_prev: Tensor | None, ctx: StepContext, mixer: Any = None
    ) -> tuple[Tensor, Tensor]:
        """residual [T, N, D] (after Engram) → (residual out, this block's FFN `pre`).

        `mixer(x_attn, ctx)` replaces the attention sublayer when given (DSpark stages). Once
        `enable_cuda_graphs` has run (and no record is kept), the two pure parts around the
        attention's stateful middle (`Attention.attend`) replay from CUDA graphs: the same
        operations as the eager path (the first block's attention input, with no previous
        `pre`, runs eagerly).
        """
        graphs = self.graphs if mixer is None and ctx.record is None else None
        if graphs is not None and is_padded_decode(ctx.batch):  # a step graph captures it whole
            graphs = None
        if graphs is None:
            pre_a, post_a, comb_a = self.triplet("attn", residual)
            x_attn = self.attn_norm.of_combination(residual, pre_prev)
            y = (mixer or self.attn)(x_attn, ctx)
            return self.ffn_half(residual, y, post_a, comb_a, pre_a)
        positions = ctx.batch.positions
        if pre_prev is not None:
            parts = graphs.attention_in(residual, pre_prev, positions)
        else:
            parts = self.attention_in(residual, pre_prev, positions, ctx.codecs.swa)
        x_attn, qa, q, window_rows, pre_a, post_a, comb_a = parts
        o = self.attn.attend(x_attn, qa, q, window_rows, ctx)
        return graphs.attention_out(o, residual, post_a, comb_a, pre_a)

    def attention_in(
        self, residual: Tensor, pre_prev: Tensor | None, positions: Tensor, window_codec: KVCodec
    ) -> tuple[Tensor, ...]:
        """mHC site and norm before attention, then its projections: (x_attn, qa, q, encoded
        window rows, pre, post, comb). Pure and token-parallel."""
        pre_a, post_a, comb_a = self.triplet("attn", residual)
        x_attn = self.attn_norm.of_combination(residual, pre_prev)
        qa, q, window_rows = self.attn.project(x_attn, positions, window_codec)
        return x_attn, qa, q, window_rows, pre_a, post_a, comb_a

    def attention_out(
        self, o: Tensor, residual: Tensor, post_a: Tensor, comb_a: Tensor, pre_a: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Attention output projection (of `Attention.attend`'s output, rotated back already)
        and residual update, then the FFN sublayer: (residual, FFN `pre`). Pure and
        token-parallel."""
        return self.ffn_half(residual, self.attn.output(o), post_a, comb_a, pre_a)

    def ffn_half(
        self, residual: Tensor, y: Tensor, post_a: Tensor, comb_a: Tensor, pre_a: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The attention's residual update (its output y) and the FFN sublayer with its mHC
        site → (residual, FFN `pre`). The update's launch also forms the FFN input (the norm
        of the combination by the attention `pre`), in the expert GEMM's K order too where
        that reads it so; the FFN's update adds the MoE's shared output and routed slots
        itself (`mhc_post(slots=)`) where the MoE leaves them apart."""
        kernel_order = self.ffn.reads_x_in_kernel_order(y)
        residual, x_ffn, x_ffn_kernel_order = self.ffn_norm.of_updated_combination(
            residual, post_a, comb_a, y, pre_a, kernel_order
        )
        pre_f, post_f, comb_f = self.triplet("ffn", residual)
        y_ffn, slots = self.ffn(x_ffn, x_ffn_kernel_order, unreduced=True)
        residual = mhc_post(residual, post_f, comb_f, y_ffn, slots)
        return residual, pre_f


@dataclass
class BlockGraphs:
    """A block's two graph-replayed parts (`Block.attention_in`, `Block.attention_out`)."""

    attention_in: GraphedSegment
    attention_out: GraphedSegment

    @property
    def segments(self) -> tuple[GraphedSegment, GraphedSegment]:
        return self.attention_in, self.attention_out


class DeepseekV41ForCausalLM(nn.Module):
    """The target text model. Build with `load_model` (weights) or directly (random init)."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        dtype: torch.dtype = torch.float32,
        numerics: Numerics | None = None,
        include_dspark: bool = True,
        quantized_experts: bool = False,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        """quantized_experts: routed experts keep the checkpoint's MXFP4 storage (`MXFP4Linear`).

        expert_parallel: build only this rank's routed experts of every target layer (the
        dense trunk, attention, Engram, shared experts and the DSpark stages — experts
        included — stay whole on every rank); forwards then are collectives over the EP group
        (ranks without tokens run `zero_token_step`). Raises ValueError when the EP size does
        not divide `n_routed_experts`.
        """
        super().__init__()
        self.config = cfg
        self.expert_parallel = expert_parallel
        dispatcher = (
            expert_parallel.build_dispatcher(cfg.n_routed_experts) if expert_parallel else None
        )
        self.checkpoint_path: Path | None = None  # set by `load_model`
        self.numerics = numerics or Numerics()
        self.codecs = self.numerics.codecs(cfg)
        d = cfg.hidden_size
        # Derived constants are built on the CPU even when the weights are built on "meta".
        with torch.device("cpu"):
            main = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)
            compress = rope_frequencies(
                cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling
            )
            hash_tables = build_engram_hash_tables(
                cfg.engram_layer_ids,
                cfg.engram_vocab_size,
                cfg.engram_max_ngram_size,
                cfg.engram_n_heads,
                cfg.engram_compressed_vocab_size,
            )
            token_map = torch.zeros(cfg.vocab_size, dtype=torch.long)
        # Built uninitialised (the weights are loaded): `normal_` on "meta" imports torch._dynamo,
        # seconds at every process start.
        self.embed = nn.Embedding(
            cfg.vocab_size, d, _weight=torch.empty(cfg.vocab_size, d, dtype=dtype)
        )
        self.layers = nn.ModuleList(
            Block(
                cfg,
                lid,
                compress if cfg.ratio(lid) else main,
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                dtype,
                quantized_experts,
                dispatcher,
            )
            for lid in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.head = Linear(d, cfg.vocab_size, dtype)
        self.mtp = DSpark(cfg, main, dtype, quantized_experts) if include_dspark else None
        self.quantized_experts = quantized_experts
        if self.numerics.dense_fp8:
            specs = full_inventory(cfg) if include_dspark else text_inventory(cfg)
            fp8 = {spec.name: spec.shape for spec in specs if spec.kind == "fp8"}
            keep_dense_fp8(self, fp8, cfg.fp8_block_size, self.numerics.dense_fp8_activations)
        numerics = self.numerics
        # The modules with a `batch_invariant` switch besides MoE.
        switched = (Linear, MXFP4Linear, Block, Attention, Compressor, Expert, Engram)
        for module in self.modules():
            if isinstance(module, MoE):
                module.weight_before_down = numerics.moe_weight_before_down
                module.batch_invariant = numerics.moe_batch_invariant or numerics.batch_invariant
                for expert in module.experts:
                    # Whole-mode matmuls are row-invariant already: no row-by-row loop.
                    expert.row_invariant = numerics.moe_batch_invariant
            elif isinstance(module, switched):
                module.batch_invariant = numerics.batch_invariant
        self.engram_tables: dict[int, EngramHashTables] = {t.layer_id: t for t in hash_tables}
        self.step_graphs: StepGraphs | None = None  # set by `enable_step_graphs`
        # Raw id → compressed id; set from the tokenizer by the loader (`set_engram_token_map`).
        self.register_buffer("engram_token_map", token_map, persistent=False)

    # ---- setup --------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def pack_routed_experts(self) -> None:
        """`MoE.pack_experts` on every MoE whose routed experts are MXFP4 (their kernel layout).

        Call it once the model is on its device (see the NOTE there).
        """
        if not self.quantized_experts:
            raise ValueError("the routed experts are dense (built without quantized_experts)")
        for module in self.modules():
            if isinstance(module, MoE):
                module.pack_experts()

    def pack_attention_projections(self) -> None:
        """`Attention.pack_projections` in every layer and DSpark stage (one GEMM for `wq_a` and
        `wkv` on the kernel path; one fp32 product for a ratio-2 compressor's `wkv` and
        `wgate`). Call it once the model is on its device (see the NOTE there)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.pack_projections()

    def attach_host_engram(self, tables: dict[int, HostEngramTable]) -> None:
        """Replace the Engram tables of the layers in `tables` by host-resident ones (the
        `host` placement, `engram_store.py`); their device buffers are dropped. Raises
        ValueError for a layer without Engram or a table of another shape."""
        for lid, table in tables.items():
            engram = getattr(self.layers[lid], "engram", None) if lid < len(self.layers) else None
            if engram is None:
                raise ValueError(f"layer {lid} has no Engram")
            want = tuple(engram.embed.weight.shape) if hasattr(engram.embed, "weight") else None
            if want is not None and tuple(table.host_weight.shape) != want:
                raise ValueError(
                    f"layer {lid}: host table {tuple(table.host_weight.shape)}, expected {want}"
                )
            engram.embed = table

    def host_engram_tables(self) -> dict[int, HostEngramTable]:
        """Layer id → its host-resident Engram table (empty for the `device` placement)."""
        tables = {}
        for block in self.layers:
            table = getattr(getattr(block, "engram", None), "embed", None)
            if isinstance(table, HostEngramTable):
                tables[block.layer_id] = table
        return tables

    def set_engram_token_map(self, token_map: Tensor) -> None:
        cfg = self.config
        if token_map.shape != (cfg.vocab_size,):
            raise ValueError(
                f"token map has shape {tuple(token_map.shape)}, expected ({cfg.vocab_size},)"
            )
        if int(token_map.max()) >= cfg.engram_compressed_vocab_size or int(token_map.min()) < 0:
            raise ValueError(
                f"token map values must lie in [0, {cfg.engram_compressed_vocab_size}); the "
                "tokenizer does not match engram_compressed_vocab_size"
            )
        self.engram_token_map.copy_(token_map.to(torch.long))

    def allocate_state(
        self,
        num_slots: int,
        num_blocks: int,
        ring_len: int | None = None,
        reserve_scratch: bool = False,
    ) -> ModelState:
        """Zeroed state for `num_slots` sequences and `num_blocks` 128-token global-KV blocks.

        ring_len defaults to window + DSpark block size + 1 (134 for the released config:
        the anchor and five drafts may be written ahead of the committed position).
        reserve_scratch: one more slot and block (`scratch_slot` = num_slots, `trash_block` =
        num_blocks) for the padding rows of padded decode steps (`decode_batch.py`).
        """
        if reserve_scratch:
            state = self.allocate_state(num_slots + 1, num_blocks + 1, ring_len)
            return dataclasses.replace(state, scratch_slot=num_slots, trash_block=num_blocks)
        cfg, dev, codecs = self.config, self.device, self.codecs
        ring_len = ring_len or cfg.sliding_window + cfg.dspark_block_size + 1
        if ring_len < cfg.sliding_window:
            raise ValueError("the window ring must hold at least sliding_window rows")

        def rows(codec, *shape: int) -> Tensor:
            return torch.zeros(*shape, codec.row_width, dtype=codec.storage_dtype, device=dev)

        sources = cfg.kv_source_layer_ids
        return ModelState(
            swa=[rows(codecs.swa, num_slots, ring_len) for _ in range(cfg.num_hidden_layers)],
            global_kv={
                s: rows(codecs.global_kv, num_blocks, BLOCK_TOKENS // cfg.ratio(s)) for s in sources
            },
            index_keys={
                s: rows(codecs.index, num_blocks, BLOCK_TOKENS // cfg.ratio(s)) for s in sources
            },
            pending={
                s: torch.zeros(num_slots, PAIR_RING, 2, cfg.head_dim, device=dev)
                for s in sources
                if cfg.ratio(s) == 2
            },
            tokens=torch.zeros(num_slots, TOKEN_RING, dtype=torch.long, device=dev),
            draft_swa=[rows(codecs.swa, num_slots, ring_len) for _ in (self.mtp or ())],
        )

    # ---- prefix cache -------------------------------------------------------------------------

    def decoder_tail_tokens(self, mode: str) -> int:
        """Rows of a replaying chunk that run the decoder layers (`model.md` §7.1; 0 = all).

        `bounded`: the last max(128, window) rows of each chunk that replays cached positions
        (decoder bounded replay), their decoder windows floored at the first of them; at
        least a window, so the chunk after it finds every decoder row it reads. `exact`: 0.
        Raises ValueError for another mode."""
        if mode == "bounded":
            return max(BLOCK_TOKENS, self.config.sliding_window)
        if mode == "exact":
            return 0
        raise ValueError(f"swa replay mode must be 'bounded' or 'exact', not {mode!r}")

    def replay_tokens(self, mode: str) -> int:
        """Cached positions a prefix-cache hit recomputes before its boundary (`cache.md` §1.5).

        `exact`: every window row at the boundary then equals a full prefill's (layer l's row
        at p depends on layer l − 1's rows in (p − window, p]), so num_layers × (window − 1),
        rounded up to whole blocks. `bounded`: one block (V4.1's bounded replay, approximate
        where the windows reach further back). Raises ValueError for another mode.
        """
        cfg = self.config
        if mode == "bounded":
            return BLOCK_TOKENS
        if mode == "exact":
            reach = cfg.num_hidden_layers * (cfg.sliding_window - 1)
            return -(-reach // BLOCK_TOKENS) * BLOCK_TOKENS
        raise ValueError(f"swa replay mode must be 'bounded' or 'exact', not {mode!r}")

    def prefix_cache_namespace(self, replay_mode: str) -> dict[str, Any]:
        """What the bytes of a cached block depend on besides the tokens (`cache.md` §1.4):
        checkpoint identity, Engram token map, KV formats, numerics and the replay mode that
        produced later blocks. JSON-ready; `hashing.namespace_fingerprint` digests it.

        A model without a checkpoint folder (random weights built in this process) gets a
        random identity: its blocks can never match another process's.
        """
        files = {}
        if self.checkpoint_path is not None:
            for name in ("config.json", "model.safetensors.index.json"):
                path = self.checkpoint_path / name
                if path.is_file():
                    files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        identity = files or {"process": secrets.token_hex(16)}
        token_map = self.engram_token_map.detach().cpu().contiguous().numpy().tobytes()
        codecs = self.codecs
        return {
            "model": {"architecture": "deepseek_v41", "checkpoint": identity},
            "engram": hashlib.sha256(token_map).hexdigest(),
            "kv_formats": {
                "main": [codecs.global_kv.name, codecs.global_kv.row_width],
                "index": [codecs.index.name, codecs.index.row_width],
                "block": BLOCK_TOKENS,
                "layout": LAYOUT_NAME,
            },
            "numerics": {
                "settings": dataclasses.asdict(self.numerics),
                "dtype": str(self.dtype),
                "backend": f"torch-{self.device.type}",
                "replay": {"exact": "exact", "bounded": "bounded-replay"}[replay_mode],
            },
        }

    # ---- forward ------------------------------------------------------------------------------

    def _lookback(self, batch: StepBatch, state: ModelState) -> Tensor:
        """[T, max_ngram] raw ids at positions p − s (−1 before the sequence start)."""
        span = self.config.engram_max_ngram_size
        s = torch.arange(span, device=batch.token_ids.device)
        pos = batch.positions[:, None] - s[None, :]
        flat = torch.arange(batch.num_tokens, device=pos.device)[:, None] - s[None, :]
        start = batch.start_position_tensor[batch.seq_of_token]
        in_step = pos >= start[:, None]
        from_step = batch.token_ids[flat.clamp(min=0)]
        slot = batch.slots[batch.seq_of_token][:, None].expand_as(pos)
        from_ring = state.tokens[slot, pos.clamp(min=0) % TOKEN_RING]
        ids = torch.where(in_step, from_step, from_ring)
        return ids.masked_fill(pos < 0, -1)

    def _record_tokens(self, batch: StepBatch, state: ModelState) -> None:
        keep, slots, ring_rows = batch.ring_writes(TOKEN_RING)
        state.tokens[slots, ring_rows] = batch.token_ids if keep is None else batch.token_ids[keep]

    def _engram_ids(self, lookback: Tensor) -> dict[int, Tensor]:
        """Every Engram layer's hash ids of the step, computed at its start; the rows of host
        tables are gathered and their copy to the device started at once, so the copy runs
        while the layers before each Engram layer compute."""
        cfg, ids = self.config, {}
        for lid, tables in list(self.engram_tables.items()):
            if tables.multipliers.device != lookback.device:
                tables = self.engram_tables[lid] = tables.to(lookback.device)
            ids[lid] = engram_hash_ids(
                lookback, self.engram_token_map, tables, cfg.engram_pad_token_id, cfg.image_token_id
            )
        for lid, layer_ids in ids.items():
            table = self.layers[lid].engram.embed
            if isinstance(table, HostEngramTable):
                table.prefetch(layer_ids, lookback.device)
        return ids

    def run_layers(
        self, batch: StepBatch, state: ModelState, record: dict[str, Any] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, StepBatch | None]:
        """Embedding through the last block. Returns (residual [T, N, D], last FFN pre, DSpark
        features [T, 3·D], None) — or, with `batch.decoder_floors`, the same for the rows the
        decoder computed and their batch (`_enter_decoder`)."""
        cfg = self.config
        ctx = StepContext(batch=batch, state=state, codecs=self.codecs, record=record)
        rows = None
        lookback = self._lookback(batch, state) if cfg.engram_layer_ids else None
        is_image = batch.token_ids == cfg.image_token_id
        emb = self.embed(batch.token_ids)
        residual = emb.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre_prev = None
        features = []
        engram_ids = self._engram_ids(lookback) if lookback is not None else {}
        for block in self.layers:
            lid = block.layer_id
            if lid in engram_ids:
                residual = block.engram(residual, engram_ids[lid], is_image)
            if lid == cfg.ced_boundary and batch.decoder_floors is not None:
                residual, pre_prev, ctx, kept = self._enter_decoder(block, residual, pre_prev, ctx)
                rows, features = ctx.batch, [f[kept] for f in features]
            if lid in cfg.dspark_target_layer_ids:
                features.append(residual.float().mean(1))
            residual, pre_prev = block(residual, pre_prev, ctx)
            if record is not None:
                record[f"layers.{lid}.residual"] = residual
        self._record_tokens(batch, state)
        return residual, pre_prev, torch.cat(features, -1), rows

    def _enter_decoder(
        self, boundary: Block, residual: Tensor, pre_prev: Tensor | None, ctx: StepContext
    ) -> tuple[Tensor, Tensor | None, StepContext, Tensor]:
        """Decoder bounded replay at the CED boundary (`model.md` §7.1): the boundary's KV
        source writes the global KV + index keys of every row of the step (the decoder's
        shared KV is a function of the encoder output only, so it stays exact), then the
        decoder layers continue on `StepBatch.decoder_part` alone. Returns the residual, the
        previous `pre`, the context of that part and the flat indices of its rows."""
        x_attn = boundary.attn_norm.of_combination(residual, pre_prev)
        boundary.attn.write_source(x_attn, ctx)
        part, kept = ctx.batch.decoder_part()
        part_ctx = StepContext(
            batch=part,
            state=ctx.state,
            codecs=ctx.codecs,
            record=ctx.record,
            sources_written=True,
        )
        return residual[kept], None if pre_prev is None else pre_prev[kept], part_ctx, kept

    def enable_cuda_graphs(self, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        """Replay each block's pure parts (`Block.attention_in`: mHC site, norm, projections,
        the window row's RoPE and encoding; `Block.attention_out`: output projection, mHC
        update, the FFN sublayer) from CUDA graphs for steps of up to `buckets[-1]` tokens,
        captured per bucket on first use (or by `capture_cuda_graphs`). Decode steps are
        host-bound without them. Target blocks only: a DSpark stage may run several times in
        one step while its outputs are still read."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        shared_in, shared_out = {}, {}
        attention_in = functools.partial(Block.attention_in, window_codec=self.codecs.swa)
        for block in self.layers:
            block.graphs = BlockGraphs(
                GraphedSegment(functools.partial(attention_in, block), buckets, pool, shared_in),
                GraphedSegment(block.attention_out, buckets, pool, shared_out),
            )

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_tokens: int) -> None:
        """Capture every bucket up to the one holding `max_tokens` now (at startup: decode
        steps then never pause to capture)."""
        cfg = self.config
        if any(block.graphs is None for block in self.layers):
            raise ValueError("enable_cuda_graphs() first")
        n, heads, hd = cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
        zeros = functools.partial(torch.zeros, device=self.device)
        for bucket in self.layers[0].graphs.attention_in.buckets:
            residual = zeros(bucket, n, cfg.hidden_size, dtype=self.dtype)
            positions = zeros(bucket, dtype=torch.long)
            o = zeros(bucket, heads, hd, dtype=self.dtype)
            mix = (zeros(bucket, n), zeros(bucket, n, n), zeros(bucket, n))  # post, comb, pre
            for index, block in enumerate(self.layers):
                if index:
                    block.graphs.attention_in.capture(residual, mix[2], positions)
                block.graphs.attention_out.capture(o, residual, *mix)
            if bucket >= max_tokens:
                break

    def enable_step_graphs(self, state: ModelState) -> StepGraphs:
        """Decode steps over `state` (allocated with `reserve_scratch`) replayed from one CUDA
        graph per step shape (`step_graph.py`): the runner passes eligible steps to the
        returned `StepGraphs.run`. Raises ValueError where `StepGraphs` cannot run."""
        from engine.models.deepseek_v41.step_graph import StepGraphs

        self.step_graphs = StepGraphs(self, state)
        return self.step_graphs

    def graph_failures(self) -> dict[str, str]:
        """Why a bucket of a block's part, or a step shape of the step graphs, runs eagerly
        (empty when every capture succeeded)."""
        steps = self.step_graphs.graph_failures() if self.step_graphs is not None else {}
        return steps | {
            f"layers.{block.layer_id}.{name}[{bucket}]": reason
            for block in self.layers
            if block.graphs is not None
            for name, segment in zip(
                ("attention_in", "attention_out"), block.graphs.segments, strict=True
            )
            for bucket, reason in segment.failures.items()
        }

    def forward_step(
        self, batch: StepBatch, state: ModelState, record: dict[str, Any] | None = None
    ) -> StepOutput:
        """Incremental forward of `batch`, extending `state` in place (see `StepBatch`)."""
        residual, pre_prev, features, part = self.run_layers(batch, state, record)
        hidden = mhc_combine(residual, pre_prev)
        indices = (part or batch).logits_indices
        rows = hidden if indices is None else hidden[indices]
        logits = self.head.forward_fp32(self.norm(rows))
        return StepOutput(logits=logits, hidden=hidden, dspark_features=features, rows=part)

    @torch.inference_mode()
    def zero_token_step(self) -> None:
        """Join every MoE collective of one `forward_step` with no tokens of this rank's own
        (lockstep, `engine.distributed.coordinator`): the target layers' MoE in layer order.
        A no-op without expert parallelism. DSpark stages hold all their experts, so drafting
        has no collectives."""
        if self.expert_parallel is None:
            return
        empty = torch.zeros(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for block in self.layers:
            block.ffn(empty)

    @torch.inference_mode()
    def logits(self, token_lists: list[list[int]], record: dict[str, Any] | None = None) -> Tensor:
        """Exact mode: fp32 logits [B, T_max, vocab] of whole prompts (zeros past each end)."""
        if not token_lists or any(len(t) == 0 for t in token_lists):
            raise ValueError("logits() needs at least one non-empty token list")
        batch, state = self.fresh_batch(token_lists)
        out = self.forward_step(batch, state, record)
        return batch.pad(out.logits)

    def fresh_batch(self, token_lists: list[list[int]]) -> tuple[StepBatch, ModelState]:
        """A batch of whole sequences from position 0 with a fresh, contiguous state."""
        blocks = [-(-len(t) // BLOCK_TOKENS) for t in token_lists]
        table = torch.full((len(token_lists), max(blocks)), -1, dtype=torch.long)
        first = 0
        for i, n in enumerate(blocks):
            table[i, :n] = torch.arange(first, first + n)
            first += n
        state = self.allocate_state(len(token_lists), first)
        batch = sequential_batch(
            token_lists, [0] * len(token_lists), list(range(len(token_lists))), table, self.device
        )
        return batch, state

    # ---- DSpark -------------------------------------------------------------------------------

    def inject_draft_context(
        self, batch: StepBatch, features: Tensor, state: ModelState, keep: Tensor | None = None
    ) -> None:
        """Write the drafter's context rows for the new positions of `batch` (KV injection).

        batch: the rows `features` belong to (`StepOutput.rows` under a decoder bounded
        replay). keep: the flat rows to write (speculation: only committed rows), each
        sequence's rows ascending and at most a ring's length of them; default: every
        sequence's last ring length of rows.

        NOTE: under a decoder bounded replay the rows below a chunk's decoder floor have no
        features and keep no context row; the drafter never reads them, since its window
        (`sliding_window` positions before the anchor) lies inside the decoder tail."""
        if self.mtp is None:
            raise ValueError("this model was built without the DSpark drafter")
        if keep is None:
            keep = batch.token_indices(tail=state.draft_swa[0].shape[1])
        positions = batch.positions[keep]
        rows = self.mtp.context_rows(features[keep], positions, self.codecs)
        slots = batch.slots[batch.seq_of_token[keep]]
        for ring, stage_rows in zip(state.draft_swa, rows, strict=True):
            ring[slots, positions % ring.shape[1]] = stage_rows

    @torch.inference_mode()
    def draft(
        self, anchors: Tensor, positions: Tensor, slots: Tensor, state: ModelState, **sampling: Any
    ) -> DraftOutput:
        """Draft a block after `anchors` [B] at positions [B] from the injected context."""
        if self.mtp is None:
            raise ValueError("this model was built without the DSpark drafter")
        window = self.config.sliding_window
        ctx_pos = positions[:, None] + torch.arange(-window, 0, device=positions.device)[None, :]
        context = [
            ring[slots[:, None], ctx_pos.clamp(min=0) % ring.shape[1]] for ring in state.draft_swa
        ]
        return self.mtp.draft(
            anchors, positions, context, ctx_pos, self.embed, self.head, self.codecs, **sampling
        )
