"""The one-launch MoE combine (shared + routed slots) against the torch form."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_combine import moe_combine, moe_combine_reference
from tests.kernels.interpreted import run_interpreted

# (tokens, top_k, width, dtype name): the real layer (top-6, 5120), a width off the block, one
# token, no tokens, fp32.
CASES = [(5, 6, 5120, "bfloat16"), (3, 2, 1500, "bfloat16"), (1, 6, 64, "bfloat16")]
CASES += [(0, 6, 64, "bfloat16"), (4, 3, 300, "float32")]


def _inputs(case, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    tokens, top_k, dim, dtype = case
    generator = torch.Generator().manual_seed(dim + top_k)
    shared = torch.randn(tokens, dim, generator=generator).to(getattr(torch, dtype))
    slots = torch.randn(tokens, top_k, dim, generator=generator) * 0.3
    return shared.to(device), slots.to(device)


_INTERPRETED = """
import json
from kernels.moe_combine import moe_combine, moe_combine_reference
from tests.kernels.test_moe_combine import CASES, _inputs
result = []
for case in CASES:
    shared, slots = _inputs(case)
    ours, reference = moe_combine(shared, slots), moe_combine_reference(shared, slots)
    result.append([ours.dtype == reference.dtype and ours.shape == reference.shape,
                   bool((ours == reference).all())])
print(json.dumps(result))
"""


def test_kernel_equals_the_torch_form_in_the_triton_interpreter() -> None:
    """The same additions in the same order and one round to nearest even: bit for bit."""
    assert run_interpreted(_INTERPRETED) == [[True, True]] * len(CASES)


def test_launcher_rejects_mismatched_inputs() -> None:
    shared, slots = _inputs(CASES[2])
    with pytest.raises(ValueError, match="match"):
        moe_combine(shared, slots[:, :, :32])
    with pytest.raises(ValueError, match="float32"):
        moe_combine(shared, slots.bfloat16())
    with pytest.raises(ValueError, match="CUDA"):
        moe_combine(shared, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_equals_the_torch_form(case) -> None:
    shared, slots = _inputs(case, "cuda")
    ours, reference = moe_combine(shared, slots), moe_combine_reference(shared, slots)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)
