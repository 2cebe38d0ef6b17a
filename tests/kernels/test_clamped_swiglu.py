"""The one-launch clamped SwiGLU against the torch form, and the shared expert that uses it."""

from __future__ import annotations

import pytest
import torch

from kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference
from tests.kernels.interpreted import run_interpreted

LIMIT = 10.0
# (rows, intermediate width, dtype name): the real shared expert (2304), a width that is not a
# multiple of the block, one row, no rows, fp32.
CASES = [(5, 2304, "bfloat16"), (3, 1500, "bfloat16"), (1, 64, "bfloat16"), (0, 32, "bfloat16")]
CASES += [(4, 300, "float32")]


def _inputs(case, device: str = "cpu") -> torch.Tensor:
    rows, inter, dtype = case
    generator = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=generator) * 6  # past ±L on both halves
    if rows:
        gate_up[0, :4] = torch.tensor([LIMIT, -LIMIT, 30.0, -30.0])  # the clamps' edges
    return gate_up.to(getattr(torch, dtype)).to(device)


def _bf16_ulps(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest gap in units of the reference's last place at its own magnitude."""
    eps = torch.finfo(reference.dtype).eps
    scale = reference.float().abs().clamp(min=1e-30) * eps
    return float(((ours.float() - reference.float()).abs() / scale).max()) if ours.numel() else 0.0


_INTERPRETED = """
import json
from kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference
from tests.kernels.test_clamped_swiglu import CASES, LIMIT, _bf16_ulps, _inputs
result = []
for case in CASES:
    gate_up = _inputs(case)
    ours, reference = clamped_swiglu(gate_up, LIMIT), clamped_swiglu_reference(gate_up, LIMIT)
    same = bool(ours.shape == reference.shape and ours.dtype == reference.dtype)
    mismatched = float((ours != reference).float().mean()) if ours.numel() else 0.0
    result.append([same, _bf16_ulps(ours, reference), mismatched])
print(json.dumps(result))
"""


def test_kernel_matches_the_torch_form_in_the_triton_interpreter() -> None:
    result = run_interpreted(_INTERPRETED)
    assert all(same for same, _, _ in result)
    for (rows, _, dtype), (_, gap, mismatched) in zip(CASES, result, strict=True):
        if dtype == "bfloat16":  # both round SiLU, then the product, to nearest even
            assert mismatched == 0.0, rows
        else:  # another fp32 exp: a few ulps
            assert gap <= 4.0, (rows, gap)


def test_launcher_rejects_odd_rows_and_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="halves"):
        clamped_swiglu(torch.zeros(2, 5), LIMIT)
    with pytest.raises(ValueError, match="CUDA"):
        clamped_swiglu(torch.zeros(2, 4), LIMIT)


_SHARED_EXPERT = """
import json, torch
from engine.models.deepseek_v41.moe import Expert
torch.manual_seed(0)
expert = Expert(64, 96, 10.0, torch.bfloat16)
for linear in (expert.w1, expert.w3, expert.w2):
    torch.nn.init.normal_(linear.weight, std=0.3)
x = (torch.randn(7, 64) * 2).bfloat16()
with torch.no_grad():
    unpacked = expert(x)
    names = sorted(expert.state_dict())
    expert.pack_gate_up()
    shares = expert.w1.weight.data_ptr() == expert.w13_weight.data_ptr()
    packed = expert(x)
print(json.dumps({
    "names_kept": names == sorted(expert.state_dict()),
    "shares_storage": shares,
    "max_gap": float((packed.float() - unpacked.float()).abs().max()),
    "scale": float(unpacked.float().abs().max()),
}))
"""


def test_packed_shared_expert_equals_the_unpacked_one_in_the_interpreter() -> None:
    """One GEMM for gate and up plus the kernel give the expert's output; the checkpoint
    names stay, and the two weights are views of the packed one (no extra memory)."""
    result = run_interpreted(_SHARED_EXPERT)
    assert result["names_kept"] and result["shares_storage"]
    # gate and up from one GEMM (another summation order than two) and the same SwiGLU
    assert result["max_gap"] <= 2**-6 * result["scale"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_matches_the_torch_form(case) -> None:
    gate_up = _inputs(case, "cuda")
    ours, reference = clamped_swiglu(gate_up, LIMIT), clamped_swiglu_reference(gate_up, LIMIT)
    assert ours.shape == reference.shape
    # the GPU's fast exp can move a SiLU across a bf16 rounding boundary: one ulp (a gap of at
    # most 2 in units of eps · |reference|), rarely
    assert _bf16_ulps(ours, reference) <= (2.0 if case[2] == "bfloat16" else 8.0)
    if ours.numel() and case[2] == "bfloat16":
        assert (ours != reference).float().mean() <= 0.01
