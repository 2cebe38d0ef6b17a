"""The attention's `wq_a` and `wkv` as one GEMM over a packed weight (`pack_projections`), and a
ratio-2 compressor's `wkv` and `wgate` as one fp32 product (`Compressor.pack_projections`)."""

from __future__ import annotations

import torch

from engine.models import preset_config
from engine.models.deepseek_v41.attention import Attention
from engine.models.deepseek_v41.dense import FP8BlockLinear
from engine.models.deepseek_v41.primitives import rope_frequencies
from tests.kernels.interpreted import run_interpreted


def attention_layer(seed: int = 0, layer_id: int = 0, dtype=torch.bfloat16) -> Attention:
    """Layer `layer_id` of `tiny` (bf16) with random weights (layer 1: a ratio-2 KV source)."""
    cfg = preset_config("tiny")
    freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    attn = Attention(cfg, layer_id, freqs, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in attn.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return attn


_PACKED = """
import json, torch
from tests.models.test_attention_projections import attention_layer
attn = attention_layer()
x = (torch.randn(7, attn.cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 2)
x = x.bfloat16()
with torch.no_grad():
    unpacked = attn.latents(x)
    names = sorted(attn.state_dict())
    attn.pack_projections()
    shares = attn.wq_a.weight.data_ptr() == attn.wq_a_kv_weight.data_ptr()
    packed = attn.latents(x)
    qa_unpacked = attn.q_norm(unpacked[0])
    qa_packed = attn.q_norm(packed[0])
    attn.batch_invariant = True
    invariant = attn.latents(x)
print(json.dumps({
    "names_kept": names == sorted(attn.state_dict()),
    "shares_storage": shares,
    "views": [t.data_ptr() - packed[0].data_ptr() for t in packed],
    "gaps": [float((p.float() - u.float()).abs().max()) for p, u in zip(packed, unpacked)],
    "scales": [float(u.float().abs().max()) for u in unpacked],
    "norm_gap": float((qa_packed.float() - qa_unpacked.float()).abs().max()),
    "batch_invariant_unpacked": all(
        torch.equal(a, b) for a, b in zip(invariant, (attn.wq_a(x), attn.wkv(x)))
    ),
}))
"""


def test_packed_projections_equal_the_two_linears_in_the_interpreter() -> None:
    """One GEMM gives both latents as views of its output; the checkpoint names stay and both
    weights are views of the packed one (no extra memory); batch-invariant mode keeps the two
    linears."""
    result = run_interpreted(_PACKED)
    assert result["names_kept"] and result["shares_storage"]
    rank = preset_config("tiny").q_lora_rank
    assert result["views"] == [0, rank * 2]  # bytes: the kv columns follow the query's
    # one GEMM of both (another summation order than two at most) and the same norm
    for gap, scale in zip(result["gaps"], result["scales"], strict=True):
        assert gap <= 2**-7 * scale
    assert result["batch_invariant_unpacked"]


def test_cpu_path_and_fp8_linears_stay_unpacked() -> None:
    attn = attention_layer()
    x = torch.randn(5, attn.cfg.hidden_size).bfloat16()
    with torch.no_grad():
        before = attn.latents(x)
        state = {k: v.clone() for k, v in attn.state_dict().items()}
        attn.pack_projections()
        after = attn.latents(x)  # the CPU runs the two linears, as before
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert all(torch.equal(state[k], v) for k, v in attn.state_dict().items())
    fp8 = attention_layer()
    fp8.wq_a = FP8BlockLinear(fp8.wq_a.in_features, fp8.wq_a.out_features, 32)
    fp8.pack_projections()
    assert not hasattr(fp8, "wq_a_kv_weight")


_PACKED_COMPRESSOR = """
import json, torch
from benchmarks.kernel_census import LaunchCensus
from tests.kernels.specializations import record_launch_keys
from tests.models.test_attention_projections import attention_layer
attn = attention_layer(layer_id=1)
compressor = attn.compressor
x = (torch.randn(7, attn.cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 2)
x = x.bfloat16()
with torch.no_grad():
    unpacked = compressor.keys_and_gates(x)
    names = sorted(attn.state_dict())
    attn.pack_projections()
    packed_weight = compressor.wkv_gate_weight
    census = LaunchCensus()
    with census, record_launch_keys() as launched:
        packed = compressor.keys_and_gates(x)
    for linear in (compressor.wkv, compressor.wgate):
        linear.batch_invariant = True
    invariant = compressor.keys_and_gates(x)
    invariant_two = torch.stack(
        (compressor.wkv.forward_fp32(x), compressor.wgate.forward_fp32(x)), 1
    )
print(json.dumps({
    "names_kept": names == sorted(attn.state_dict()),
    "views": [
        linear.weight.data_ptr() - packed_weight.data_ptr()
        for linear in (compressor.wkv, compressor.wgate)
    ],
    "shape": [list(unpacked.shape), list(packed.shape)],
    "dtype": str(packed.dtype),
    "gemms": census.by_op["aten::mm"],
    "kernels": sorted({key[0] for key in launched}),
    "gap": float((packed - unpacked).abs().max() / unpacked.abs().max()),
    "batch_invariant_unpacked": torch.equal(invariant, invariant_two),
}))
"""


def test_packed_compressor_projections_are_one_fp32_product_in_the_interpreter() -> None:
    """With the GEMM a GPU has (provided on the CPU, as the census does): of a bf16 x, one
    GEMM with fp32 output gives (k, gate) as the halves of each row (no split and no sum: x
    is its own only bf16 part); checkpoint names stay, both weights are views of the packed
    one; batch-invariant mode keeps the two linears."""
    result = run_interpreted(_PACKED_COMPRESSOR, tensor_core_gemms=True)
    assert result["names_kept"]
    cfg = preset_config("tiny")
    head_dim = cfg.head_dim
    assert result["views"] == [0, head_dim * cfg.hidden_size * 2]  # bytes: gate after k
    assert result["shape"] == [[7, 2, head_dim]] * 2 and result["dtype"] == "torch.float32"
    assert result["gemms"] == 1
    assert result["kernels"] == []
    # another GEMM width, another summation order at most: fp32 noise of an fp32 product
    assert result["gap"] < 1e-6
    assert result["batch_invariant_unpacked"]


def test_the_cpu_path_and_other_compressor_linears_stay_unpacked() -> None:
    attn = attention_layer(layer_id=1)
    x = torch.randn(5, attn.cfg.hidden_size).bfloat16()
    with torch.no_grad():
        before = attn.compressor.keys_and_gates(x)
        state = {k: v.clone() for k, v in attn.state_dict().items()}
        attn.pack_projections()
        assert hasattr(attn.compressor, "wkv_gate_weight")
        after = attn.compressor.keys_and_gates(x)  # the CPU runs the two products, as before
        assert torch.equal(before, after)
        assert all(torch.equal(state[k], v) for k, v in attn.state_dict().items())
    exact = attention_layer(layer_id=1, dtype=torch.float32)  # fp32 weights: no tensor cores
    exact.pack_projections()
    assert not hasattr(exact.compressor, "wkv_gate_weight")
    fp8 = attention_layer(layer_id=1)
    wgate = fp8.compressor.wgate
    fp8.compressor.wgate = FP8BlockLinear(wgate.in_features, wgate.out_features, 32)
    fp8.pack_projections()
    assert not hasattr(fp8.compressor, "wkv_gate_weight")
    ratio_1 = attention_layer(layer_id=4)  # a ratio-1 source: no gate
    ratio_1.pack_projections()
    assert ratio_1.compressor.ratio == 1 and not hasattr(ratio_1.compressor, "wkv_gate_weight")
