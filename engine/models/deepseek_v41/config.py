"""DeepSeek-V4.1-Flash text configuration, the layer-role schedule and the shipped presets.

The released checkpoint's `config.json` is nested (`text_config`, `vision_config`,
`quantization_config`, ...). `DeepseekV41Config.from_hf_dict` flattens it; `to_hf_dict` writes the
same nested shape back, so a written checkpoint round-trips (`model.md` §1.1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Keys of `text_config` we read. Anything else in a real config is kept verbatim in `extra`.
_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "rope_theta",
    "compress_rope_theta",
    "max_position_embeddings",
    "rms_norm_eps",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "scoring_func",
    "topk_method",
    "norm_topk_prob",
    "routed_scaling_factor",
    "swiglu_limit",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "candidate_topk_blocks",
    "candidate_block_size",
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
    "num_nextn_predict_layers",
    "dspark_block_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
    "q_head_norm",
    "hc_pre_from_prev_sublayer",
)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters of the "compress" RoPE table (`model.md` §2.2)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    type: str = "yarn"


@dataclass(frozen=True)
class DeepseekV41Config:
    """The text network's hyper-parameters, named as in the released `text_config`."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-20
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    q_head_norm: bool = False
    hc_pre_from_prev_sublayer: bool = True
    # Top level of the nested config.
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    fp8_block_size: int = 32
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n + self.num_nextn_predict_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected "
                f"layers + DSpark stages = {n + self.num_nextn_predict_layers}"
            )
        if self.head_dim % 32 or self.hidden_size % 32 or self.index_head_dim % 32:
            raise ValueError("head_dim, hidden_size and index_head_dim must be multiples of 32")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")
        if self.num_key_value_heads != 1:
            raise ValueError("DeepSeek-V4.1 has one shared K=V latent (num_key_value_heads = 1)")
        if self.q_head_norm or not self.hc_pre_from_prev_sublayer:
            raise ValueError("only the V4.1 schedule (no Q head norm, lagged mHC) is implemented")
        for lid in self.kv_source_layer_ids:
            if self.compress_ratios[lid] not in (1, 2):
                raise ValueError(f"KV source layer {lid} has ratio {self.compress_ratios[lid]}")
        for lid in self.index_source_layer_ids:
            if self.compress_ratios[lid] not in (1, 2):
                raise ValueError(f"index source layer {lid} has ratio {self.compress_ratios[lid]}")
        for lid in range(n):
            if self.compress_ratios[lid] and self.kv_source_of(lid) is None:
                raise ValueError(f"layer {lid} has no preceding KV source of its ratio")
            if self.compress_ratios[lid] and self.index_source_of(lid) is None:
                raise ValueError(f"layer {lid} has no preceding index source of its ratio")
        last_src = max(self.kv_source_layer_ids)
        if (
            self.candidate_source_layer_id != last_src
            or last_src not in self.index_source_layer_ids
        ):
            raise ValueError("the last KV source must also be the index and candidate source")
        if any(self.compress_ratios[i] not in (0, 1) for i in range(last_src, n)):
            raise ValueError("layers after the CED boundary must have ratio 0 or 1")
        if any(lid >= last_src for lid in self.engram_layer_ids):
            raise ValueError("Engram layers must precede the CED boundary")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError("engram_num_embeddings needs one entry per Engram layer")
        if len(self.dspark_target_layer_ids) != 3:
            raise ValueError("DSpark reads exactly three target layers")

    # ---- derived layer roles (model.md §1.2) -------------------------------------------------

    @property
    def ced_boundary(self) -> int:
        """First decoder layer (= the last KV source, the candidate source)."""
        return max(self.kv_source_layer_ids)

    def ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def kv_source_of(self, layer_id: int) -> int | None:
        """Nearest KV source at or before `layer_id` with the same ratio (None for ratio 0)."""
        return self._latest_of_same_ratio(self.kv_source_layer_ids, layer_id)

    def index_source_of(self, layer_id: int) -> int | None:
        """Index source whose selection `layer_id` attends to (the latest one of its ratio)."""
        return self._latest_of_same_ratio(self.index_source_layer_ids, layer_id)

    def _latest_of_same_ratio(self, candidates: tuple[int, ...], layer_id: int) -> int | None:
        ratio = self.compress_ratios[layer_id]
        if ratio == 0:
            return None
        found = [s for s in candidates if s <= layer_id and self.compress_ratios[s] == ratio]
        return max(found) if found else None

    def is_candidate_consumer(self, layer_id: int) -> bool:
        return layer_id in self.index_source_layer_ids and layer_id > self.candidate_source_layer_id

    @property
    def num_q_rope_pairs(self) -> int:
        return self.qk_rope_head_dim // 2

    @property
    def engram_lookups(self) -> int:
        """Rows gathered per token per Engram layer: (max_ngram − 1) n-gram sizes × heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ---- (de)serialisation -------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> DeepseekV41Config:
        """Build from a released-style nested `config.json` (or an already flat dict)."""
        text = dict(cfg.get("text_config", cfg))
        kwargs: dict[str, Any] = {}
        for key in _TEXT_KEYS:
            if key in text:
                value = text[key]
                kwargs[key] = tuple(value) if isinstance(value, list) else value
        if "rope_scaling" in text and text["rope_scaling"]:
            rs = text["rope_scaling"]
            kwargs["rope_scaling"] = RopeScaling(
                factor=float(rs.get("factor", 16.0)),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings")),
                beta_fast=float(rs.get("beta_fast", 32.0)),
                beta_slow=float(rs.get("beta_slow", 1.0)),
                type=str(rs.get("type", rs.get("rope_type", "yarn"))),
            )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            value = cfg.get(key, text.get(key))
            if isinstance(value, list):  # some configs list several EOS ids; the first is EOS
                value = value[0]
            if value is not None:
                kwargs[key] = int(value)
        qc = cfg.get("quantization_config") or text.get("quantization_config") or {}
        block = qc.get("weight_block_size")
        if block is not None:
            if len(set(block)) != 1:
                raise ValueError(f"non-square FP8 weight blocks {block} are not supported")
            kwargs["fp8_block_size"] = int(block[0])
        known = set(_TEXT_KEYS) | {"rope_scaling", "model_type"}  # to_text_dict writes model_type
        extra = tuple(sorted((k, v) for k, v in text.items() if k not in known and _is_plain(v)))
        kwargs["extra"] = extra
        return cls(**kwargs)

    def to_text_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in _TEXT_KEYS:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, tuple) else value
        out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        out["model_type"] = "deepseek_v41_text"
        out.update(dict(self.extra))
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The nested released layout (`model.md` §1.1)."""
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "text_config": self.to_text_dict(),
            "vision_config": None,
            "image_token_id": self.image_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0",
                "weight_block_size": [self.fp8_block_size, self.fp8_block_size],
                "expert_dtype": "fp4",
            },
        }

    def replace(self, **changes: Any) -> DeepseekV41Config:
        return dataclasses.replace(self, **changes)


