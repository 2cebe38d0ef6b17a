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


def test_compiled_kernel_takes_libdevice_exp_and_a_rounded_division() -> None:
    """What the interpreter cannot show: on sm90 SiLU's exp is libdevice's `expf` (range
    reduction, then `ex2` of the reduced argument times 2^j) and its division `div.rn`, as
    torch's CUDA SiLU; not Triton's `ex2.approx` of x·log2 e and `div.full` (the first H200
    run: 10.4 fp32 ulps off torch at gate = −30)."""
    from kernels.clamped_swiglu import CUDA_OPTIONS, _clamped_swiglu_kernel
    from tests.kernels.interpreted import compile_for_hopper

    types = {"gate_up_ptr": "*fp32", "out_ptr": "*fp32", "inter": "i32", "limit": "fp32"}
    constexprs = {"BLOCK": 1024, "LIBDEVICE": True}
    ptx = compile_for_hopper(_clamped_swiglu_kernel, types, constexprs, set(), CUDA_OPTIONS)
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "fma.rm.f32" in ptx  # libdevice's expf: j = round(x·log2 e), rounded down
    assert "mul.f32" not in ptx.split("ex2.approx")[0]  # no ex2 of a plain product x·log2 e


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cuda_kernel_matches_the_torch_form(case) -> None:
    """Bit for bit in bf16 and fp32: the same libdevice `expf`, `1 + e` (exact whether fused
    or not, see the kernel's note), `div.rn` and products as torch's CUDA SiLU and mul."""
    gate_up = _inputs(case, "cuda")
    ours, reference = clamped_swiglu(gate_up, LIMIT), clamped_swiglu_reference(gate_up, LIMIT)
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    assert torch.equal(ours, reference), _bf16_ulps(ours, reference)
