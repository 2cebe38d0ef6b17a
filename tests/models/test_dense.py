"""The batch-invariant CPU paths: `dense_matmul`'s row tiles, `row_sum`, the pointwise forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.deepseek_v41 import primitives
from engine.models.deepseek_v41.dense import (
    Linear,
    dense_matmul,
    fp32_times_bf16,
    fp32_times_bf16_reference,
    grouped_linear,
    row_sum,
)
from kernels.bf16_split import bf16_split_reference
from tests.kernels.interpreted import run_interpreted


def _rows_inside(fn, rows: torch.Tensor, total: int, at: int, g: torch.Generator):
    """fn over `rows` placed at offset `at` of `total` random rows; those rows of the result."""
    big = torch.randn(total, *rows.shape[1:], generator=g).to(rows.dtype)
    big[at : at + rows.shape[0]] = rows
    return fn(big)[at : at + rows.shape[0]]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_other_rows(threads: int, dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 256, generator=g).to(dtype)
        x = torch.randn(3, 256, generator=g).to(dtype)
        alone = dense_matmul(x, weight, True)
        torch.testing.assert_close(alone, F.linear(x, weight), rtol=2e-2, atol=1e-3)
        for total, at in ((3, 0), (8, 5), (17, 2), (65, 40), (300, 151)):
            inside = _rows_inside(lambda t: dense_matmul(t, weight, True), x, total, at, g)
            assert torch.equal(inside, alone), (total, at)
    finally:
        torch.set_num_threads(before)


def test_the_default_products_do_depend_on_the_other_rows() -> None:
    """What the row tiles fix: MKL rounds one row (a GEMV) unlike the same row among many."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 256, generator=g), torch.randn(1, 256, generator=g)
    inside = _rows_inside(lambda t: dense_matmul(t, weight), x, 64, 10, g)
    assert not torch.equal(inside, dense_matmul(x, weight))


def test_row_sums_do_not_depend_on_the_other_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 320, generator=g)
    alone = row_sum(x, True)
    torch.testing.assert_close(alone, x.sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(_rows_inside(lambda t: row_sum(t, True), x, 77, 30, g), alone)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_pointwise_forms_round_the_same_at_a_tensors_tail(name: str) -> None:
    """torch's vector loop and scalar tail round these differently; the invariant forms do not
    (a 31-element tensor is all tail; inside 1024 elements the same values are vectorised)."""
    fn = getattr(primitives, name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1024, generator=g) * 4
    x[::97] = 30.0  # softplus's linear branch
    whole = fn(x, True)
    tails = torch.cat([fn(x[i : i + 31], True) for i in range(0, 31 * 33, 31)])
    assert torch.equal(tails, whole[: 31 * 33])
    torch.testing.assert_close(whole, fn(x), rtol=1e-6, atol=1e-6)
    default_tails = torch.cat([fn(x[i : i + 31]) for i in range(0, 31 * 33, 31)])
    assert not torch.equal(default_tails, fn(x)[: 31 * 33])


def test_pair_softmax_matches_the_softmax_and_rounds_alike_everywhere() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 31, generator=g) * 3, torch.randn(40, 31, generator=g) * 3
    ours = primitives.pair_softmax(a, b, True)
    torch.testing.assert_close(ours, primitives.pair_softmax(a, b), rtol=1e-6, atol=1e-7)
    rows = torch.cat(
        [primitives.pair_softmax(a[i : i + 1], b[i : i + 1], True) for i in range(40)], 1
    )
    assert torch.equal(rows, ours)


