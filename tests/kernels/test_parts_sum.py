"""The one-launch (scaled) sum of three partial products against its torch form, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.parts_sum import parts_sum, parts_sum_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted, same_bits

# The indexer's weight scale (index_head_dim^-0.5 · index_n_heads^-0.5, not exact in fp32).
INDEX_SCALE = 128**-0.5 * 64**-0.5
# (leading shape, width, layout, scale): the released vocabulary, a width that is not a
# multiple of the block, one row, no rows, three dimensions, partials read through a transposed
# view (copied first), partials with ±inf and NaN; unscaled and scaled; one column.
CASES = [
    ((2,), 129280, "partials", 1.0),
    ((7,), 1000, "partials", 1.0),
    ((1,), 64, "partials", 1.0),
    ((0,), 16, "partials", 1.0),
    ((2, 3), 40, "partials", 1.0),
    ((5,), 48, "transposed", 1.0),
    ((4,), 100, "special", 1.0),
    ((7,), 64, "partials", INDEX_SCALE),
    ((3,), 1000, "special", 0.3),
    ((4,), 1, "partials", 1.0),  # DSpark's confidence head: one column
]


def _inputs(case, device: str = "cpu") -> torch.Tensor:
    """fp32 [3, *lead, width]: as a split operand's partial products, each part ~2⁻⁸ of the
    one before (so the adds round), signs and magnitudes mixed."""
    lead, width, layout, _ = case
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
result = []
for case in CASES:
    parts, scale = _inputs(case), case[-1]
    result.append(same_bits(parts_sum(parts, scale), parts_sum_reference(parts, scale)))
print(json.dumps(result))
"""


def test_kernel_equals_the_torch_form_bit_for_bit_in_the_interpreter() -> None:
    assert run_interpreted(_INTERPRETED) == [True] * len(CASES)


def test_the_order_of_the_adds_and_the_scale_show() -> None:
    """The inputs are chosen so that another order of the adds would round otherwise, and
    the reference scales as the model's separate product did: by the scale rounded to fp32."""
    parts = _inputs(CASES[1])
    assert not torch.equal(parts_sum_reference(parts), parts[0] + (parts[1] + parts[2]))
    total = parts[0] + parts[1] + parts[2]
    assert torch.equal(parts_sum_reference(parts, INDEX_SCALE), total * INDEX_SCALE)
    assert torch.equal(
        parts_sum_reference(parts, INDEX_SCALE), total * torch.tensor(INDEX_SCALE).float()
    )
    assert not torch.equal(total * INDEX_SCALE, (total.double() * INDEX_SCALE).float())


def test_launcher_rejects_other_shapes_and_dtypes_and_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="three|\\[3"):
        parts_sum(torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="fp32"):
        parts_sum(torch.zeros(3, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA"):
        parts_sum(torch.zeros(3, 4, 8))


def test_the_sum_compiles_to_plain_adds_and_a_product_in_wide_vectors_on_hopper() -> None:
    from kernels.parts_sum import _parts_sum_kernel

    types = {"parts_ptr": "*fp32", "out_ptr": "*fp32", "num_rows": "i32", "width": "i32"}
    types["scale"] = "fp32"
    ptx = compile_for_hopper(
        _parts_sum_kernel, types, {"BLOCK": 1024}, {"parts_ptr", "out_ptr", "width"}
    )
    assert set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx)) == {
        "ld.global.v4.b32",
        "st.global.v4.b32",
    }
    assert re.findall(r"\badd\.f32", ptx) and re.findall(r"\bmul\.f32", ptx)
    assert "fma" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_equals_the_torch_form_bit_for_bit(case) -> None:
    parts, scale = _inputs(case, "cuda"), case[-1]
    assert same_bits(parts_sum(parts, scale), parts_sum_reference(parts, scale))
