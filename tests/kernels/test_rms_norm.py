"""The one-launch RMSNorm against the model's torch code."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels.interpreted import run_interpreted, ulps

# (shape, dtype name, weighted): the hidden width, a non-power-of-two width under extra leading
# dims, bf16, an empty batch, and a row of zeros (eps keeps it finite: zeros out).
CASES = [
    ((5, 5120), "float32", True),
    ((3, 2, 1000), "float32", False),
    ((4, 128), "bfloat16", True),
    ((0, 64), "float32", True),
    ((2, 64), "float32", True),
]
EPS = 1e-20


def _inputs(case, device: str = "cpu"):
    shape, dtype, weighted = case
    generator = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    if shape == (2, 64):
        x[0] = 0
    weight = torch.randn(shape[-1], generator=generator).to(x.dtype) if weighted else None
    return x.to(device), None if weight is None else weight.to(device)


_INTERPRETED = """
import json
from kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernels.interpreted import ulps
from tests.kernels.test_rms_norm import CASES, EPS, _inputs
result = []
for case in CASES:
    x, weight = _inputs(case)
    ours, reference = rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS)
    result.append([ulps(ours, reference), bool(ours.isfinite().all())])
print(json.dumps(result))
"""


def test_kernel_matches_reference_in_the_triton_interpreter() -> None:
    result = run_interpreted(_INTERPRETED)
    assert all(finite for _, finite in result)
    # fp32: the sum of squares in another order moves the scale by an ulp or so.
    assert max(gap for gap, _ in result) <= 16


def strided_mismatches(device: str = "cpu") -> list[int]:
    """Per case: elements of `rms_norm` (and of `rms_norm_fp8`'s three outputs, where the width
    allows) of rows read as a column slice of wider rows that differ from those of the same
    rows made contiguous (the attention's packed projection hands the norm such a view)."""
    from kernels.rms_norm import rms_norm_fp8

    result = []
    for case in CASES:
        x, weight = _inputs(case, device)
        wide = torch.cat((x, torch.full_like(x[..., :48], 7.0)), -1)
        view = wide[..., : x.shape[-1]]
        pairs = [(rms_norm(view, weight, EPS), rms_norm(x, weight, EPS))]
        if x.shape[-1] % 32 == 0:
            fp8 = rms_norm_fp8(view, weight, EPS), rms_norm_fp8(x, weight, EPS)
            pairs += zip(*fp8, strict=True)
        differ = [int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in pairs]
        result.append(sum(differ))
    return result


_STRIDED_INTERPRETED = """
import json
from tests.kernels.test_rms_norm import strided_mismatches
print(json.dumps(strided_mismatches()))
"""


def test_strided_rows_give_the_contiguous_rows_bits_in_the_interpreter() -> None:
    assert run_interpreted(_STRIDED_INTERPRETED) == [0] * len(CASES)


@pytest.mark.gpu
def test_strided_rows_give_the_contiguous_rows_bits_on_cuda() -> None:
    assert strided_mismatches("cuda") == [0] * len(CASES)


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, weight = _inputs(CASES[0])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:100], EPS)
    with pytest.raises(ValueError, match="at most"):
        rms_norm(torch.zeros(1, 20000), None, EPS)
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm(x, weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_on_cuda(case) -> None:
    x, weight = _inputs(case, "cuda")
    ours = rms_norm(x, weight, EPS)
    assert ours.isfinite().all() and ulps(ours, rms_norm_reference(x, weight, EPS)) <= 16


# ---- RMSNorm emitting the FP8 codes of its output (kernels.fp8_block_gemm's codes input) ------

FP8_CASES = [
    ((5, 5120), "float32", True),
    ((3, 2, 1280), "bfloat16", True),
    ((4, 96), "float32", False),
    ((0, 64), "float32", True),
]


def fp8_mismatches(device: str = "cpu") -> list[list[int]]:
    """Per case: elements of (output, codes, scales) that differ from `rms_norm` followed by
    `quantize_activations` (the two launches the fused kernel replaces)."""
    from kernels.fp8_block_gemm import quantize_activations
    from kernels.rms_norm import rms_norm_fp8

    result = []
    for case in FP8_CASES:
        x, weight = _inputs(case, device)
        if x.shape[0] > 1:
            x[1] = 0
        fused = rms_norm_fp8(x, weight, EPS)
        out = rms_norm(x, weight, EPS)
        separate = (out, *quantize_activations(out))
        result.append(
            [
                int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                for a, b in zip(fused, separate, strict=True)
            ]
        )
    return result


_FP8_INTERPRETED = """
import json
from tests.kernels.test_rms_norm import fp8_mismatches
print(json.dumps(fp8_mismatches()))
"""


def test_fp8_emitting_norm_equals_norm_then_quantize_in_the_interpreter() -> None:
    assert run_interpreted(_FP8_INTERPRETED) == [[0, 0, 0]] * len(FP8_CASES)


def test_fp8_emitting_norm_rejects_widths_off_the_block() -> None:
    from kernels.rms_norm import rms_norm_fp8

    with pytest.raises(ValueError, match="multiple of the block"):
        rms_norm_fp8(torch.zeros(2, 80), None, EPS)


@pytest.mark.gpu
def test_cuda_fp8_emitting_norm_equals_norm_then_quantize() -> None:
    assert fp8_mismatches("cuda") == [[0, 0, 0]] * len(FP8_CASES)
