"""`benchmarks/kernel_census.py`: which aten ops launch a kernel, and the CUDA-only GEMM it
provides on the CPU so that the model takes its tensor-core branches."""

from __future__ import annotations

from collections import Counter

import torch

from benchmarks.kernel_census import LaunchCensus
from engine.models.deepseek_v41.dense import fp32_on_tensor_cores
from tests.kernels.interpreted import run_interpreted


def test_copies_count_and_views_do_not() -> None:
    x = torch.randn(4, 8)
    census = LaunchCensus()
    with torch.inference_mode(), census:
        x.bfloat16()  # a dtype conversion: a kernel
        x.float()  # the same dtype: x itself
        x.view(8, 4).t()
        x.reshape(32)  # a view
        x.t().reshape(32)  # a copy
        x.t().contiguous()  # a copy
        x.contiguous()  # x itself
        torch.empty(0).bfloat16()  # nothing to copy
        x.add(1)
    expected = {"aten::to": 1, "aten::reshape": 1, "aten::contiguous": 1, "aten::add": 1}
    assert census.by_op == Counter(expected)


_TENSOR_CORES = """
import json, torch
from benchmarks.kernel_census import LaunchCensus, provide_bf16_gemms_to_fp32_on_cpu
from engine.models.deepseek_v41.dense import Linear, fp32_on_tensor_cores
weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
before = fp32_on_tensor_cores(x[:0], weight)  # asks torch once, in a fresh process
gemms = provide_bf16_gemms_to_fp32_on_cpu()
census = LaunchCensus()
with torch.inference_mode(), census:
    product = torch.mm(x.bfloat16(), weight.t(), out_dtype=torch.float32)
exact = x.bfloat16().double() @ weight.double().t()
print(json.dumps({
    "before": before,
    "ops": dict(census.by_op),
    "dtype": str(product.dtype),
    "rel": float((product.double() - exact).norm() / exact.norm()),
}))
"""

_PROVIDED = """
import json, torch
from benchmarks.kernel_census import provide_bf16_gemms_to_fp32_on_cpu
gemms = provide_bf16_gemms_to_fp32_on_cpu()
from engine.models.deepseek_v41.dense import fp32_on_tensor_cores
weight = torch.zeros(24, 64, dtype=torch.bfloat16)
x = torch.zeros(5, 64)
print(json.dumps([
    fp32_on_tensor_cores(x, weight),
    fp32_on_tensor_cores(x, weight.float()),
    fp32_on_tensor_cores(x, weight, batch_invariant=True),
]))
"""


def test_the_census_provides_the_cuda_only_gemm_and_counts_it_once() -> None:
    """The fp32-output bf16 GEMM runs on the CPU (the fp32 product of the exact bf16 values)
    and is counted as the one op a GPU launches, not the casts inside it."""
    result = run_interpreted(_TENSOR_CORES)
    assert result["before"] is False  # this torch has no such GEMM on the CPU
    assert result["ops"] == {"aten::to": 1, "aten::mm": 1}  # x.bfloat16(), then the GEMM
    assert result["dtype"] == "torch.float32" and result["rel"] < 1e-6


def test_with_the_gemm_the_interpreter_takes_the_tensor_core_branch() -> None:
    """Only for bf16 weights outside batch-invariant mode."""
    assert run_interpreted(_PROVIDED) == [True, False, False]
    weight, x = torch.zeros(24, 64, dtype=torch.bfloat16), torch.zeros(5, 64)
    assert not fp32_on_tensor_cores(x, weight)  # plain CPU: the fp32 product, as before
