"""The one-launch RoPE against the model's torch code (interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.primitives import rope_frequencies
from kernels.rope import apply_rope, apply_rope_reference
from tests.kernels.interpreted import run_interpreted, ulps

# (x shape, positions' dims, rotated channels, dtype name, inverse): queries [T, H, D], rows
# [T, D], DSpark's [B, S, H, D]; a fully rotated row; positions past 2^16.
CASES = [
    ((5, 3, 128), 1, 64, "float32", False),
    ((5, 3, 128), 1, 64, "float32", True),
    ((7, 96), 1, 32, "bfloat16", False),
    ((2, 3, 4, 64), 2, 64, "float32", True),
    ((0, 2, 64), 1, 16, "float32", False),
]


def _inputs(case, device: str = "cpu"):
    shape, lead, rot, dtype, inverse = case
    generator = torch.Generator().manual_seed(sum(shape) + rot)
    x = torch.randn(shape, generator=generator).to(getattr(torch, dtype))
    positions = torch.randint(0, 200_000, shape[:lead], generator=generator)
    freqs = rope_frequencies(rot, 10000.0, None)
    return x.to(device), positions.to(device), freqs.to(device), inverse


def _terms(x: torch.Tensor, rot: int) -> torch.Tensor:
    """|a| + |b| of each rotated pair (the scale its sums round at), 0 on kept channels."""
    pairs = x[..., x.shape[-1] - rot :].float().abs().unflatten(-1, (-1, 2)).sum(-1)
    terms = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    terms[..., x.shape[-1] - rot :] = pairs.repeat_interleave(2, -1)
    return terms


_INTERPRETED = """
import json
from kernels.rope import apply_rope, apply_rope_reference
from tests.kernels.interpreted import ulps
from tests.kernels.test_rope import CASES, _inputs, _terms
print(json.dumps([
    ulps(apply_rope(*args), apply_rope_reference(*args), _terms(args[0], case[2]))
    for case in CASES
    for args in [_inputs(case)]
]))
"""


_IN_PLACE = """
import json, torch
from kernels.rope import apply_rope
from tests.kernels.test_rope import CASES, _inputs
result = []
for case in CASES:
    x, positions, freqs, *rest = _inputs(case)
    copy = apply_rope(x, positions, freqs, *rest)
    before = x.clone()
    ours = apply_rope(x, positions, freqs, *rest, in_place=True)
    kept = x.shape[-1] - case[2]
    result.append([
        ours.data_ptr() == x.data_ptr(),
        torch.equal(ours.view(torch.int16 if ours.element_size() == 2 else torch.int32),
                    copy.view(torch.int16 if copy.element_size() == 2 else torch.int32)),
        torch.equal(x[..., :kept], before[..., :kept]),
    ])
x, positions, freqs, _ = _inputs(CASES[0])
try:
    apply_rope(x.transpose(0, 1).contiguous().transpose(0, 1), positions, freqs, in_place=True)
    result.append("accepted")
except ValueError as error:
    result.append(str(error))
print(json.dumps(result))
"""


def test_in_place_rotation_gives_the_copys_bits_in_x_itself() -> None:
    """`in_place`: x is the result, with the bits of the out-of-place launch; the channels that
    pass through are neither read into nor written (they keep their values)."""
    *cases, refused = run_interpreted(_IN_PLACE)
    assert cases == [[True, True, True]] * len(CASES)
    assert "contiguous" in refused


def test_kernel_matches_reference_in_the_triton_interpreter() -> None:
    # numpy's float32 cos/sin stand in for libdevice here: a few ulps of the angle functions.
    assert max(run_interpreted(_INTERPRETED)) <= 4


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, positions, freqs, _ = _inputs(CASES[0])
    with pytest.raises(ValueError, match="must lead"):
        apply_rope(x, positions[:-1], freqs)
    with pytest.raises(ValueError, match="rotated channels"):
        apply_rope(x[..., :32], positions, freqs)
    with pytest.raises(ValueError, match="CUDA"):
        apply_rope(x, positions, freqs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_on_cuda(case) -> None:
    args = _inputs(case, "cuda")
    ours, reference = apply_rope(*args), apply_rope_reference(*args)
    assert ulps(ours, reference, _terms(args[0], case[2])) <= 2
    # The kept channels are copied, not rounded.
    kept = args[0].shape[-1] - case[2]
    assert torch.equal(ours[..., :kept], args[0][..., :kept])
