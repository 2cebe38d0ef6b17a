"""The one-launch mHC mixing kernel against the model's torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.mhc_mix import mhc_mix, mhc_mix_reference
from tests.kernels.interpreted import run_interpreted

CASES = [(0, 4), (1, 4), (37, 4), (300, 4), (5, 2), (9, 8)]
HC_EPS, ITERS = 1e-6, 20

_INTERPRETED = """
import json, torch
from kernels.mhc_mix import mhc_mix, mhc_mix_reference
from tests.kernels.test_mhc_mix import CASES
errors = []
for num_tokens, n in CASES:
    logits = torch.randn(num_tokens, 2 * n + n * n, generator=torch.Generator().manual_seed(n)) * 3
    ours, reference = mhc_mix(logits, n, 1e-6, 20), mhc_mix_reference(logits, n, 1e-6, 20)
    gaps = [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(ours, reference)]
    errors.append(max(gaps))
print(json.dumps(errors))
"""


def test_kernel_logic_matches_reference_in_the_triton_interpreter() -> None:
    errors = run_interpreted(_INTERPRETED)
    assert len(errors) == len(CASES) and max(errors) < 1e-5


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="fp32"):
        mhc_mix(torch.zeros(3, 24, dtype=torch.float64), 4, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="power of two"):
        mhc_mix(torch.zeros(3, 15), 3, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="CUDA"):
        mhc_mix(torch.zeros(3, 24), 4, HC_EPS, ITERS)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "n"), CASES)
def test_kernel_matches_reference_on_cuda(num_tokens: int, n: int) -> None:
    logits = torch.randn(num_tokens, 2 * n + n * n, device="cuda") * 3
    ours = mhc_mix(logits, n, HC_EPS, ITERS)
    for got, expected in zip(ours, mhc_mix_reference(logits, n, HC_EPS, ITERS), strict=True):
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
