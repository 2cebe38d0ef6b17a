"""The TINY DeepSeek-V4.1 test configuration (model.md §11.1) as a released-style nested config.

Pure data + stdlib: importable from any venv (the main one, or `.venv-nemo`).

`tiny_hf_config()` returns the dict written as `config.json` of a tiny released-format
checkpoint: nested like the real release (top level: `text_config`, `vision_config`,
`quantization_config`, `architectures`, `model_type`, ...).
"""

from __future__ import annotations

import copy
import math

# Token ids of the tiny WordLevel tokenizer (see make_tiny_release_ckpt.py).
TINY_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
TINY_VOCAB = 1024
TINY_ENGRAM_COMPRESSED = 700  # token_map[i] = i % 700 by construction of the tokenizer

TINY_TEXT_CONFIG = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 16,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-20,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [1, 3, 4],
    "index_source_layer_ids": [1, 3, 4, 6],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 8,
    "engram_layer_ids": [0, 1],
    "engram_num_embeddings": [6126, 6332],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 1000,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": TINY_ENGRAM_COMPRESSED,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 1000,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

TINY_HF_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": TINY_TEXT_CONFIG,
    # The tiny checkpoint has no vision tower (text path only).
    "vision_config": {"num_hidden_layers": 0},
    "image_token_id": 1001,  # same as engine/models/deepseek_v41 `tiny` preset
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
        "expert_dtype": "fp4",
    },
}


def tiny_hf_config() -> dict:
    """Return a fresh deep copy of the nested tiny `config.json` dict."""
    return copy.deepcopy(TINY_HF_CONFIG)


def engram_primes(
    engram_vocab_size: int, layer_ids, max_ngram: int, n_heads: int
) -> list[list[int]]:
    """Prime rule of model.md §3.9 (own implementation): distinct primes >= engram_vocab_size,
    layer-major, then n-gram size, then head."""

    def is_prime(n: int) -> bool:
        if n < 2:
            return False
        if n % 2 == 0:
            return n == 2
        return all(n % d for d in range(3, math.isqrt(n) + 1, 2))

    out, cur = [], engram_vocab_size - 1
    for _ in layer_ids:
        layer = []
        for _ in range((max_ngram - 1) * n_heads):
            cur += 1
            while not is_prime(cur):
                cur += 1
            layer.append(cur)
        out.append(layer)
    return out


if __name__ == "__main__":  # quick self-check of the row counts quoted in model.md §11.1
    t = TINY_TEXT_CONFIG
    p = engram_primes(
        t["engram_vocab_size"],
        t["engram_layer_ids"],
        t["engram_max_ngram_size"],
        t["engram_n_heads"],
    )
    print(p, [sum(x) for x in p])
