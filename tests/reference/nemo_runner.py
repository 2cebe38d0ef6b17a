"""External reference: NVIDIA NeMo AutoModel 0.7.0 `DeepseekV41ForCausalLM` on CPU.

Our own harness (no NeMo code copied). It

  1. reads a checkpoint folder in the RELEASED format (nested `config.json`,
     `model.safetensors.index.json` + shards with the names of model.md §5.3,
     FP8 E4M3 + E8M0 32x32 scales, MXFP4 experts I8 + per-32 E8M0, Engram tables
     F8_E4M3 + per-row-per-32 E8M0, `tokenizer.json`),
  2. builds NeMo's model in fp32 (or bf16) on CPU with the pure-torch backends
     `BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32",
     experts="torch", dispatcher="torch")` and TORCHDYNAMO_DISABLE=1,
  3. loads the weights through NeMo's OWN adapter
     (`DeepseekV41StateDictAdapter.from_hf`, which dequantises FP8/MXFP4/Engram itself),
  4. runs one full-sequence forward per prompt (positions 0..T-1, batch 1) and
     saves logits + per-layer intermediates captured with hooks,
  5. optionally runs the DSpark drafter (`mtp.*`, NeMo's `DeepseekV41DSparkModel`)
     for one draft block after the prompt (or teacher-forced anchors inside it).

Usage (repo root):

    .venv-nemo/bin/python tests/reference/nemo_runner.py \
        --checkpoint DIR --prompts prompts.json --out out.pt \
        [--dtype float32|bfloat16] [--cache-quant nemo|spec|none] \
        [--dspark none|last|all] [--no-layers] [--threads N]

prompts.json = list of lists of token ids.  See docs/nemo_reference_notes.md for
the layout of out.pt and for everything NeMo does differently from model.md.

Also importable: `load_reference(ckpt)` -> (model, info); `run_prompt(model, ids)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import dspark as nemo_dspark  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM  # noqa: E402

PURE_TORCH_BACKEND = dict(
    attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch"
)
_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


# ============================================================================ config / tokenizer
def load_config(ckpt: str, dtype: torch.dtype) -> DeepseekV41Config:
    """Nested released config.json -> NeMo config, text path only, in `dtype`.

    NeMo accepts the nested dict directly (`DeepseekV41Config(**json)` turns `text_config`
    into `DeepseekV41TextConfig`). We only (a) force the parameter dtype (NeMo reads
    `text_config.dtype`; `torch_dtype` overrides `dtype` in its constructor, so set both) and
    (b) disable the vision tower."""
    with open(os.path.join(ckpt, "config.json")) as f:
        raw = json.load(f)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    text = dict(raw.get("text_config", {}))
    text["dtype"] = name
    text["torch_dtype"] = name
    raw["text_config"] = text
    raw["vision_config"] = dict(raw.get("vision_config") or {}, num_hidden_layers=0)
    raw["dtype"] = name
    raw.pop("torch_dtype", None)
    cfg = DeepseekV41Config(**raw)
    cfg._name_or_path = os.path.abspath(ckpt)  # what NeMo's build_tokenizer() reads
    return cfg


def load_tokenizer(cfg: DeepseekV41Config, ckpt: str, mode: str = "auto"):
    """NeMo's own path is `cfg.build_tokenizer()` = transformers AutoTokenizer(use_fast=True)
    on the checkpoint folder. 'file' builds
    PreTrainedTokenizerFast(tokenizer_file=<ckpt>/tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    if mode in ("auto", "nemo"):
        try:
            return cfg.build_tokenizer(), "nemo:AutoTokenizer"
        except Exception as exc:  # noqa: BLE001
            if mode == "nemo":
                raise
            print(
                f"[nemo_runner] AutoTokenizer failed ({exc!r}); using tokenizer.json directly",
                file=sys.stderr,
            )
    return PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(ckpt, "tokenizer.json")
    ), "file:tokenizer.json"