def _is_plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None)))


def engram_rows(config_like: dict[str, Any]) -> tuple[int, ...]:
    """Table rows per Engram layer by the prime rule (`model.md` §3.9)."""
    from engine.models.deepseek_v41.engram_hash import engram_primes

    primes = engram_primes(
        config_like["engram_layer_ids"],
        config_like["engram_vocab_size"],
        config_like["engram_max_ngram_size"],
        config_like["engram_n_heads"],
    )
    return tuple(sum(sum(per_n) for per_n in layer) for layer in primes)


_SMALL_LAYOUT: dict[str, Any] = {
    "num_hidden_layers": 8,
    "compress_ratios": (0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0),
    "kv_source_layer_ids": (1, 3, 4),
    "index_source_layer_ids": (1, 3, 4, 6),
    "candidate_source_layer_id": 4,
    "engram_layer_ids": (0, 1),
    "dspark_target_layer_ids": (5, 6, 7),
    "num_nextn_predict_layers": 3,
}

_PRESETS: dict[str, dict[str, Any]] = {
    # model.md §11.1: CPU unit tests.
    "tiny": {
        **_SMALL_LAYOUT,
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 16,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 8,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "engram_vocab_size": 1000,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_compressed_vocab_size": 700,
        "dspark_noise_token_id": 1000,
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "image_token_id": 1001,
    },
    # The embedded default: released structure, small widths, the real vocabulary and tokenizer.
    "default": {
        **_SMALL_LAYOUT,
        "vocab_size": 129280,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 128,
        "o_groups": 4,
        "o_lora_rank": 128,
        "sliding_window": 128,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 64,
        "candidate_topk_blocks": 32,
        "candidate_block_size": 8,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "max_position_embeddings": 65536,
        "engram_vocab_size": 20000,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_compressed_vocab_size": 99092,
        "dspark_noise_token_id": 128799,
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 2,
    },
    # model.md §11.2: real widths, 8 layers, 2M Engram vocabulary; for one H200.
    "medium": {
        **_SMALL_LAYOUT,
        "engram_vocab_size": 2000000,
    },
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset_config(name: str, **overrides: Any) -> DeepseekV41Config:
    """One of the shipped configurations (`tiny`, `default`, `medium`), with optional overrides."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(_PRESETS)}")
    return config_with(**{**_PRESETS[name], **overrides})


def config_with(**values: Any) -> DeepseekV41Config:
    """The released configuration with `values` replaced; Engram table rows follow the prime
    rule for the resulting vocabulary and heads unless `engram_num_embeddings` is given."""
    if "engram_num_embeddings" not in values:
        base = DeepseekV41Config()
        probe = {
            k: values.get(k, getattr(base, k))
            for k in (
                "engram_layer_ids",
                "engram_vocab_size",
                "engram_max_ngram_size",
                "engram_n_heads",
            )
        }
        values["engram_num_embeddings"] = engram_rows(probe)
    return DeepseekV41Config(**values)


def resolve_config(
    config_name_or_dict: str | dict[str, Any] | DeepseekV41Config,
) -> DeepseekV41Config:
    if isinstance(config_name_or_dict, DeepseekV41Config):
        return config_name_or_dict
    if isinstance(config_name_or_dict, str):
        return preset_config(config_name_or_dict)
    return DeepseekV41Config.from_hf_dict(config_name_or_dict)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
