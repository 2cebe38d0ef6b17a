"""`kernels.rounding.round_to`: bf16 rounding from the bits equals torch's cast, everywhere."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreted import run_interpreted

_KERNEL = """
import triton, triton.language as tl
from kernels.rounding import round_to

@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    x = tl.load(x_ptr + i, mask=keep, other=0.0)
    tl.store(out_ptr + i, round_to(x, tl.bfloat16).to(tl.bfloat16), mask=keep)

def rounded(x):
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out
"""


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


_INTERPRETED = (
    _KERNEL
    + """
import json, torch
from tests.kernels.test_rounding import values
x = values()
ours, cast = rounded(x), x.bfloat16()
same = (ours.view(torch.int16) == cast.view(torch.int16)) | (ours.isnan() & cast.isnan())
print(json.dumps([int((~same).sum()), x.numel()]))
"""
)


def test_bf16_rounding_equals_torchs_cast_in_the_interpreter() -> None:
    wrong, total = run_interpreted(_INTERPRETED)
    assert total > 40000 and wrong == 0


@pytest.mark.gpu
def test_bf16_rounding_equals_torchs_cast_on_cuda() -> None:
    namespace: dict = {"torch": torch}
    exec(_KERNEL, namespace)  # noqa: S102 - the same kernel source as the interpreter test
    x = values("cuda")
    ours, cast = namespace["rounded"](x), x.bfloat16()
    same = (ours.view(torch.int16) == cast.view(torch.int16)) | (ours.isnan() & cast.isnan())
    assert bool(same.all())
