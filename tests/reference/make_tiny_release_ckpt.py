"""Throwaway generator: a TINY DeepSeek-V4.1 checkpoint in the RELEASED on-disk format.

Writes an HF-style folder:
  config.json                      nested (text_config / vision_config / quantization_config)
  model.safetensors.index.json     weight_map + metadata.total_size
  model-0000N-of-0000M.safetensors tensor names exactly as model.md §5.3
  tokenizer.json / tokenizer_config.json   WordLevel, 1024 tokens

Formats (model.md §2.3 / §5.3):
  * dense linears: F8_E4M3 weight [n, k] + F8_E8M0 scale [ceil(n/32), ceil(k/32)] (32x32 tiles)
  * routed experts: I8 weight [n, k/2] (e2m1 nibbles, even column = low nibble)
                    + F8_E8M0 scale [n, k/32]
  * Engram tables: F8_E4M3 [rows, d] + F8_E8M0 [rows, d/32] (per row, per 32 columns)
  * norms / gate / compressor / indexer wk,weights_proj / embed / head / markov: BF16
  * hc_* / attn_sink / gate.bias / gate.bias_vl: F32

Depends only on torch, numpy, safetensors, tokenizers (runs in any of our venvs).

    python tests/reference/make_tiny_release_ckpt.py --out /tmp/tiny_v41 [--seed 0] [--shards 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_config import TINY_ENGRAM_COMPRESSED, TINY_SPECIAL_TOKENS, tiny_hf_config  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ----------------------------------------------------------------------------- quantisers
def _e8m0_exponent_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest integer e with 2**e >= x (x > 0), exact (frexp based)."""
    m, e = torch.frexp(x.double())
    # x = m * 2**e, m in [0.5, 1): 2**(e-1) < x <= 2**e unless m == 0.5 exactly
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def _e8m0_bytes(exp: torch.Tensor) -> torch.Tensor:
    return (exp + 127).clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8_block(w: torch.Tensor, block: int = 32):
    """[n, k] float -> (F8_E4M3 [n, k], E8M0 [ceil(n/32), ceil(k/32)])."""
    n, k = w.shape
    pn, pk = -n % block, -k % block
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    tiles = wp.view((n + pn) // block, block, (k + pk) // block, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    exp = _e8m0_exponent_ceil(amax / 448.0)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), exp).float()
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(n + pn, k + pk)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), _e8m0_bytes(exp).contiguous()


def quant_fp8_rows(w: torch.Tensor, group: int = 32):
    """[rows, d] -> (F8_E4M3 [rows, d], E8M0 [rows, d/32]) -- Engram tables."""
    rows, d = w.shape
    g = w.float().view(rows, d // group, group)
    amax = g.abs().amax(-1).clamp_min(1e-12)
    exp = _e8m0_exponent_ceil(amax / 448.0)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), exp).float()
    q = (g / scale[..., None]).clamp(-448, 448).view(rows, d)
    return q.to(torch.float8_e4m3fn).contiguous(), _e8m0_bytes(exp).contiguous()


def _rne_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round |x| (already scaled into [0, 6]) to the nearest e2m1 magnitude, ties to even code."""
    a = x.abs().clamp(max=6.0)
    d = (a[..., None] - E2M1).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    # ties: prefer the even code index (RNE on the mantissa bit)
    idx = torch.arange(8)
    score = torch.where(cand, (idx % 2) * 1 + 0, torch.full_like(idx, 99))
    code = score.argmin(-1)
    sign = (x < 0) & (code > 0)
    return code.to(torch.uint8) | (sign.to(torch.uint8) << 3)


def quant_mxfp4(w: torch.Tensor, group: int = 32):
    """[n, k] -> (I8 [n, k/2] packed e2m1, E8M0 [n, k/32]); scale 2^ceil(log2(amax/6))."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    amax = g.abs().amax(-1).clamp_min(1e-12)
    exp = _e8m0_exponent_ceil(amax / 6.0)
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), exp).float()
    codes = _rne_e2m1_codes((g / scale[..., None]).view(n, k))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), _e8m0_bytes(exp).contiguous()