def test_three_bf16_parts_add_up_to_the_fp32_value_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    parts = bf16_split_reference(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 512)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), x)
    # two parts would not do: the third carries real bits for most values
    assert (parts[0].float() + parts[1].float() != x).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_cuda_fp32_products_of_bf16_weights_run_on_tensor_cores_to_fp32_accuracy(rows) -> None:
    """The split adds nothing to the tensor-core GEMM's own error, and that error is the one of
    an fp32 accumulator that truncates once per tensor-core step (dense.py's note).

    The first H200 run measured 1.6e-6 (1 row) and 5.4e-6 (64, 300 rows) relative, 7-12x the
    fp32 CUDA-core GEMM's 2.4e-7..5.2e-7: a GEMM's accumulation, not the split (exact, see
    the test above), which the first assertion pins. Bound of the second: the K/16 tensor-core
    steps (bf16 wgmma's k = 16) each truncate the running fp32 sum by < 1 ulp, about u on
    average, all towards zero, so at most ~(K/16)·u of |y| in norm when they add coherently
    (emulated on the CPU: 1.9e-6..1.9e-5 for steps of 64 down to 1 product, at most this)."""
    g = torch.Generator().manual_seed(rows)
    k = 5120
    x = torch.randn(rows, k, generator=g).cuda()
    linear = Linear(k, 2000, torch.bfloat16).cuda().requires_grad_(False)
    weight = linear.weight
    reference = x.double() @ weight.double().t()
    ours = linear.forward_fp32(x)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, fp32_times_bf16(x, weight))  # the fast path ran
    assert torch.equal(ours, fp32_times_bf16_reference(x, weight))  # its kernels, bit for bit
    parts = bf16_split_reference(x)
    per_part = torch.mm(parts.reshape(-1, k), weight.t(), out_dtype=torch.float32).view(3, rows, -1)
    exact_parts = parts.double() @ weight.double().t()
    gemm_error = sum(float((per_part[p].double() - exact_parts[p]).norm()) for p in range(3))
    error = float((ours.double() - reference).norm())
    u = 2.0**-24
    # the two fp32 adds of the parts round by ≤ u·|y| each
    assert error <= gemm_error + 2.01 * u * float(reference.norm())
    assert error / float(reference.norm()) <= k / 16 * u


_KERNEL_PATH = """
import json, torch
from engine.models.deepseek_v41.dense import Linear, fp32_times_bf16_reference
generator = torch.Generator().manual_seed(0)
linear = Linear(320, 72, torch.bfloat16).requires_grad_(False)
linear.weight.copy_(torch.randn(72, 320, generator=generator))
result = []
for shape, dtype, scale in (
    ((1,), "float32", 1.0),
    ((7,), "bfloat16", 1.0),
    ((2, 3), "float32", 1.0),
    ((0,), "float32", 1.0),
    ((5,), "bfloat16", 128**-0.5 * 64**-0.5),  # the indexer's weight scale
):
    x = (torch.randn(*shape, 320, generator=generator) * 3).to(getattr(torch, dtype))
    ours = linear.forward_fp32(x, scale)
    # the scale as the indexer applied it before (a separate product)
    reference = fp32_times_bf16_reference(x, linear.weight) * scale
    exact = x.double() @ linear.weight.double().t() * scale
    gap = float((ours.double() - exact).norm() / exact.norm().clamp(min=1e-30))
    result.append([torch.equal(ours, reference), list(ours.shape), str(ours.dtype), gap])
print(json.dumps(result))
"""


def test_fp32_products_take_the_kernels_in_the_interpreter() -> None:
    """With the GEMM a GPU has (provided on the CPU as the census does), `forward_fp32` runs
    the split and sum kernels: bit for bit the torch form (a scale too), the fp32 product of
    x and W."""
    result = run_interpreted(_KERNEL_PATH, tensor_core_gemms=True)
    shapes = [[1, 72], [7, 72], [2, 3, 72], [0, 72], [5, 72]]
    for (same, shape, dtype, gap), want in zip(result, shapes, strict=True):
        assert same and shape == want and dtype == "torch.float32"
        assert gap < 1e-6  # an fp32 GEMM of the exact parts, three exact partial products


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(0,), (1,), (37,), (2, 5)])
def test_grouped_linear_on_cuda_writes_each_group_in_place(lead) -> None:
    """The attention's `wo_a` (8 groups): the batched GEMM into the flat result gives einsum's
    values (to a GEMM's rounding: cuBLAS may pick another kernel for the strided output),
    and with autograd on it still computes (einsum's path, bit for bit)."""
    g = torch.Generator().manual_seed(len(lead))
    linear = torch.nn.Linear(512, 8 * 128, bias=False).bfloat16().cuda().requires_grad_(False)
    x = torch.randn(*lead, 8 * 512, generator=g).bfloat16().cuda()
    weight = linear.weight.view(8, 128, 512)
    expected = torch.einsum("...gi,goi->...go", x.unflatten(-1, (8, -1)), weight).flatten(-2)
    with torch.inference_mode():
        ours = grouped_linear(linear, x, 8)
    assert ours.shape == (*lead, 8 * 128) and ours.is_contiguous()
    if expected.numel():  # a group in the wrong place would be off by ~1, not by ~1e-3
        error = (ours.float() - expected.float()).norm() / expected.float().norm()
        assert error < 2e-3
    linear.requires_grad_(True)
    assert torch.equal(grouped_linear(linear, x, 8).detach(), expected)
