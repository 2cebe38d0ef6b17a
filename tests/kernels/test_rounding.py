"""`kernels.rounding.round_to`: bf16 rounding from the bits equals torch's cast, everywhere."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreted import compile_for_hopper, run_interpreted
from tests.kernels.rounding_probe import _round_kernel, rounded


def values(device: str = "cpu") -> torch.Tensor:
    """Random normal fp32 values over the whole range, exact ties, the largest finite bf16
    neighbours, ±0, ±inf and NaNs (a canonical one and one with only low mantissa bits)."""
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31, (20000,), generator=generator, dtype=torch.int64)
    bits = torch.cat((bits, bits | 2**31)).to(torch.int32)
    random = bits.view(torch.float32)
    # fp32 subnormals are left out: the interpreter flushes them to zero (the GPU does not)
    random = random[torch.isfinite(random) & (random.abs() >= torch.finfo(torch.float32).tiny)]
    ties = ((0x3F80 + torch.arange(200, dtype=torch.int32)) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895e38, -3.3895e38])
    nans = torch.tensor([0x7FC00000, 0x7F800001], dtype=torch.int32).view(torch.float32)
    return torch.cat((random, ties, -ties, special, nans)).to(device)


_INTERPRETED = """
import json, torch
from tests.kernels.rounding_probe import rounded
from tests.kernels.test_rounding import values
x = values()
ours, cast = rounded(x), x.bfloat16()
same = (ours.view(torch.int16) == cast.view(torch.int16)) | (ours.isnan() & cast.isnan())
print(json.dumps([int((~same).sum()), x.numel()]))
"""


def test_bf16_rounding_equals_torchs_cast_in_the_interpreter() -> None:
    wrong, total = run_interpreted(_INTERPRETED)
    assert total > 40000 and wrong == 0


def test_the_probe_kernel_compiles_for_hopper() -> None:
    """Compiled Triton reads a kernel's source from its file (an `exec`'d kernel fails at
    `@triton.jit`, as the first H200 run showed): the probe the CUDA test launches compiles."""
    types = {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32"}
    ptx = compile_for_hopper(_round_kernel, types, {"BLOCK": 1024}, {"x_ptr", "out_ptr"})
    assert ".visible .entry _round_kernel" in ptx


@pytest.mark.gpu
def test_bf16_rounding_equals_torchs_cast_on_cuda() -> None:
    x = values("cuda")
    ours, cast = rounded(x), x.bfloat16()
    same = (ours.view(torch.int16) == cast.view(torch.int16)) | (ours.isnan() & cast.isnan())
    assert bool(same.all())