# ----------------------------------------------------------------------------- tokenizer
def tiny_tokens() -> list[str]:
    """1024 WordLevel tokens whose Engram normalisation yields token_map[i] = i % 700.

    ids 0..2 special; 3..699 lowercase words 'w<i>'; 700..1023 re-spell token i-700 in
    upper case (ids 700..702 upper-case ASCII variants of the specials) so that
    NFKC+lowercase maps them onto the key of i-700."""
    toks = list(TINY_SPECIAL_TOKENS)
    toks += [f"w{i}" for i in range(3, TINY_ENGRAM_COMPRESSED)]
    upper_specials = ["<|BEGIN▁OF▁SENTENCE|>", "<|END▁OF▁SENTENCE|>", "<|▁PAD▁|>"]
    for i in range(TINY_ENGRAM_COMPRESSED, 1024):
        j = i - TINY_ENGRAM_COMPRESSED
        toks.append(upper_specials[j] if j < 3 else f"W{j}")
    assert len(toks) == 1024 and len(set(toks)) == 1024
    return toks


def write_tokenizer(out_dir: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    toks = tiny_tokens()
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces, keeps text
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS]
    )
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": TINY_SPECIAL_TOKENS[0],
                "eos_token": TINY_SPECIAL_TOKENS[1],
                "pad_token": TINY_SPECIAL_TOKENS[1],
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 4096,
            },
            f,
            indent=2,
            ensure_ascii=False,
        )


# ----------------------------------------------------------------------------- weights
class _Gen:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.t: dict[str, torch.Tensor] = {}

    def randn(self, *shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=self.g) * std + mean

    def bf16(self, name, *shape, std=1.0, mean=0.0):
        self.t[name] = self.randn(*shape, std=std, mean=mean).to(torch.bfloat16)

    def f32(self, name, *shape, std=1.0, mean=0.0):
        self.t[name] = self.randn(*shape, std=std, mean=mean).float()

    def fp8(self, name, n, k, std=None):
        std = 1.0 / math.sqrt(k) if std is None else std
        w, s = quant_fp8_block(self.randn(n, k, std=std))
        self.t[name + ".weight"], self.t[name + ".scale"] = w, s

    def fp4(self, name, n, k, std=None):
        std = 1.0 / math.sqrt(k) if std is None else std
        w, s = quant_mxfp4(self.randn(n, k, std=std))
        self.t[name + ".weight"], self.t[name + ".scale"] = w, s


