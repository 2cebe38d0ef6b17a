"""The one-launch mHC residual update and stream combination against the model's torch code."""

from __future__ import annotations

import pytest
import torch
import triton

from kernels.mhc_combine import mhc_combine, mhc_combine_reference
from kernels.mhc_post import mhc_post, mhc_post_reference
from tests.kernels.interpreted import run_interpreted, sum_of_squares_ops, ulps

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
from tests.kernels.test_mhc_update import CASES, _combine_terms, _inputs, _post_terms
result = []
for case in CASES:
    residual, post, comb, y, weights = _inputs(case)
    combined, reference = mhc_combine(residual, weights), mhc_combine_reference(residual, weights)
    result.append([
        ulps(mhc_post(residual, post, comb, y), mhc_post_reference(residual, post, comb, y),
             _post_terms(residual, post, comb, y)),
        ulps(combined, reference, _combine_terms(residual, weights)),
    ])
print(json.dumps(result))
"""


def test_kernels_match_reference_in_the_triton_interpreter() -> None:
    # At most one rounding step apart at the scale of the summed terms: both kernels sum in
    # chains of fused multiply-adds (the reference rounds each product), then the cast.
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


# (tokens, streams, width, top_k, residual dtype, shared output dtype): the FFN site with the
# MoE's parts; the real layer's width and top-6, a width off the tile, no tokens; bf16 (the
# model dtype), fp32, and a bf16 shared output beside fp32 streams (y rounds to its own dtype).
SLOT_CASES = [(3, 4, 5120, 6, "bfloat16", "bfloat16"), (2, 4, 1000, 3, "float32", "float32")]
SLOT_CASES += [(2, 4, 640, 6, "float32", "bfloat16"), (0, 4, 64, 6, "bfloat16", "bfloat16")]


def _slot_inputs(case, device: str = "cpu"):
    num_tokens, n, dim, top_k, dtype, shared_dtype = case
    residual, post, comb, shared, _ = _inputs((num_tokens, n, dim, dtype), device)
    generator = torch.Generator().manual_seed(dim + top_k)
    slots = (torch.randn(num_tokens, top_k, dim, generator=generator) * 0.3).to(device)
    return residual, post, comb, shared.to(getattr(torch, shared_dtype)), slots


_INTERPRETED_SLOTS = """
import json
from kernels.moe_combine import moe_combine, moe_combine_reference
from kernels.mhc_post import mhc_post, mhc_post_reference
from tests.kernels.interpreted import same_bits, ulps
from tests.kernels.test_mhc_update import SLOT_CASES, _post_terms, _slot_inputs
result = []
for case in SLOT_CASES:
    residual, post, comb, shared, slots = _slot_inputs(case)
    fused = mhc_post(residual, post, comb, shared, slots)
    two_launches = mhc_post(residual, post, comb, moe_combine(shared, slots))
    reference = mhc_post_reference(residual, post, comb, shared, slots)
    terms = _post_terms(residual, post, comb, moe_combine_reference(shared, slots))
    without_slots = mhc_post(residual, post, comb, shared)
    result.append([same_bits(fused, two_launches), ulps(fused, reference, terms) <= 2,
                   fused.numel() == 0 or not same_bits(fused, without_slots)])
print(json.dumps(result))
"""


def test_update_of_the_moe_parts_equals_combine_then_update_in_the_interpreter() -> None:
    """The FFN's update that adds the MoE's shared output and routed slots itself gives the
    bits of `moe_combine` then `mhc_post` (the same adds in the same order, one rounding of y),
    is the torch form's within two rounding steps at the scale of the summed terms (as the
    plain update), and the slots do count."""
    assert run_interpreted(_INTERPRETED_SLOTS) == [[True, True, True]] * len(SLOT_CASES)


def test_update_launcher_rejects_slots_it_cannot_take() -> None:
    residual, post, comb, shared, slots = _slot_inputs(SLOT_CASES[1])
    with pytest.raises(ValueError, match="match"):
        mhc_post(residual, post, comb, shared, slots[:, :, :32])
    with pytest.raises(ValueError, match="float32"):
        mhc_post(residual, post, comb, shared, slots.bfloat16())
    with pytest.raises(ValueError, match="float32"):
        mhc_post(residual, post, comb, shared, slots[:, :0])


@pytest.mark.gpu
@pytest.mark.parametrize("case", SLOT_CASES, ids=str)
def test_update_of_the_moe_parts_equals_combine_then_update_on_cuda(case) -> None:
    from kernels.moe_combine import moe_combine

    residual, post, comb, shared, slots = _slot_inputs(case, "cuda")
    fused = mhc_post(residual, post, comb, shared, slots)
    two_launches = mhc_post(residual, post, comb, moe_combine(shared, slots))
    torch.testing.assert_close(fused, two_launches, rtol=0, atol=0)


# (tokens, streams, width, dtype name) of the fused combination + RMSNorm: the real hidden size.
NORM_CASES = [(3, 4, 5120, "bfloat16"), (5, 4, 640, "float32"), (2, 2, 1000, "bfloat16")]
NORM_CASES += [(0, 4, 64, "bfloat16")]
EPS = 1e-20


def _norm_inputs(case, device: str = "cpu"):
    residual, _, _, _, weights = _inputs(case, device)
    generator = torch.Generator().manual_seed(case[2])
    norm_weight = torch.randn(case[2], generator=generator).to(residual.dtype).to(device)
    return residual, weights, norm_weight


def _norm_terms(residual, weights, norm_weight):
    """The scale of each output of the combination + norm: Σ |term| of the combination times
    the row's rsqrt(mean square) and |norm weight|."""
    x = mhc_combine_reference(residual, weights).float()
    inv_rms = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return _combine_terms(residual, weights) * inv_rms * norm_weight.abs().float()