# ============================================================================ weights
def read_release_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(os.path.join(ckpt, fname), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[k] = f.get_tensor(k)
    return out


def load_backbone_weights(
    model: DeepseekV41ForCausalLM, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Released names -> NeMo names through NeMo's adapter, then strict load_state_dict."""
    hf = {
        k: v
        for k, v in tensors.items()
        if not k.startswith("mtp.") and not k.startswith(_VISION_PREFIXES)
    }
    dropped = sorted(k for k in tensors if k.startswith(_VISION_PREFIXES))
    native = model.state_dict_adapter.from_hf(hf)
    expected = model.state_dict()
    bad_shape = [
        (k, tuple(v.shape), tuple(expected[k].shape))
        for k, v in native.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    if bad_shape:
        raise ValueError(f"shape mismatches after NeMo adapter: {bad_shape[:10]}")
    res = model.load_state_dict(native, strict=True)
    return {
        "missing": list(res.missing_keys),
        "unexpected": list(res.unexpected_keys),
        "dropped_vision": dropped,
    }


def build_dspark(cfg: DeepseekV41Config, tensors: dict[str, torch.Tensor], backend: BackendConfig):
    """NeMo's released-format drafter (`mtp.0..2`) + its own DSpark adapter."""
    text = cfg.text_config
    draft = nemo_dspark.DeepseekV41DSparkModel(
        text, backend, num_anchors=1, enable_confidence_head=True
    )
    hf = {
        k: v
        for k, v in tensors.items()
        if k.startswith("mtp.") or k in ("embed.weight", "head.weight")
    }
    native = draft.state_dict_adapter.from_hf(hf)
    res = draft.load_state_dict(native, strict=True)
    draft.eval()
    return draft, {"missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys)}


def load_reference(
    ckpt: str,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer_mode: str = "auto",
    with_dspark: bool = True,
):
    """Build NeMo's model on CPU from a released-format folder.

    Returns (model, draft or None, info)."""
    t0 = time.perf_counter()
    cfg = load_config(ckpt, dtype)
    tok, tok_src = load_tokenizer(cfg, ckpt, tokenizer_mode)
    backend = BackendConfig(**PURE_TORCH_BACKEND)
    model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=tok)
    model.eval()
    t1 = time.perf_counter()
    tensors = read_release_tensors(ckpt)
    t2 = time.perf_counter()
    report = load_backbone_weights(model, tensors)
    draft, dreport = (None, None)
    text = cfg.text_config
    if (
        with_dspark
        and text.num_nextn_predict_layers > 0
        and any(k.startswith("mtp.") for k in tensors)
    ):
        draft, dreport = build_dspark(cfg, tensors, backend)
    t3 = time.perf_counter()
    info = {
        "tokenizer_source": tok_src,
        "tokenizer_len": len(tok),
        "engram_compressed_vocab": text.engram_compressed_vocab_size,
        "load_report": report,
        "dspark_load_report": dreport,
        "n_release_tensors": len(tensors),
        "seconds": {"build": t1 - t0, "read": t2 - t1, "adapt_load": t3 - t2},
        "dtype": str(dtype),
    }
    return model, draft, info


# ============================================================================ cache-quant variants
def _pow2_ceil_exact(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for x > 0, exact (frexp; no log rounding)."""
    m, e = torch.frexp(x)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(x), e)


_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _rne_e2m1(x: torch.Tensor) -> torch.Tensor:
    levels = x.new_tensor(_E2M1_LEVELS)
    a = x.abs().clamp(max=6.0)
    d = (a.unsqueeze(-1) - levels).abs()
    best = d.amin(-1, keepdim=True)
    odd = (torch.arange(8, device=x.device) % 2).to(x.dtype)
    code = torch.where(d == best, odd, torch.full_like(d, 9.0)).argmin(-1)  # ties -> even code
    return torch.copysign(levels[code], x)


def spec_quantize_cache(values: torch.Tensor, *, format: str, block_size: int) -> torch.Tensor:
    """model.md §2.3 cache formats (our reading), quantise->dequantise, fp32 internally.

    fp8  : s = 2^ceil(log2(max(amax/448, 1e-4)))           (NeMo: max(amax,1e-4)/448)
    nvfp4: s = e4m3_rne(clamp(amax/6, 2^-9, 448))          (NeMo: no upper clamp)
    mxfp4: s = 2^ceil(log2(max(amax, 6*2^-126)/6)), RNE    (same as NeMo)
    """
    ch = values.shape[-1]
    g = torch.nn.functional.pad(values.float(), (0, -ch % block_size)).unflatten(
        -1, (-1, block_size)
    )
    amax = g.abs().amax(-1, keepdim=True)
    if format == "fp8":
        s = _pow2_ceil_exact((amax / 448.0).clamp_min(1e-4))
        q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif format == "nvfp4":
        s = (amax / 6.0).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
        q = _rne_e2m1((g / s).clamp(-6, 6))
    elif format == "mxfp4":
        s = _pow2_ceil_exact(amax.clamp_min(6 * 2.0**-126) / 6.0)
        q = _rne_e2m1((g / s).clamp(-6, 6))
    else:
        raise ValueError(format)
    return (q * s).flatten(-2)[..., :ch].to(values.dtype)


def _identity_quantize_cache(values: torch.Tensor, *, format: str, block_size: int) -> torch.Tensor:
    return values.clone()


_ORIG_QUANT = {"attention": nemo_attention.quantize_cache, "dspark": nemo_dspark.quantize_cache}


class _QuantRecorder:
    """Wraps the cache quantiser used by NeMo's attention/indexer/DSpark to (a) select the
    variant and (b) record pre/post tensors per layer (the SWA/compressed/index rows that
    NeMo never exposes as module outputs)."""

    def __init__(self, variant: str):
        self.base = {"nemo": None, "spec": spec_quantize_cache, "none": _identity_quantize_cache}[
            variant
        ]
        self.sink: dict | None = None  # current layer's capture dict

    def make(self, orig):
        base = orig if self.base is None else self.base

        def quantize_cache(values, *, format, block_size):
            out = base(values, format=format, block_size=block_size)
            if self.sink is not None:
                if format == "fp8":
                    key = "swa_kv"
                elif format == "nvfp4":
                    key = "compressed_kv"
                elif values.ndim == 4:
                    key = "index_q"
                else:
                    key = "index_k"
                n, suffix = 0, ""
                while key + suffix + "_q" in self.sink:  # repeated calls (DSpark: ctx, then block)
                    n += 1
                    suffix = f"_{n}"
                self.sink[key + suffix + "_pre"] = values.detach()[0].float().clone()
                self.sink[key + suffix + "_q"] = out.detach()[0].float().clone()
            return out

        return quantize_cache

    @contextlib.contextmanager
    def installed(self):
        nemo_attention.quantize_cache = self.make(_ORIG_QUANT["attention"])
        nemo_dspark.quantize_cache = self.make(_ORIG_QUANT["dspark"])
        try:
            yield self
        finally:
            nemo_attention.quantize_cache = _ORIG_QUANT["attention"]
            nemo_dspark.quantize_cache = _ORIG_QUANT["dspark"]


# ============================================================================ capture
def _f(t: torch.Tensor) -> torch.Tensor:
    """Batch-1 tensor -> detached fp32 CPU copy without the batch axis."""
    t = t.detach()
    if t.dtype.is_floating_point:
        t = t.float()
    return t[0].clone()


def _install_layer_hooks(model: DeepseekV41ForCausalLM, layers: list[dict], rec: _QuantRecorder):
    hs = []
    for li, block in model.model.layers.items():
        cap = layers[int(li)]

        def blk_pre(mod, args, kwargs, cap=cap):
            cap["in_streams"] = _f(args[0])
            cap["pre_prev"] = _f(args[1])
            rec.sink = cap

        def blk_post(mod, args, kwargs, out, cap=cap):
            cap["out_streams"] = _f(out[0])
            cap["pre_next"] = _f(out[1])
            rec.sink = None

        hs.append(block.register_forward_pre_hook(blk_pre, with_kwargs=True))
        hs.append(block.register_forward_hook(blk_post, with_kwargs=True))

        if block.engram is not None:
            hs.append(
                block.engram.register_forward_hook(
                    lambda m, a, o, cap=cap: cap.__setitem__("engram_out", _f(o))
                )
            )

        def hc_hook(name, cap=cap):
            def h(m, a, o):
                cap[name + "_streams_in"] = _f(a[0])
                cap[name + "_mix"] = {"pre": _f(o.pre), "post": _f(o.post), "comb": _f(o.comb)}

            return h

        hs.append(block.attn_hc.register_forward_hook(hc_hook("attn")))
        hs.append(block.ffn_hc.register_forward_hook(hc_hook("ffn")))

        def attn_hook(m, args, kwargs, out, cap=cap):
            cap["attn_in"] = _f(args[0])
            cap["attn_out"] = _f(out.hidden_states)
            st = out.state
            if m.compress_ratio:
                cap["topk_used"] = _f(st.topk_indices)  # selection this layer attended with
                if m.is_kv_source:
                    cap["compressed_kv"] = _f(st.compressed_kv)  # rotated + quant/dequant
                if m.indexer is not None:
                    cap["topk_indices"] = _f(st.topk_indices)
                    cap["index_keys"] = _f(st.index_keys)
                    if st.candidates is not None:
                        cap["candidates"] = _f(st.candidates)

        hs.append(block.attn.register_forward_hook(attn_hook, with_kwargs=True))
        if block.attn.compressor is not None:
            hs.append(
                block.attn.compressor.register_forward_hook(
                    lambda m, a, o, cap=cap: cap.__setitem__("compressor_latent", _f(o))
                )
            )

        def ffn_hook(m, args, out, cap=cap):
            cap["ffn_in"] = _f(args[0])
            cap["moe_out"] = _f(out)

        hs.append(block.ffn.register_forward_hook(ffn_hook))

        def gate_hook(m, args, out, cap=cap):
            w, idx, _ = out
            cap["route_weights"] = w.detach().float().clone()  # [T, k], scaled, applied weights
            cap["route_experts"] = idx.detach().clone()  # [T, k]

        hs.append(block.ffn.gate.register_forward_hook(gate_hook))
        if block.ffn.shared_experts is not None:
            hs.append(
                block.ffn.shared_experts.register_forward_hook(
                    lambda m, a, o, cap=cap: cap.__setitem__(
                        "shared_out", o.detach().float().reshape(-1, o.shape[-1]).clone()
                    )
                )
            )
    return hs


@torch.no_grad()
def run_prompt(
    model: DeepseekV41ForCausalLM,
    ids: list[int],
    *,
    capture_layers: bool = True,
    cache_quant: str = "nemo",
    draft=None,
    dspark_mode: str = "none",
) -> dict[str, Any]:
    """One full-sequence forward (batch 1, positions 0..T-1)."""
    text = model.config.text_config
    input_ids = torch.tensor([ids], dtype=torch.long)
    layers: list[dict] = [dict() for _ in range(text.num_hidden_layers)]
    rec = _QuantRecorder(cache_quant)
    result: dict[str, Any] = {"input_ids": input_ids[0].clone()}
    hooks = []
    feats: dict[int, torch.Tensor] = {}
    if capture_layers:
        hooks += _install_layer_hooks(model, layers, rec)
        if model.model.engram_hash is not None:
            hooks.append(
                model.model.engram_hash.register_forward_hook(
                    lambda m, a, kw, o: result.__setitem__("engram_hash_ids", o[0].clone()),
                    with_kwargs=True,
                )
            )
    if draft is not None and dspark_mode != "none":
        # DSpark target features = stream mean of the residual ENTERING the target layers
        # (NeMo: input of attn_hc, i.e. after Engram; mean taken by its DSpark target wrapper).
        mods = model.get_dspark_target_feature_modules(list(text.dspark_target_layer_ids))
        for lid, mod in zip(text.dspark_target_layer_ids, mods, strict=True):
            hooks.append(
                mod.register_forward_pre_hook(
                    lambda m, a, lid=lid: feats.__setitem__(lid, a[0].mean(dim=2))
                )
            )
    norm_out = {}
    hooks.append(
        model.model.norm.register_forward_hook(lambda m, a, o: norm_out.__setitem__("h", o))
    )
    try:
        with rec.installed():
            t0 = time.perf_counter()
            out = model(input_ids=input_ids)
            result["forward_seconds"] = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    result["logits"] = out.logits[0].float().clone()
    result["final_hidden"] = norm_out["h"][0].float().clone()
    if capture_layers:
        result["layers"] = layers
    if draft is not None and dspark_mode != "none":
        target = torch.cat([feats[lid] for lid in text.dspark_target_layer_ids], dim=-1)
        result["dspark"] = run_dspark(
            draft, target, input_ids, result["logits"], mode=dspark_mode, cache_quant=cache_quant
        )
    return result


@torch.no_grad()
def run_dspark(
    draft,
    target: torch.Tensor,
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    *,
    mode: str,
    cache_quant: str,
):
    """Drafts with NeMo's DSpark backbone.

    mode 'last': the first draft step after prefilling the prompt: anchor position T with the
      greedy token argmax(logits[T-1]); context = target features of positions 0..T-1.
    mode 'all' : teacher-forced anchors at every prompt position p = 1..T-1 (anchor token =
      prompt token p, context = features of positions < p), one block each.
    Returns base logits U [A, 5, V] (fp32 head on mtp.2.norm output), greedy Markov drafts,
    the Markov-corrected logits z, and confidence logits (NeMo input = normalised h, spec §6.1
    input = pre-norm h)."""
    cfg = draft.config
    B = cfg.dspark_block_size
    T = input_ids.shape[1]
    if mode == "last":
        anchors = [T]
        tokens = [int(logits[-1].argmax())]
    elif mode == "all":
        if T < 2:
            return None  # no anchor with a non-empty context
        anchors = list(range(1, T))
        tokens = [int(input_ids[0, p]) for p in anchors]
    else:
        raise ValueError(mode)
    anchor_pos = torch.tensor([anchors], dtype=torch.long)
    keep = torch.ones_like(anchor_pos, dtype=torch.bool)
    ids = torch.full((1, len(anchors) * B), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[0, 0::B] = torch.tensor(tokens)
    emb = draft.embed_tokens(ids)
    pos = draft.build_position_ids(anchor_pos, T)
    mask = draft.build_attention_mask(anchor_pos, keep, T, emb.dtype)
    last = draft.mtp[-1]
    pre_norm = {}
    h = last.norm.register_forward_pre_hook(lambda m, a: pre_norm.__setitem__("h", a[0]))
    stage_streams: list[torch.Tensor] = []
    stage_quant: list[dict] = [dict() for _ in draft.mtp]
    rec = _QuantRecorder(cache_quant)
    hs = []
    for si, stage in enumerate(draft.mtp):
        hs.append(
            stage.register_forward_pre_hook(
                lambda m, a, si=si: setattr(rec, "sink", stage_quant[si])
            )
        )
        hs.append(
            stage.register_forward_hook(
                lambda m, a, o: stage_streams.append(o.streams[0].float().clone())
            )
        )
    try:
        with rec.installed():
            out = nemo_dspark.DeepseekV41DSparkBackbone.forward(
                draft,
                emb,
                target.to(emb.dtype),
                position_ids=pos,
                attention_mask=mask,
                previous_token_ids=None,
            )
    finally:
        h.remove()
        for x in hs:
            x.remove()
    hn = out.normalized_hidden_states  # [1, A*B, D]
    U = draft.compute_logits(hn).view(len(anchors), B, -1)  # fp32 head
    hn = hn.view(len(anchors), B, -1)
    hp = pre_norm["h"].view(len(anchors), B, -1)
    drafts, z_all, conf_n, conf_p = [], [], [], []
    prev = torch.tensor(tokens)
    for s in range(B):
        trans, memb = last.markov_head(prev)
        z = U[:, s].float() + trans.float()
        d = z.argmax(-1)
        conf_n.append(last.confidence_head(hn[:, s], memb))
        conf_p.append(last.confidence_head(hp[:, s], memb))
        drafts.append(d)
        z_all.append(z)
        prev = d
    return {
        "anchor_positions": anchor_pos[0],
        "anchor_tokens": torch.tensor(tokens),
        "target_features": target[0].float().clone(),  # [T, 3D] stream means
        "stage_streams": stage_streams,  # per stage [A*B, 4, D]
        "hidden_prenorm": hp.float().clone(),  # [A, B, D]
        "hidden_normed": hn.float().clone(),
        "base_logits": U.float().clone(),  # [A, B, V]
        "markov_logits": torch.stack(z_all, 1).clone(),  # [A, B, V] = U + Markov(prev greedy)
        "greedy_drafts": torch.stack(drafts, 1),  # [A, B]
        "confidence_logit_nemo": torch.stack(conf_n, 1).float(),  # proj([norm(h); e]) (NeMo)
        "confidence_logit_prenorm": torch.stack(conf_p, 1).float(),  # proj([h; e]) (model.md §6.1)
        # per stage: swa_kv_{pre,q} = context rows (target features), swa_kv_1_{pre,q} = block rows
        "stage_quant": stage_quant,
    }


# ============================================================================ CLI
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", required=True, help="released-format folder")
    ap.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    ap.add_argument("--out", required=True, help="output .pt")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--cache-quant",
        default="nemo",
        choices=["nemo", "spec", "none"],
        help="KV-cache quantisation emulation: NeMo's own (default), model.md §2.3 (fp8 floor/"
        "nvfp4 clamp as spec), or none (identity; isolates quantisation effects)",
    )
    ap.add_argument("--dspark", default="last", choices=["none", "last", "all"])
    ap.add_argument("--no-layers", action="store_true", help="logits only (no per-layer capture)")
    ap.add_argument("--tokenizer", default="auto", choices=["auto", "nemo", "file"])
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (1 = robust on the shared 2-core box; 0 = torch default)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed forwards before the first prompt (first call is slow)",
    )
    ap.add_argument(
        "--time-repeats",
        type=int,
        default=0,
        help="extra no-capture forwards per prompt for timing",
    )
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    with open(a.prompts) as f:
        prompts = json.load(f)
    if not (isinstance(prompts, list) and all(isinstance(p, list) and p for p in prompts)):
        raise SystemExit("prompts.json must be a non-empty list of non-empty lists of ints")
    model, draft, info = load_reference(
        a.checkpoint, dtype=dtype, tokenizer_mode=a.tokenizer, with_dspark=a.dspark != "none"
    )
    V = model.config.text_config.vocab_size
    for i, p in enumerate(prompts):
        if any((not isinstance(t, int)) or t < 0 or t >= V for t in p):
            raise SystemExit(f"prompt {i} has ids outside [0, {V})")
    for _ in range(a.warmup):
        run_prompt(model, prompts[0], capture_layers=False, cache_quant=a.cache_quant)
    results = []
    for i, p in enumerate(prompts):
        times = [
            run_prompt(model, p, capture_layers=False, cache_quant=a.cache_quant)["forward_seconds"]
            for _ in range(a.time_repeats)
        ]
        r = run_prompt(
            model,
            p,
            capture_layers=not a.no_layers,
            cache_quant=a.cache_quant,
            draft=draft,
            dspark_mode=a.dspark,
        )
        if times:
            times.sort()
            r["timing"] = {"min_s": times[0], "median_s": times[len(times) // 2], "all_s": times}
        results.append(r)
        extra = ""
        if times:
            med = times[len(times) // 2]
            extra = f" (no-capture min {times[0] * 1e3:.1f} / median {med * 1e3:.1f} ms"
            extra += f" over {len(times)})"
        print(
            f"[nemo_runner] prompt {i}: T={len(p)} "
            f"forward {r['forward_seconds'] * 1e3:.1f} ms{extra}, "
            f"last argmax {int(r['logits'][-1].argmax())}",
            file=sys.stderr,
        )
    import importlib.metadata as md

    meta = {
        "checkpoint": os.path.abspath(a.checkpoint),
        "nemo_automodel": md.version("nemo_automodel"),
        "torch": torch.__version__,
        "transformers": md.version("transformers"),
        "backend": PURE_TORCH_BACKEND,
        "dtype": a.dtype,
        "cache_quant": a.cache_quant,
        "dspark": a.dspark,
        **info,
    }
    torch.save(
        {
            "meta": meta,
            "prompts": prompts,
            "logits": [r["logits"] for r in results],
            "results": results,
        },
        a.out,
    )
    print(f"[nemo_runner] wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
