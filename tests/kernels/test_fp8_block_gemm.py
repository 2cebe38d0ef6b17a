"""The FP8 block-scaled dense GEMM and its activation quantizer against their torch references.

Triton's interpreter runs the FP8 kernels themselves (float8e4nv loads, stores and `tl.dot` on
FP8 operands are exact there; its float32 → FP8 cast is not, which is why the kernels round in
float32 first — see the kernel module's NOTE), so the CPU suite checks the real code on small
tiles; the `gpu` tests repeat the checks at the released model's widths with the compiled tiles.
Errors are relative Frobenius norms against the reference (dequantize both operands, multiply
in float32).
"""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.weight_formats import fp8_block_dequantize, fp8_block_quantize
from kernels.fp8_block_gemm import (
    GemmConfig,
    fp8_block_gemm,
    fp8_block_gemm_reference,
    quantize_activations,
    quantize_activations_reference,
)
from tests.kernels.interpreted import compile_for_hopper, run_interpreted

BLOCK = 32

# (M, K, N, groups, config or None, also from codes): K at the released widths (5120 hidden,
# 1280 q_lora, 2304 expert width) with N cut to keep the interpreter fast; M = 1, 16, 128, 1000;
# an N that is not a multiple of the tile (96), K splits, and the grouped form of `wo_a` (8
# groups). The pre-quantized input runs on the cheaper cases (the interpreter takes ~1 s per
# 100 K steps).
CASES = [
    (1, 5120, 128, 1, GemmConfig(16, 128, split_k=2), True),
    (16, 1280, 256, 1, None, False),
    (128, 2304, 64, 1, None, False),
    (1000, 256, 96, 1, None, True),
    (5, 128, 64, 8, None, True),
]