_INTERPRETED_NORM = """
import json, torch
from kernels.mhc_combine import mhc_combine, mhc_combine_norm, mhc_combine_norm_reference
from kernels.rms_norm import rms_norm
from tests.kernels.interpreted import ulps
from tests.kernels.test_mhc_update import EPS, NORM_CASES, _norm_inputs, _norm_terms
result = []
for case in NORM_CASES:
    residual, weights, norm_weight = _norm_inputs(case)
    fused = mhc_combine_norm(residual, weights, norm_weight, EPS)
    two = rms_norm(mhc_combine(residual, weights), norm_weight, EPS)
    reference = mhc_combine_norm_reference(residual, weights, norm_weight, EPS)
    terms = _norm_terms(residual, weights, norm_weight)
    result.append([bool(torch.equal(fused, two)), ulps(fused, reference, terms)])
print(json.dumps(result))
"""


def test_combination_and_norm_in_one_launch_equal_the_two_kernels_in_the_interpreter() -> None:
    result = run_interpreted(_INTERPRETED_NORM)
    assert all(equal for equal, _ in result)
    # and the torch references within rms_norm's own bound (its sum in another order), at the
    # scale of the combination's summed terms (a chain of fused multiply-adds, not torch's sum)
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


def _reduces_as_rms_norm(case, kernel, types: dict[str, str], constexprs: dict) -> bool:
    """Whether `kernel` (types: its tensors, `elem` for the row dtype's) compiled for sm90 sums
    a row's squares as `rms_norm`'s kernel does: no plain multiply, as many elements per
    thread, as many adds and shuffles."""
    from kernels.rms_norm import _rms_norm_kernel
    from tests.kernels.interpreted import compile_for_hopper

    _, _, dim, dtype = case
    block = triton.next_power_of_2(dim)
    warps = {"num_warps": min(16, max(1, block // 512))}
    elem = {"float32": "*fp32", "bfloat16": "*bf16"}[dtype]
    types = {name: elem if kind == "elem" else kind for name, kind in types.items()}
    scalars = {"dim": "i32", "width": "i32", "x_row_stride": "i32", "eps": "fp32"}
    aligned = set(types) | {"x_ptr", "weight_ptr", "out_ptr", "codes_ptr", "scale_ptr"}
    aligned |= {"dim", "width", "x_row_stride"} if dim % 16 == 0 else set()
    fused = compile_for_hopper(
        kernel, types | scalars, constexprs | {"BLOCK": block}, aligned, warps
    )
    two = compile_for_hopper(
        _rms_norm_kernel,
        {"x_ptr": elem, "weight_ptr": elem, "out_ptr": elem, "codes_ptr": "*fp32"}
        | {"scale_ptr": "*fp32"}
        | scalars,
        {"HAS_WEIGHT": True, "EMIT_FP8": False, "BLOCK": block, "GROUP": 1},
        aligned,
        warps,
    )
    per_thread = block // (32 * warps["num_warps"])
    return sum_of_squares_ops(fused, per_thread) == sum_of_squares_ops(two, per_thread)


@pytest.mark.parametrize("case", NORM_CASES[:3])
def test_combination_and_norm_sum_squares_as_rms_norm_does_when_compiled(case) -> None:
    # The CUDA build contracts multiplies into adds per program (why the fused kernel once
    # differed from the two on the H200): the sum of squares must hold no plain multiply, cover
    # as many elements per thread and lower to as many adds and shuffles as rms_norm's.
    from kernels.mhc_combine import _mhc_combine_norm_kernel

    types = {"residual_ptr": "elem", "weights_ptr": "*fp32", "norm_ptr": "elem", "out_ptr": "elem"}
    assert _reduces_as_rms_norm(case, _mhc_combine_norm_kernel, types, {"N": case[1]})


def post_and_norm_in_one_launch(cases, device: str = "cpu") -> list[list[bool]]:
    """Per (tokens, streams, width, dtype) case: whether `mhc_post_combine_norm`'s R' and
    normed input equal `mhc_post`'s and then `mhc_combine_norm`'s, bit for bit; for widths of
    whole 128s also with `kernel_order`, whether its third output is the grouped GEMM's own
    reordering of the second (`_in_kernel_order`)."""
    from kernels.grouped_mxfp4_gemm import _in_kernel_order
    from kernels.mhc_combine import mhc_combine_norm
    from kernels.mhc_post import mhc_post_combine_norm

    rows = []
    for case in cases:
        residual, post, comb, y, weights = _inputs(case, device)
        norm_weight = _norm_inputs(case, device)[2]
        args = (residual, post, comb, y, weights, norm_weight, EPS)
        updated, x, none = mhc_post_combine_norm(*args)
        two = mhc_post(residual, post, comb, y)
        expected = mhc_combine_norm(two, weights, norm_weight, EPS)
        row = [torch.equal(updated, two), torch.equal(x, expected), none is None]
        if case[2] % 128 == 0:
            updated, x, ordered = mhc_post_combine_norm(*args, kernel_order=True)
            row += [torch.equal(updated, two), torch.equal(x, expected)]
            row.append(torch.equal(ordered, _in_kernel_order(expected)))
        rows.append(row)
    return rows


@pytest.mark.slow  # ~3 s in the interpreter
def test_update_and_norm_in_one_launch_equal_the_two_kernels_in_the_interpreter() -> None:
    code = (
        "import json\n"
        "from tests.kernels.test_mhc_update import NORM_CASES, post_and_norm_in_one_launch\n"
        "print(json.dumps(post_and_norm_in_one_launch(NORM_CASES)))\n"
    )
    for case, row in zip(NORM_CASES, run_interpreted(code), strict=True):
        assert all(row), (case, row)


def test_update_and_norm_launcher_rejects_what_it_cannot_take() -> None:
    from kernels.mhc_post import mhc_post_combine_norm

    residual, post, comb, y, weights = _inputs(NORM_CASES[1])
    norm_weight = _norm_inputs(NORM_CASES[1])[2]
    with pytest.raises(ValueError, match="norm weight"):
        mhc_post_combine_norm(residual, post, comb, y, weights, norm_weight[:10], EPS)
    with pytest.raises(ValueError, match="weights"):
        mhc_post_combine_norm(residual, post, comb, y, weights[:, :2], norm_weight, EPS)
    residual, post, comb, y, weights = _inputs(NORM_CASES[2])  # D = 1000
    norm_weight = _norm_inputs(NORM_CASES[2])[2]
    with pytest.raises(ValueError, match="per 128 columns"):
        mhc_post_combine_norm(residual, post, comb, y, weights, norm_weight, EPS, True)
    with pytest.raises(ValueError, match="CUDA"):
        mhc_post_combine_norm(residual, post, comb, y, weights, norm_weight, EPS)


@pytest.mark.gpu
def test_update_and_norm_in_one_launch_equal_the_two_kernels_on_cuda() -> None:
    cases = NORM_CASES + [(256, 4, 4096, "bfloat16"), (7, 4, 7168, "bfloat16")]
    for case, row in zip(cases, post_and_norm_in_one_launch(cases, "cuda"), strict=True):
        assert all(row), (case, row)


@pytest.mark.parametrize("case", NORM_CASES[:3])
def test_update_and_norm_sum_squares_as_rms_norm_does_when_compiled(case) -> None:
    # as the combination + norm kernel's test above: the same reduction as rms_norm's
    from kernels.mhc_post import _mhc_post_combine_norm_kernel

    types = {"residual_ptr": "elem", "post_ptr": "*fp32", "comb_ptr": "*fp32", "y_ptr": "elem"}
    types |= {"out_ptr": "elem", "weights_ptr": "*fp32", "norm_ptr": "elem", "x_ptr": "elem"}
    types |= {"x_kernel_order_ptr": "elem"}
    constexprs = {"N": case[1], "KERNEL_ORDER": case[2] % 128 == 0}
    assert _reduces_as_rms_norm(case, _mhc_post_combine_norm_kernel, types, constexprs)
