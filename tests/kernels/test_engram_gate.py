"""The one-launch Engram gate against the model's torch form."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.engram import engram_gate_reference
from kernels.engram_gate import engram_gate
from tests.kernels.interpreted import run_interpreted

# (tokens, streams, width, dtype name): the real layer (4 streams of 4096, bf16), a width off
# the power of two in fp32, fp32 at a small width, no tokens.
CASES = [(5, 4, 4096, "bfloat16"), (3, 2, 1000, "float32"), (4, 4, 256, "float32")]
CASES += [(0, 4, 64, "float32")]
EPS = 1e-20


def _inputs(case, device: str = "cpu"):
    """(residual, kv, q weight, k weight, is_image): every third token an image token, and a
    zero residual row (its mean square is 0: the gate sees rsqrt(eps))."""
    tokens, streams, width, dtype = case
    generator = torch.Generator().manual_seed(width + streams)
    dt = getattr(torch, dtype)
    residual = torch.randn(tokens, streams, width, generator=generator)
    if tokens > 1:
        residual[1, 0] = 0
    kv = torch.randn(tokens, (streams + 1) * width, generator=generator)
    q = 1 + 0.3 * torch.randn(streams, width, generator=generator)
    k = 1 + 0.3 * torch.randn(streams, width, generator=generator)
    is_image = torch.arange(tokens) % 3 == 2
    tensors = (residual, kv, q, k)
    return (*(t.to(dt).to(device) for t in tensors), is_image.to(device))


def gaps(device: str = "cpu") -> list[list[float]]:
    """Per case, with and without the image mask: [relative norm of the difference, the
    largest difference in steps of the output dtype (its eps times the value, at least 1),
    whether the image tokens kept their residual exactly (a gate of 0: R' = R)]."""
    result = []
    for case in CASES:
        residual, kv, q, k, is_image = _inputs(case, device)
        for image in (None, is_image):
            ours = engram_gate(residual, kv, q, k, EPS, image)
            reference = engram_gate_reference(residual, kv, q, k, EPS, image)
            difference = (ours.double() - reference.double()).cpu()
            norm = float(reference.double().norm().clamp(min=1e-30))
            step = torch.finfo(ours.dtype).eps * reference.double().abs().cpu().clamp(min=1)
            largest = float((difference.abs() / step).max()) if difference.numel() else 0.0
            kept = image is None or bool((ours[image] == residual[image]).all())
            result.append([float(difference.norm()) / norm, largest, kept])
    return result


_INTERPRETED = """
import json
from tests.kernels.test_engram_gate import gaps
print(json.dumps(gaps()))
"""


def _check(result: list[list[float]]) -> None:
    dtypes = [case[3] for case in CASES for _ in (0, 1)]
    for dtype, (relative, largest, kept) in zip(dtypes, result, strict=True):
        assert kept
        # three row sums in another order: the gate moves by a few fp32 ulps, so an output
        # element by at most one step of its dtype (a bf16 rounding boundary crossed)
        assert relative < (1e-6 if dtype == "float32" else 1e-3)
        assert largest <= (8 if dtype == "float32" else 1)


def test_kernel_matches_the_torch_form_in_the_triton_interpreter() -> None:
    _check(run_interpreted(_INTERPRETED))


def test_launcher_rejects_mismatched_inputs() -> None:
    residual, kv, q, k, is_image = _inputs(CASES[2])
    with pytest.raises(ValueError, match="does not match"):
        engram_gate(residual, kv[:, :-1], q, k, EPS)
    with pytest.raises(ValueError, match="weights"):
        engram_gate(residual, kv, q[:1], k, EPS)
    with pytest.raises(ValueError, match="is_image"):
        engram_gate(residual, kv, q, k, EPS, is_image[:1])
    with pytest.raises(ValueError, match="CUDA"):
        engram_gate(residual, kv, q, k, EPS, is_image)


@pytest.mark.gpu
def test_cuda_kernel_matches_the_torch_form() -> None:
    _check(gaps("cuda"))
