"""The one-launch exact bf16 split against its torch form, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.bf16_split import bf16_split, bf16_split_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted, same_bits
from tests.kernels.test_rounding import values

# (leading shape, width, dtype name, layout): the released hidden width, a width that is not a
# multiple of the block, one row, no rows, rows read at a wider stride, three dimensions,
# bf16 rows (their own hi part), and every kind of fp32 value ("values").
CASES = [
    ((5,), 4096, "float32", "random"),
    ((3,), 1500, "float32", "random"),
    ((1,), 64, "float32", "random"),
    ((0,), 32, "float32", "random"),
    ((4,), 300, "float32", "strided"),
    ((2, 3), 40, "float32", "random"),
    ((3,), 1500, "bfloat16", "random"),
    ((40,), 1000, "float32", "values"),
]


def _inputs(case, device: str = "cpu") -> torch.Tensor:
    lead, width, dtype, layout = case
    rows = 1
    for n in lead:
        rows *= n
    generator = torch.Generator().manual_seed(width)
    if layout == "values":
        # random bits over the whole range, ties, ±0, ±inf, NaNs, the largest bf16 and a value
        # past it (hi = inf: the other parts NaN); none below 2⁻¹⁰⁰, where lo would leave the
        # normal range (subnormals: the interpreter flushes them)
        x = values()
        x = x[~(x.abs() < 2.0**-100)]
        x = torch.cat((x, torch.tensor([3.4e38, -3.4e38])))
        x = x[torch.randint(0, x.numel(), (rows * width,), generator=generator)]
    else:
        # magnitudes from 1e-20 to 1e20, a different one per row (far above 2⁻¹¹⁰)
        scale = torch.logspace(-20, 20, max(rows, 2))[:rows, None]
        x = torch.randn(rows, width, generator=generator) * scale
    x = x.view(*lead, width).to(getattr(torch, dtype))
    if layout == "strided":
        wide = torch.zeros(*lead, width + 20, dtype=x.dtype)
        wide[..., :width] = x
        x = wide[..., :width]
    return x.to(device)


_INTERPRETED = """
import json
from kernels.bf16_split import bf16_split, bf16_split_reference
from tests.kernels.interpreted import same_bits
from tests.kernels.test_bf16_split import CASES, _inputs
print(json.dumps([same_bits(bf16_split(x), bf16_split_reference(x)) for x in map(_inputs, CASES)]))
"""


def test_kernel_equals_the_torch_form_bit_for_bit_in_the_interpreter() -> None:
    assert run_interpreted(_INTERPRETED) == [True] * len(CASES)


def test_launcher_rejects_other_dtypes_and_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="fp32 or bf16"):
        bf16_split(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="CUDA"):
        bf16_split(torch.zeros(2, 8))


def test_the_parts_are_stored_in_wide_vectors_on_hopper() -> None:
    """What the interpreter cannot show: with a width divisible by 16 the three parts' stores
    are 16-byte vectors (the part stride num_rows · width keeps the width's divisibility, though
    num_rows is not specialised), and only the two subtractions do arithmetic."""
    from kernels.bf16_split import _bf16_split_kernel

    types = {"x_ptr": "*fp32", "parts_ptr": "*bf16", "num_rows": "i32", "width": "i32"}
    types["row_stride"] = "i32"
    aligned = {"x_ptr", "parts_ptr", "width", "row_stride"}
    ptx = compile_for_hopper(_bf16_split_kernel, types, {"BLOCK": 1024}, aligned)
    stores = re.findall(r"st\.global[.\w]*", ptx)
    assert stores and set(stores) == {"st.global.v4.b32"}
    assert len(re.findall(r"\bsub\.f32", ptx)) >= 2 and "fma" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_equals_the_torch_form_bit_for_bit(case) -> None:
    """torch's CUDA casts round to nearest even, as `round_to` does."""
    x = _inputs(case, "cuda")
    assert same_bits(bf16_split(x), bf16_split_reference(x))
