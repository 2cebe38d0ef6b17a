"""The released checkpoint's tensor inventory for any configuration (`model.md` §5.2–§5.3).

One `TensorSpec` per logical weight. Its storage kind says how it sits in the safetensors files:

=========  ====================================================================================
kind       stored tensors
=========  ====================================================================================
bf16       `name` BF16
f32        `name` F32
fp8        `name` F8_E4M3 [n, k] + `scale_name` F8_E8M0 [ceil(n/B), ceil(k/B)], B = block size
mxfp4      `name` I8 [n, k/2] (two e2m1 codes per byte) + `scale_name` F8_E8M0 [n, k/32]
fp8_rows   `name` F8_E4M3 [rows, d] + `scale_name` F8_E8M0 [rows, d/32] (Engram tables)
=========  ====================================================================================

`shape` is always the logical (dequantised) shape. Vision tensors are not listed: the text engine
skips them (`model.md` §5.4 item 8).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.deepseek_v41.config import DeepseekV41Config, ceil_div

STORAGE_KINDS = ("bf16", "f32", "fp8", "mxfp4", "fp8_rows")


@dataclass(frozen=True)
class TensorSpec:
    """One logical weight: its stored name, logical shape, storage kind and init scale."""

    name: str
    shape: tuple[int, ...]
    kind: str
    init: str = "normal"  # "normal" (std = 1/sqrt(fan_in)), "ones", "zeros", "small"

    @property
    def scale_name(self) -> str | None:
        if self.kind in ("fp8", "mxfp4", "fp8_rows"):
            return self.name.removesuffix(".weight") + ".scale"
        return None

    def stored_shapes(self, fp8_block: int) -> dict[str, tuple[int, ...]]:
        """Stored tensor name → stored shape, in file order (weight first)."""
        n, k = (self.shape + (1,))[:2] if len(self.shape) == 1 else self.shape
        if self.kind == "fp8":
            return {
                self.name: self.shape,
                self.scale_name: (ceil_div(n, fp8_block), ceil_div(k, fp8_block)),
            }
        if self.kind == "mxfp4":
            return {self.name: (n, k // 2), self.scale_name: (n, k // 32)}
        if self.kind == "fp8_rows":
            return {self.name: self.shape, self.scale_name: (n, k // 32)}
        return {self.name: self.shape}

    def stored_dtypes(self) -> dict[str, str]:
        """Stored tensor name → safetensors dtype string."""
        weight = {"bf16": "BF16", "f32": "F32", "fp8": "F8_E4M3", "mxfp4": "I8"}.get(
            self.kind, "F8_E4M3"
        )
        out = {self.name: weight}
        if self.scale_name:
            out[self.scale_name] = "F8_E8M0"
        return out


def _attention(prefix: str, cfg: DeepseekV41Config, layer_id: int | None) -> list[TensorSpec]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    specs = [
        TensorSpec(f"{prefix}attn.attn_sink", (h,), "f32", "small"),
        TensorSpec(f"{prefix}attn.wq_a.weight", (cfg.q_lora_rank, d), "fp8"),
        TensorSpec(f"{prefix}attn.q_norm.weight", (cfg.q_lora_rank,), "bf16", "ones"),
        TensorSpec(f"{prefix}attn.wq_b.weight", (h * cfg.head_dim, cfg.q_lora_rank), "fp8"),
        TensorSpec(f"{prefix}attn.wkv.weight", (cfg.head_dim, d), "fp8"),
        TensorSpec(f"{prefix}attn.kv_norm.weight", (cfg.head_dim,), "bf16", "ones"),
        TensorSpec(
            f"{prefix}attn.wo_a.weight",
            (cfg.o_groups * cfg.o_lora_rank, h * cfg.head_dim // cfg.o_groups),
            "fp8",
        ),
        TensorSpec(f"{prefix}attn.wo_b.weight", (d, cfg.o_groups * cfg.o_lora_rank), "fp8"),
    ]
    if layer_id is None:
        return specs
    if layer_id in cfg.kv_source_layer_ids:
        specs.append(TensorSpec(f"{prefix}attn.compressor.wkv.weight", (cfg.head_dim, d), "bf16"))
        if cfg.ratio(layer_id) == 2:
            specs.append(
                TensorSpec(f"{prefix}attn.compressor.wgate.weight", (cfg.head_dim, d), "bf16")
            )
        specs += [
            TensorSpec(f"{prefix}attn.compressor.norm.weight", (cfg.head_dim,), "bf16", "ones"),
            TensorSpec(
                f"{prefix}attn.indexer.wk.weight", (cfg.index_head_dim, cfg.head_dim), "bf16"
            ),
            TensorSpec(
                f"{prefix}attn.indexer.k_norm.weight", (cfg.index_head_dim,), "bf16", "ones"
            ),
        ]
    if layer_id in cfg.index_source_layer_ids:
        specs += [
            TensorSpec(
                f"{prefix}attn.indexer.wq_b.weight",
                (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                "fp8",
            ),
            TensorSpec(f"{prefix}attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), "bf16"),
        ]
    return specs


def _hc(prefix: str, cfg: DeepseekV41Config) -> list[TensorSpec]:
    n, d = cfg.hc_mult, cfg.hidden_size
    mix = 2 * n + n * n
    specs = []
    for site in ("attn", "ffn"):
        specs += [
            TensorSpec(f"{prefix}hc_{site}_fn", (mix, n * d), "f32", "small"),
            TensorSpec(f"{prefix}hc_{site}_base", (mix,), "f32", "small"),
            TensorSpec(f"{prefix}hc_{site}_scale", (3,), "f32", "small"),
        ]
    return specs


def _moe(prefix: str, cfg: DeepseekV41Config, num_experts: int) -> list[TensorSpec]:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    specs = [
        TensorSpec(f"{prefix}ffn.gate.weight", (num_experts, d), "bf16"),
        TensorSpec(f"{prefix}ffn.gate.bias", (num_experts,), "f32", "small"),
        TensorSpec(f"{prefix}ffn.gate.bias_vl", (num_experts,), "f32", "small"),
        TensorSpec(f"{prefix}ffn.shared_experts.w1.weight", (inter, d), "fp8"),
        TensorSpec(f"{prefix}ffn.shared_experts.w3.weight", (inter, d), "fp8"),
        TensorSpec(f"{prefix}ffn.shared_experts.w2.weight", (d, inter), "fp8"),
    ]
    for e in range(num_experts):
        specs += [
            TensorSpec(f"{prefix}ffn.experts.{e}.w1.weight", (inter, d), "mxfp4"),
            TensorSpec(f"{prefix}ffn.experts.{e}.w3.weight", (inter, d), "mxfp4"),
            TensorSpec(f"{prefix}ffn.experts.{e}.w2.weight", (d, inter), "mxfp4"),
        ]
    return specs


def _block(
    prefix: str, cfg: DeepseekV41Config, layer_id: int | None, experts: int
) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [
        TensorSpec(f"{prefix}attn_norm.weight", (d,), "bf16", "ones"),
        TensorSpec(f"{prefix}ffn_norm.weight", (d,), "bf16", "ones"),
    ]
    specs += _hc(prefix, cfg) + _attention(prefix, cfg, layer_id) + _moe(prefix, cfg, experts)
    return specs


def _engram(prefix: str, cfg: DeepseekV41Config, rows: int) -> list[TensorSpec]:
    d, n = cfg.hidden_size, cfg.hc_mult
    width = cfg.engram_lookups * cfg.engram_head_dim
    return [
        TensorSpec(f"{prefix}engram.embed.weight", (rows, cfg.engram_head_dim), "fp8_rows"),
        TensorSpec(f"{prefix}engram.wkv.weight", ((n + 1) * d, width), "fp8"),
        TensorSpec(f"{prefix}engram.q_weight", (n, d), "bf16", "ones"),
        TensorSpec(f"{prefix}engram.k_weight", (n, d), "bf16", "ones"),
    ]


def text_inventory(cfg: DeepseekV41Config) -> list[TensorSpec]:
    """Target-model weights (no DSpark, no vision) in released order."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        TensorSpec("embed.weight", (v, d), "bf16", "small"),
        TensorSpec("head.weight", (v, d), "bf16"),
        TensorSpec("norm.weight", (d,), "bf16", "ones"),
    ]
    for lid in range(cfg.num_hidden_layers):
        specs += _block(f"layers.{lid}.", cfg, lid, cfg.n_routed_experts)
        if lid in cfg.engram_layer_ids:
            rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(lid)]
            specs += _engram(f"layers.{lid}.", cfg, rows)
    return specs


def dspark_inventory(cfg: DeepseekV41Config) -> list[TensorSpec]:
    """The three DSpark stages `mtp.0..2` with their projection, Markov and confidence heads."""
    d, v, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    specs: list[TensorSpec] = []
    for s in range(cfg.num_nextn_predict_layers):
        specs += _block(f"mtp.{s}.", cfg, None, cfg.dspark_n_routed_experts)
    last = cfg.num_nextn_predict_layers - 1
    specs += [
        TensorSpec("mtp.0.main_proj.weight", (d, 3 * d), "fp8"),
        TensorSpec("mtp.0.main_norm.weight", (d,), "bf16", "ones"),
        TensorSpec(f"mtp.{last}.norm.weight", (d,), "bf16", "ones"),
        TensorSpec(f"mtp.{last}.markov_head.embed.weight", (v, rank), "bf16", "small"),
        TensorSpec(f"mtp.{last}.markov_head.head.weight", (v, rank), "bf16"),
        TensorSpec(f"mtp.{last}.confidence_head.proj.weight", (1, d + rank), "bf16"),
    ]
    return specs


def full_inventory(cfg: DeepseekV41Config) -> list[TensorSpec]:
    return text_inventory(cfg) + dspark_inventory(cfg)
