"""The one-launch sum of three partial products against its torch form, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.parts_sum import parts_sum, parts_sum_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted, same_bits

# (leading shape, width, layout): the released vocabulary, a width that is not a multiple of
# the block, one row, no rows, three dimensions, partials read through a transposed view
# (copied first), and partials with ±inf and NaN.
CASES = [
    ((2,), 129280, "partials"),
    ((7,), 1000, "partials"),
    ((1,), 64, "partials"),
    ((0,), 16, "partials"),
    ((2, 3), 40, "partials"),
    ((5,), 48, "transposed"),
    ((4,), 100, "special"),
]


def _inputs(case, device: str = "cpu") -> torch.Tensor:
    """fp32 [3, *lead, width]: as a split operand's partial products, each part ~2⁻⁸ of the
    one before (so the adds round), signs and magnitudes mixed."""
    lead, width, layout = case
    generator = torch.Generator().manual_seed(width)
    shape = (3, *lead, width)
    scale = torch.tensor([1.0, 2.0**-8, 2.0**-16]).view(3, *[1] * (len(shape) - 1))
    parts = torch.randn(shape, generator=generator) * scale
    parts *= torch.logspace(-20, 20, width)
    if layout == "special":
        flat = parts.view(3, -1)
        flat[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0])
        flat[1, :4] = torch.tensor([-float("inf"), 1.0, 0.0, float("inf")])
        flat[2, 4:8] = torch.tensor([-0.0, 0.0, float("nan"), -float("inf")])
    if layout == "transposed":
        parts = parts.transpose(-1, -2).contiguous().transpose(-1, -2)
    return parts.to(device)


_INTERPRETED = """
import json
from kernels.parts_sum import parts_sum, parts_sum_reference
from tests.kernels.interpreted import same_bits
from tests.kernels.test_parts_sum import CASES, _inputs
print(json.dumps([same_bits(parts_sum(p), parts_sum_reference(p)) for p in map(_inputs, CASES)]))
"""


def test_kernel_equals_the_torch_form_bit_for_bit_in_the_interpreter() -> None:
    assert run_interpreted(_INTERPRETED) == [True] * len(CASES)


def test_the_order_of_the_adds_shows() -> None:
    """The inputs are chosen so that another order of the adds would round otherwise."""
    parts = _inputs(CASES[1])
    assert not torch.equal(parts_sum_reference(parts), parts[0] + (parts[1] + parts[2]))


def test_launcher_rejects_other_shapes_and_dtypes_and_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="three|\\[3"):
        parts_sum(torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="fp32"):
        parts_sum(torch.zeros(3, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        parts_sum(torch.zeros(3, 4, 8))


def test_the_sum_compiles_to_two_plain_adds_in_wide_vectors_on_hopper() -> None:
    from kernels.parts_sum import _parts_sum_kernel

    types = {"parts_ptr": "*fp32", "out_ptr": "*fp32", "num_rows": "i32", "width": "i32"}
    ptx = compile_for_hopper(
        _parts_sum_kernel, types, {"BLOCK": 1024}, {"parts_ptr", "out_ptr", "width"}
    )
    assert set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)) == {
        "ld.global.v4.b32",
        "st.global.v4.b32",
    }
    assert re.findall(r"\badd\.f32", ptx) and "fma" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_equals_the_torch_form_bit_for_bit(case) -> None:
    parts = _inputs(case, "cuda")
    assert same_bits(parts_sum(parts), parts_sum_reference(parts))
