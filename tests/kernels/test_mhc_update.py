"""The one-launch mHC residual update and stream combination against the model's torch code."""

from __future__ import annotations

import pytest
import torch

from kernels.mhc_combine import mhc_combine, mhc_combine_reference
from kernels.mhc_post import mhc_post, mhc_post_reference
from tests.kernels.interpreted import run_interpreted, ulps

# (tokens, streams, width, dtype name): widths that are and are not multiples of the tile.
CASES = [
    (5, 4, 640, "float32"),
    (3, 4, 1000, "float32"),
    (4, 2, 128, "bfloat16"),
    (0, 4, 64, "float32"),
]


def _inputs(case, device: str = "cpu"):
    num_tokens, n, dim, dtype = case
    generator = torch.Generator().manual_seed(dim + n)
    residual = torch.randn(num_tokens, n, dim, generator=generator).to(getattr(torch, dtype))
    y = torch.randn(num_tokens, dim, generator=generator).to(residual.dtype)
    post = torch.rand(num_tokens, n, generator=generator)
    comb = torch.rand(num_tokens, n, n, generator=generator)
    weights = torch.rand(num_tokens, n, generator=generator)
    return [t.to(device) for t in (residual, post, comb, y, weights)]


def _post_terms(residual, post, comb, y):
    """Σ |term| of each output element of mhc_post."""
    update = post.abs()[..., None] * y.abs().float()[:, None, :]
    return update + (comb.abs()[..., None] * residual.abs().float()[:, :, None, :]).sum(1)


def _combine_terms(residual, weights):
    return (weights.abs()[..., None] * residual.abs().float()).sum(1)


_INTERPRETED = """
import json
from kernels.mhc_combine import mhc_combine, mhc_combine_reference
from kernels.mhc_post import mhc_post, mhc_post_reference
from tests.kernels.interpreted import ulps
from tests.kernels.test_mhc_update import CASES, _inputs
result = []
for case in CASES:
    residual, post, comb, y, weights = _inputs(case)
    result.append([
        ulps(mhc_post(residual, post, comb, y), mhc_post_reference(residual, post, comb, y)),
        ulps(mhc_combine(residual, weights), mhc_combine_reference(residual, weights)),
    ])
print(json.dumps(result))
"""


def test_kernels_match_reference_in_the_triton_interpreter() -> None:
    # At most one rounding step apart (fp32 sums of N terms in another order, then the cast).
    assert max(max(pair) for pair in run_interpreted(_INTERPRETED)) <= 2.0


def test_launchers_reject_what_the_kernels_cannot_take() -> None:
    residual, post, comb, y, weights = _inputs(CASES[0])
    with pytest.raises(ValueError, match="power of two"):
        mhc_post(residual[:, :3], post[:, :3], comb[:, :3, :3], y)
    with pytest.raises(ValueError, match="fp32"):
        mhc_post(residual, post.double(), comb, y)
    with pytest.raises(ValueError, match="CUDA"):
        mhc_post(residual, post, comb, y)
    with pytest.raises(ValueError, match="weights"):
        mhc_combine(residual, weights[:, :2])
    with pytest.raises(ValueError, match="CUDA"):
        mhc_combine(residual, weights)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_reference_on_cuda(case) -> None:
    residual, post, comb, y, weights = _inputs(case, "cuda")
    post_args = (residual, post, comb, y)
    # The CUDA build fuses multiply-adds: one rounding apart at the scale of the summed terms.
    post_error = ulps(mhc_post(*post_args), mhc_post_reference(*post_args), _post_terms(*post_args))
    assert post_error <= 2
    combined = mhc_combine(residual, weights)
    reference = mhc_combine_reference(residual, weights)
    assert ulps(combined, reference, _combine_terms(residual, weights)) <= 2


# (tokens, streams, width, dtype name) of the fused combination + RMSNorm: the real hidden size.
NORM_CASES = [(3, 4, 5120, "bfloat16"), (5, 4, 640, "float32"), (2, 2, 1000, "bfloat16")]
NORM_CASES += [(0, 4, 64, "bfloat16")]
EPS = 1e-20


def _norm_inputs(case, device: str = "cpu"):
    residual, _, _, _, weights = _inputs(case, device)
    generator = torch.Generator().manual_seed(case[2])
    norm_weight = torch.randn(case[2], generator=generator).to(residual.dtype).to(device)
    return residual, weights, norm_weight


_INTERPRETED_NORM = """
import json, torch
from kernels.mhc_combine import mhc_combine, mhc_combine_norm, mhc_combine_norm_reference
from kernels.rms_norm import rms_norm
from tests.kernels.interpreted import ulps
from tests.kernels.test_mhc_update import EPS, NORM_CASES, _norm_inputs
result = []
for case in NORM_CASES:
    residual, weights, norm_weight = _norm_inputs(case)
    fused = mhc_combine_norm(residual, weights, norm_weight, EPS)
    two = rms_norm(mhc_combine(residual, weights), norm_weight, EPS)
    reference = mhc_combine_norm_reference(residual, weights, norm_weight, EPS)
    result.append([bool(torch.equal(fused, two)), ulps(fused, reference)])
print(json.dumps(result))
"""


def test_combination_and_norm_in_one_launch_equal_the_two_kernels_in_the_interpreter() -> None:
    result = run_interpreted(_INTERPRETED_NORM)
    assert all(equal for equal, _ in result)
    # and the torch references within rms_norm's own bound (its sum in another order)
    assert max(gap for _, gap in result) <= 16


def test_combination_and_norm_launcher_rejects_a_wrong_norm_weight() -> None:
    from kernels.mhc_combine import mhc_combine_norm

    residual, weights, norm_weight = _norm_inputs(NORM_CASES[1])
    with pytest.raises(ValueError, match="norm weight"):
        mhc_combine_norm(residual, weights, norm_weight[:10], EPS)
    with pytest.raises(ValueError, match="CUDA"):
        mhc_combine_norm(residual, weights, norm_weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", NORM_CASES)
def test_combination_and_norm_in_one_launch_equal_the_two_kernels_on_cuda(case) -> None:
    from kernels.mhc_combine import mhc_combine_norm
    from kernels.rms_norm import rms_norm

    residual, weights, norm_weight = _norm_inputs(case, "cuda")
    fused = mhc_combine_norm(residual, weights, norm_weight, EPS)
    assert torch.equal(fused, rms_norm(mhc_combine(residual, weights), norm_weight, EPS))