def _block(
    G: _Gen, p: str, c: dict, *, n_experts: int, ratio: int, kv_source: bool, index_source: bool
):
    D, H, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, og, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    inter, hc = c["moe_intermediate_size"], c["hc_mult"]
    mix = hc * (hc + 2)
    G.bf16(p + "attn_norm.weight", D, std=0.1, mean=1.0)
    G.bf16(p + "ffn_norm.weight", D, std=0.1, mean=1.0)
    for site in ("attn", "ffn"):
        G.f32(p + f"hc_{site}_fn", mix, hc * D, std=0.1)
        G.f32(p + f"hc_{site}_base", mix, std=0.5)
        G.f32(p + f"hc_{site}_scale", 3, std=0.2, mean=1.0)
    G.f32(p + "attn.attn_sink", H, std=1.0)
    G.fp8(p + "attn.wq_a", ql, D)
    G.bf16(p + "attn.q_norm.weight", ql, std=0.1, mean=1.0)
    G.fp8(p + "attn.wq_b", H * hd, ql)
    G.fp8(p + "attn.wkv", hd, D)
    G.bf16(p + "attn.kv_norm.weight", hd, std=0.1, mean=1.0)
    G.fp8(p + "attn.wo_a", og * ol, H * hd // og)
    G.fp8(p + "attn.wo_b", D, og * ol)
    G.bf16(p + "ffn.gate.weight", n_experts, D, std=1.0 / math.sqrt(D))
    G.f32(p + "ffn.gate.bias", n_experts, std=0.1)
    G.f32(p + "ffn.gate.bias_vl", n_experts, std=0.1)
    G.fp8(p + "ffn.shared_experts.w1", inter, D)
    G.fp8(p + "ffn.shared_experts.w3", inter, D)
    G.fp8(p + "ffn.shared_experts.w2", D, inter)
    for e in range(n_experts):
        G.fp4(p + f"ffn.experts.{e}.w1", inter, D)
        G.fp4(p + f"ffn.experts.{e}.w3", inter, D)
        G.fp4(p + f"ffn.experts.{e}.w2", D, inter)
    if kv_source:
        G.bf16(p + "attn.compressor.wkv.weight", hd, D, std=1.0 / math.sqrt(D))
        if ratio > 1:
            G.bf16(p + "attn.compressor.wgate.weight", hd, D, std=1.0 / math.sqrt(D))
        G.bf16(p + "attn.compressor.norm.weight", hd, std=0.1, mean=1.0)
        G.bf16(p + "attn.indexer.wk.weight", c["index_head_dim"], hd, std=1.0 / math.sqrt(hd))
        G.bf16(p + "attn.indexer.k_norm.weight", c["index_head_dim"], std=0.1, mean=1.0)
    if index_source:
        G.fp8(p + "attn.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], ql)
        G.bf16(
            p + "attn.indexer.weights_proj.weight", c["index_n_heads"], D, std=1.0 / math.sqrt(D)
        )


def make_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    c = cfg["text_config"]
    G = _Gen(seed)
    D, V = c["hidden_size"], c["vocab_size"]
    G.bf16("embed.weight", V, D, std=1.0)
    G.bf16("head.weight", V, D, std=1.0 / math.sqrt(D))
    G.bf16("norm.weight", D, std=0.1, mean=1.0)
    for L in range(c["num_hidden_layers"]):
        p = f"layers.{L}."
        _block(
            G,
            p,
            c,
            n_experts=c["n_routed_experts"],
            ratio=c["compress_ratios"][L],
            kv_source=L in c["kv_source_layer_ids"],
            index_source=L in c["index_source_layer_ids"],
        )
        if L in c["engram_layer_ids"]:
            rows = c["engram_num_embeddings"][c["engram_layer_ids"].index(L)]
            d = c["engram_head_dim"]
            w, s = quant_fp8_rows(G.randn(rows, d, std=1.0))
            G.t[p + "engram.embed.weight"], G.t[p + "engram.embed.scale"] = w, s
            cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"] * d
            G.fp8(p + "engram.wkv", (c["hc_mult"] + 1) * D, cols)
            G.bf16(p + "engram.q_weight", c["hc_mult"], D, std=0.1, mean=1.0)
            G.bf16(p + "engram.k_weight", c["hc_mult"], D, std=0.1, mean=1.0)
    n_stages = c["num_nextn_predict_layers"]
    for s in range(n_stages):
        p = f"mtp.{s}."
        _block(
            G,
            p,
            c,
            n_experts=c["dspark_n_routed_experts"],
            ratio=0,
            kv_source=False,
            index_source=False,
        )
        if s == 0:
            G.fp8(p + "main_proj", D, D * len(c["dspark_target_layer_ids"]))
            G.bf16(p + "main_norm.weight", D, std=0.1, mean=1.0)
        if s == n_stages - 1:
            r = c["dspark_markov_rank"]
            G.bf16(p + "norm.weight", D, std=0.1, mean=1.0)
            G.bf16(p + "markov_head.embed.weight", V, r, std=1.0)
            G.bf16(p + "markov_head.head.weight", V, r, std=1.0 / math.sqrt(r))
            G.bf16(p + "confidence_head.proj.weight", 1, D + r, std=1.0 / math.sqrt(D + r))
    return G.t


def write_checkpoint(out_dir: str, seed: int = 0, shards: int = 2, cfg: dict | None = None) -> dict:
    cfg = tiny_hf_config() if cfg is None else cfg
    os.makedirs(out_dir, exist_ok=True)
    tensors = make_tensors(cfg, seed)
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_tokenizer(out_dir)
    return {"tensors": len(tensors), "bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=2)
    a = ap.parse_args()
    info = write_checkpoint(a.out, a.seed, a.shards)
    print(f"wrote {info['tensors']} tensors, {info['bytes']} bytes to {a.out}")


if __name__ == "__main__":
    main()