def _operands(m: int, k: int, n: int, groups: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(m * 7 + k + n)
    # rows of very different magnitudes, one all-zero row: per-row scales must follow them
    x = torch.randn(m, groups * k, generator=generator)
    x *= torch.logspace(-3, 2, m)[:, None]
    if m > 1:
        x[m // 2] = 0
    w = torch.randn(groups * n, k, generator=generator) * k**-0.5
    weight, scale = fp8_block_quantize(w, BLOCK)
    return x.to(device), weight.to(device), scale.to(device)


def _rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.float().cpu(), reference.float().cpu()
    return float((ours - reference).norm() / reference.norm())


def gemm_errors(device: str = "cpu") -> list[list[float]]:
    """Per case: [in-kernel quantization, pre-quantized codes (0 when not run)] relative errors
    and the output itemsize of the codes' default (bf16)."""
    result = []
    for m, k, n, groups, config, from_codes in CASES:
        x, weight, scale = _operands(m, k, n, groups, device)
        reference = fp8_block_gemm_reference(x, weight, scale, block=BLOCK, groups=groups)
        fused = fp8_block_gemm(
            x, weight, scale, block=BLOCK, groups=groups, out_dtype=torch.float32, config=config
        )
        if not from_codes:
            result.append([_rel(fused, reference), 0.0, 2])
            continue
        codes, x_scale = quantize_activations(x, BLOCK)
        split = fp8_block_gemm(
            codes, weight, scale, block=BLOCK, groups=groups, x_scale=x_scale, config=config
        )
        result.append([_rel(fused, reference), _rel(split, reference), split.dtype.itemsize])
    return result


def quantizer_mismatches(device: str = "cpu") -> list[int]:
    """Bytes that differ from the reference: codes, scales (rows of mixed magnitudes, zeros,
    subnormal-range values, values on and next to the 448·2^e boundaries)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(41, 160, generator=generator) * torch.logspace(-40, 30, 41)[:, None]
    x[3] = 0
    x[4, :32] = 448.0
    x[5, :32] = torch.linspace(-449.0, 449.0, 32)
    x[6, :32] = 2.0**-130
    x = x.to(device)
    codes, scales = quantize_activations(x, BLOCK)
    ref_codes, ref_scales = quantize_activations_reference(x.cpu(), BLOCK)
    return [
        int((codes.view(torch.uint8).cpu() != ref_codes.view(torch.uint8)).sum()),
        int((scales.view(torch.uint8).cpu() != ref_scales.view(torch.uint8)).sum()),
    ]


_INTERPRETED = """
import json
from tests.kernels.test_fp8_block_gemm import gemm_errors, quantizer_mismatches
print(json.dumps({"gemm": gemm_errors(), "quantizer": quantizer_mismatches()}))
"""


@pytest.mark.slow  # ~12 s in the interpreter
def test_kernels_match_their_references_in_the_triton_interpreter() -> None:
    result = run_interpreted(_INTERPRETED)
    assert result["quantizer"] == [0, 0]
    for fused, split, out_bytes in result["gemm"]:
        assert fused < 1e-6 and split < 1e-2  # fp32 output; bf16 output (default for codes)
        assert out_bytes == 2


def test_reference_is_the_dequantized_product_of_the_quantized_activations() -> None:
    x, weight, scale = _operands(16, 256, 64, 1)
    codes, x_scale = quantize_activations_reference(x, BLOCK)
    a = codes.float().unflatten(-1, (-1, BLOCK)) * torch.ldexp(
        torch.ones(()), x_scale.view(torch.uint8).int() - 127
    ).unsqueeze(-1)
    expected = a.flatten(-2) @ fp8_block_dequantize(weight, scale, BLOCK).t()
    got = fp8_block_gemm_reference(x, weight, scale, block=BLOCK)
    assert _rel(got, expected) < 1e-6
    # FP8 activations cost ~2.5 % of the product's norm against the bf16/fp32 dense path.
    dense = x @ fp8_block_dequantize(weight, scale, BLOCK).t()
    assert 1e-3 < _rel(got, dense) < 5e-2


def test_quantized_codes_follow_the_power_of_two_rule() -> None:
    x = torch.tensor([[448.0] + [0.0] * 31, [449.0] + [1.0] * 31, [0.0] * 32])
    codes, scales = quantize_activations_reference(x, BLOCK)
    assert scales.view(torch.uint8).tolist() == [[127], [128], [0]]  # 2^0, 2^1, all-zero row
    assert codes.float()[1, 0] == 224.0  # 449 / 2, rounded to the e4m3 grid


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, weight, scale = _operands(4, 64, 64, 1)
    with pytest.raises(ValueError, match="K % block"):
        fp8_block_gemm(x[:, :48], weight[:, :48], scale, block=BLOCK)
    with pytest.raises(ValueError, match="scales"):
        fp8_block_gemm(x, weight, scale[:1], block=BLOCK)
    with pytest.raises(ValueError, match="groups"):
        fp8_block_gemm(x, weight, scale, block=BLOCK, groups=3)
    with pytest.raises(ValueError, match="power of two"):
        fp8_block_gemm(x, weight, scale, block=24)
    with pytest.raises(ValueError, match="CUDA"):
        fp8_block_gemm(x, weight, scale, block=BLOCK)
    with pytest.raises(ValueError, match="CUDA"):
        quantize_activations(x, BLOCK)


# ---- on the GPU: compiled tiles (wgmma), the released model's dense shapes ------------------

# (M, K, N, groups): wq_a, wkv, wq_b, wo_a (8 groups), wo_b, shared w1 and w2 at M = 1 .. 4096.
GPU_SHAPES = [
    (1, 5120, 1280, 1),
    (16, 5120, 512, 1),
    (64, 1280, 32768, 1),
    (128, 4096, 1024, 8),
    (256, 8192, 5120, 1),
    (1000, 5120, 2304, 1),
    (4096, 2304, 5120, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, groups", GPU_SHAPES)
def test_cuda_gemm_matches_reference(m: int, k: int, n: int, groups: int) -> None:
    x, weight, scale = _operands(m, k, n, groups, "cuda")
    reference = fp8_block_gemm_reference(x, weight, scale, block=BLOCK, groups=groups)
    fp32 = fp8_block_gemm(x, weight, scale, block=BLOCK, groups=groups, out_dtype=torch.float32)
    bf16 = fp8_block_gemm(x.bfloat16(), weight, scale, block=BLOCK, groups=groups)
    codes, x_scale = quantize_activations(x, BLOCK)
    split = fp8_block_gemm(codes, weight, scale, block=BLOCK, groups=groups, x_scale=x_scale)
    # FP8 wgmma adds a 32-product slab with fewer mantissa bits than fp32 (~14, DeepSeek-V3
    # report §3.3.2); the slab sums are exact in the reference
    assert _rel(fp32, reference) < 5e-4
    # bf16 input rounds x before its FP8 quantization; bf16 output rounds once at the end
    assert _rel(bf16, reference) < 2e-2 and _rel(split, reference) < 1e-2
    assert bf16.dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_quantizer_matches_reference_bytes() -> None:
    assert quantizer_mismatches("cuda") == [0, 0]


# ---- compiled for sm90 without a GPU: what the interpreter cannot show ------------------------


_GEMM_TYPES = {
    "w_ptr": "*fp8e4nv",
    "w_scale_ptr": "*u8",
    "out_ptr": "*bf16",
    **{name: "i32" for name in ("M", "N", "K", "blocks_per_split")},
    **{f"stride_{s}": "i32" for s in ("am", "asm", "wsn", "os", "om")},
}
_GEMM_ALIGNED = {"a_ptr", "a_scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "N", "K", "stride_am"}


@pytest.mark.parametrize("quantize_a", [True, False])
def test_gemm_compiles_to_fp8_wgmma_with_pipelined_loads(quantize_a: bool) -> None:
    from kernels.fp8_block_gemm import _fp8_block_gemm_kernel

    a_types = {"a_ptr": "*bf16", "a_scale_ptr": "*bf16"} if quantize_a else {
        "a_ptr": "*fp8e4nv", "a_scale_ptr": "*u8"
    }  # fmt: skip
    constexprs = {"QUANTIZE_A": quantize_a, "BLOCK": 32, "BLOCK_M": 64, "BLOCK_N": 128}
    ptx = compile_for_hopper(
        _fp8_block_gemm_kernel, {**_GEMM_TYPES, **a_types}, constexprs, _GEMM_ALIGNED
    )
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert "cp.async" in ptx  # software-pipelined loads (num_stages)


def test_quantizers_compile_for_hopper() -> None:
    from kernels.fp8_block_gemm import _quantize_kernel
    from kernels.rms_norm import _rms_norm_kernel

    ptx = compile_for_hopper(
        _quantize_kernel,
        {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scale_ptr": "*u8", "num_rows": "i32",
         "width": "i32"},
        {"BLOCK": 32, "ROWS": 16},
        {"x_ptr", "codes_ptr", "scale_ptr", "width"},
    )  # fmt: skip
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    ptx = compile_for_hopper(
        _rms_norm_kernel,
        {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "codes_ptr": "*fp8e4nv",
         "scale_ptr": "*u8", "width": "i32", "x_row_stride": "i32", "eps": "fp32"},
        {"HAS_WEIGHT": True, "EMIT_FP8": True, "BLOCK": 8192, "GROUP": 32},
        {"x_ptr", "weight_ptr", "out_ptr", "codes_ptr", "scale_ptr", "width"},
    )  # fmt: skip
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
