"""The mHC triplet's launches against its torch reference (BLAS matmul, torch mean), and its
one launch against its two (bit for bit).

The kernel sums the [T, N·D] × [N·D, 2N + N²] product in another order than BLAS, so its
outputs are compared by relative norm and by ulps (fp32, of the reference's pre, post and
comb). Measured in the interpreter: ≤ 1e-6 relative, ≤ 55 ulps, and closer to a float64
evaluation than the fp32 reference itself at every shape below.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from kernels.mhc_mix import mhc_mix_reference
from kernels.mhc_triplet import CONFIGS, TripletConfig, mhc_triplet, mhc_triplet_reference
from tests.kernels.interpreted import compile_for_hopper, run_interpreted, ulps

NORM_EPS, HC_EPS, ITERS = 1e-20, 1e-6, 20
REL_NORM, MAX_ULPS = 5e-6, 256
# (tokens, D) with N = 4: the tiny (64), default (256) and released (5120) widths
INTERPRETED_CASES = [(0, 64), (1, 5120), (3, 5120), (64, 256), (300, 64), (3, 64), (1, 256)]
GPU_CASES = list(itertools.product((1, 3, 64, 300), (64, 256, 5120)))
# the fused-rounding case: fused and unfused logits give outputs this many ulps apart or more
SENSITIVE_ULPS = 200


def triplet_inputs(num_tokens: int, d: int, seed: int, device: str = "cpu"):
    """residual (bf16 for even seeds, fp32 for odd), fn, base, scale at the model's scales."""
    g = torch.Generator().manual_seed(seed)
    n = 4
    dtype = torch.bfloat16 if seed % 2 == 0 else torch.float32
    residual = torch.randn(num_tokens, n, d, generator=g).to(dtype)
    fn = torch.randn(2 * n + n * n, n * d, generator=g) * (2 / (n * d) ** 0.5)
    base = torch.randn(2 * n + n * n, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    return [t.to(device) for t in (residual, fn, base, scale)]


def triplet_errors(
    cases: list[tuple[int, int]], device: str = "cpu", config=None
) -> list[list[list[float]]]:
    """Per case, per output (pre, post, comb): [relative norm, ulps] against the reference
    (config: the launcher's, default its table's row for T)."""
    errors = []
    for seed, (num_tokens, d) in enumerate(cases):
        inputs = triplet_inputs(num_tokens, d, seed, device)
        ours = mhc_triplet(*inputs, NORM_EPS, HC_EPS, ITERS, config=config)
        reference = mhc_triplet_reference(*inputs, NORM_EPS, HC_EPS, ITERS)
        row = []
        for got, expected in zip(ours, reference, strict=True):
            assert got.shape == expected.shape and got.dtype == torch.float32
            norm = float(expected.norm())
            rel = float((got - expected).norm()) / norm if expected.numel() else 0.0
            row.append([rel, ulps(got.cpu(), expected.cpu())])
        errors.append(row)
    return errors


def fused_rounding_errors(device: str = "cpu") -> dict[str, float]:
    """The kernel against the outputs of fused and of unfused `mix · scale + base` logits.

    z = ±1 rows make every sum exact (mean(z²) = 1, rsqrt 1, dots of multiples of 2⁻⁸), and
    base ≈ −mix · scale cancels: the logits are O(1) while the product is ~10⁴, so the product's
    own rounding (unfused) moves them by ~5e-4, thousands of ulps of the outputs.
    """
    g = torch.Generator().manual_seed(7)
    n, d, num_tokens = 4, 64, 3
    mix_width = 2 * n + n * n
    row = torch.randint(0, 2, (n * d,), generator=g).float() * 2 - 1
    residual = row.expand(num_tokens, -1).reshape(num_tokens, n, d).contiguous()
    fn = torch.randint(-32, 33, (mix_width, n * d), generator=g).float() / 256
    dots = (fn.double() @ row.double()).float()  # exact
    scale = torch.rand(3, generator=g) * 2000 + 2000
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    product = dots.double() * scales.double()  # exact in float64
    offsets = torch.rand(mix_width, generator=g).double() * 4 - 2
    base = (offsets - product).float()
    fused = (product + base.double()).float()  # fp32 fma: exact sum (Sterbenz), one rounding
    unfused = (dots * scales) + base
    expected = mhc_mix_reference(fused.expand(num_tokens, -1), n, HC_EPS, ITERS)
    wrong = mhc_mix_reference(unfused.expand(num_tokens, -1), n, HC_EPS, ITERS)
    inputs = [t.to(device) for t in (residual, fn, base, scale)]
    ours = [t.cpu() for t in mhc_triplet(*inputs, NORM_EPS, HC_EPS, ITERS)]
    return {
        "fused": max(ulps(a, b) for a, b in zip(ours, expected, strict=True)),
        "unfused": max(ulps(a, b) for a, b in zip(ours, wrong, strict=True)),
        "sensitivity": max(ulps(a, b) for a, b in zip(wrong, expected, strict=True)),
    }


def _check(errors: list[list[list[float]]], cases: list[tuple[int, int]]) -> None:
    assert len(errors) == len(cases)
    for case, row in zip(cases, errors, strict=True):
        for name, (rel, ulp) in zip(("pre", "post", "comb"), row, strict=True):
            assert rel < REL_NORM and ulp < MAX_ULPS, (case, name, rel, ulp)


def _check_fused(result: dict[str, float]) -> None:
    assert result["sensitivity"] > SENSITIVE_ULPS, result  # the case tells the two apart
    assert result["fused"] < 16, result
    assert result["unfused"] > SENSITIVE_ULPS / 2, result


_INTERPRETED = """
import json
from tests.kernels.test_mhc_triplet import INTERPRETED_CASES, fused_rounding_errors, triplet_errors
print(json.dumps([triplet_errors(INTERPRETED_CASES), fused_rounding_errors()]))
"""


@pytest.mark.slow  # ~8 s in the interpreter
def test_kernel_matches_reference_in_the_triton_interpreter() -> None:
    errors, fused = run_interpreted(_INTERPRETED)
    _check(errors, INTERPRETED_CASES)
    _check_fused(fused)


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    residual, fn, base, scale = triplet_inputs(3, 8, 1)
    with pytest.raises(ValueError, match="fn, base, scale"):
        mhc_triplet(residual, fn[:, :-1], base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="power of two"):
        mhc_triplet(
            torch.zeros(3, 3, 8), torch.zeros(15, 24), torch.zeros(15), scale, 1e-20, 1e-6, 20
        )
    with pytest.raises(ValueError, match="residual"):
        mhc_triplet(residual[0], fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="CUDA"):
        mhc_triplet(residual, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="precision"):
        TripletConfig("fp16", 16, 512)
    with pytest.raises(ValueError, match="split_cols"):
        TripletConfig("bf16x6", 16, 100)
    with pytest.raises(ValueError, match="split_cols must be a multiple of 256"):
        TripletConfig("bf16x6", 16, 384, chunks=4)
    with pytest.raises(ValueError, match="chunks"):
        TripletConfig("bf16x6", 16, 384, chunks=3)


@pytest.mark.parametrize(
    ("one_token", "precision", "block_t", "one_launch"),
    [
        (False, "bf16x6", 64, True),
        (True, "bf16x6", 16, True),
        (False, "bf16x6", 16, False),
        (False, "tf32x3", 64, False),
        (False, "ieee", 16, True),
    ],
)
def test_kernels_compile_for_hopper(
    one_token: bool, precision: str, block_t: int, one_launch: bool
) -> None:
    # A launch with T = 1 passes it as a constexpr, which the interpreter never does.
    from kernels.mhc_triplet import _mhc_finish_kernel, _mhc_partials_kernel

    count = {"num_tokens": 1} if one_token else {}
    count_type = {} if one_token else {"num_tokens": "i32"}
    pointers = ("base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr")
    types = {"x_ptr": "*fp32", "fn_ptr": "*fp32", "part_ptr": "*fp32", "width": "i32"}
    types |= {"counter_ptr": "*i32", **{name: "*fp32" for name in pointers}}
    types |= {"num_splits": "i32", "inv_width": "fp32", "norm_eps": "fp32", "hc_eps": "fp32"}
    constexprs = {"MIX": 24, "MIX_PAD": 32, "BLOCK_T": block_t, "BLOCK_K": 64, "SPLIT": 512}
    constexprs |= {"PRECISION": precision, "BF16_DOTS": True, "ONE_LAUNCH": one_launch}
    constexprs |= {"ITERS": 20, "N": 4, "FINISH_BLOCK_T": 16, "CHUNKS": 1 + one_token}
    ptx = compile_for_hopper(
        _mhc_partials_kernel,
        {**types, **count_type},
        {**constexprs, **count},
        {"x_ptr", "fn_ptr", "part_ptr", "width", "counter_ptr", *pointers},
    )
    if precision == "ieee":
        assert "fma.rn.f32" in ptx and "mma" not in ptx  # IEEE fp32 dots, no TF32
    else:  # tensor cores: wgmma for 64-token tiles, mma.sync for 16
        kind = {"bf16x6": "bf16.bf16", "tf32x3": "tf32.tf32"}[precision]
        assert re.search(rf"(wgmma\.mma_async|mma\.sync)\S*{kind}", ptx)
    # one launch: the count is an acquire-release atomic at GPU scope after a barrier, and the
    # last program reads the others' partials past L1
    atom = ptx.find("atom.global.gpu.acq_rel.add")
    assert (atom >= 0) == one_launch
    if one_launch:  # a barrier between the partials' last store and the count
        assert "bar.sync" in ptx[ptx.rindex("st.global", 0, atom) : atom]
    assert ("ld.global.cg" in ptx) == one_launch
    pointers = ("part_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr")
    types = {name: "*fp32" for name in pointers}
    types |= {"inv_width": "fp32", "norm_eps": "fp32", "hc_eps": "fp32", **count_type}
    splits = {"num_splits": 1} if one_token else {}
    types |= {} if one_token else {"num_splits": "i32"}
    constexprs = {"ITERS": 20, "N": 4, "MIX_PAD": 32, "BLOCK_T": 16}
    ptx = compile_for_hopper(
        _mhc_finish_kernel, types, {**constexprs, **count, **splits}, {"part_ptr"}
    )
    assert "fma.rn.f32" in ptx


def one_and_two_launches(cases, device: str = "cpu") -> list[list[bool]]:
    """Per (tokens, D, config) case: whether the one launch's pre, post and comb equal the two
    launches' bit for bit (twice: the counters must be back at zero for the second), and
    whether the counters are all zero after."""
    from kernels.tile_counters import tile_counters

    rows = []
    for seed, (num_tokens, d, config) in enumerate(cases):
        inputs = triplet_inputs(num_tokens, d, seed, device)
        two = mhc_triplet(*inputs, NORM_EPS, HC_EPS, ITERS, config=config, one_launch=False)
        row = []
        for _ in range(2):
            one = mhc_triplet(*inputs, NORM_EPS, HC_EPS, ITERS, config=config)
            row += [torch.equal(a, b) for a, b in zip(one, two, strict=True)]
        row.append(not tile_counters(torch.device(device), 1).any().item())
        rows.append(row)
    return rows


# several tiles of tokens and several splits each, a ragged last tile, a lone token
ONE_LAUNCH_CASES = [
    (40, 64, TripletConfig("bf16x6", 16, 64)),
    (70, 256, TripletConfig("bf16x6", 64, 128)),
    (1, 256, None),
    (33, 64, TripletConfig("ieee", 16, 128)),
]


def _interpreted_rows(cases: str, function: str) -> list:
    """`function(cases)` of this module, run in Triton's interpreter."""
    return run_interpreted(
        "import json\n"
        f"from tests.kernels.test_mhc_triplet import {cases}, {function}\n"
        f"print(json.dumps({function}({cases})))\n"
    )


@pytest.mark.slow  # ~4 s in the interpreter
def test_one_launch_equals_two_launches_in_the_triton_interpreter() -> None:
    rows = _interpreted_rows("ONE_LAUNCH_CASES", "one_and_two_launches")
    for case, row in zip(ONE_LAUNCH_CASES, rows, strict=True):
        assert all(row), (case, row)


def chunked_launches(cases, device: str = "cpu") -> list[list[bool]]:
    """Per (tokens, D, split, chunks) case: whether the launch with `chunks` BLOCK_K chunks per
    loop step gives pre, post and comb bit for bit equal to one chunk per step, the same split."""
    rows = []
    for seed, (num_tokens, d, split, chunks) in enumerate(cases):
        inputs = triplet_inputs(num_tokens, d, seed, device)
        one = mhc_triplet(
            *inputs, NORM_EPS, HC_EPS, ITERS, config=TripletConfig("bf16x6", 16, split)
        )
        config = TripletConfig("bf16x6", 16, split, chunks=chunks)
        several = mhc_triplet(*inputs, NORM_EPS, HC_EPS, ITERS, config=config)
        rows.append([torch.equal(a, b) for a, b in zip(several, one, strict=True)])
    return rows


# fp32 and bf16 rows; 20 and 80 splits (more than one step of the finish's sixteen), a split
# wider than the row (the launcher narrows it to whole steps)
CHUNKED_CASES = [(20, 320, 128, 2), (3, 5120, 256, 4), (17, 320, 128, 2), (2, 64, 512, 4)]


@pytest.mark.slow  # ~6 s in the interpreter
def test_chunks_per_step_give_the_same_bits_in_the_triton_interpreter() -> None:
    rows = _interpreted_rows("CHUNKED_CASES", "chunked_launches")
    for case, row in zip(CHUNKED_CASES, rows, strict=True):
        assert all(row), (case, row)


@pytest.mark.gpu
def test_chunks_per_step_give_the_same_bits_on_cuda() -> None:
    cases = CHUNKED_CASES + [(16, 5120, 512, 2), (64, 5120, 256, 4), (256, 5120, 1024, 2)]
    for case, row in zip(cases, chunked_launches(cases, "cuda"), strict=True):
        assert all(row), (case, row)


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda() -> None:
    _check(triplet_errors(GPU_CASES, "cuda"), GPU_CASES)


@pytest.mark.gpu
def test_one_launch_equals_two_launches_on_cuda() -> None:
    cases = ONE_LAUNCH_CASES + [(n, 4096, config) for n in (16, 256, 4096) for _, config in CONFIGS]
    for case, row in zip(cases, one_and_two_launches(cases, "cuda"), strict=True):
        assert all(row), (case, row)


@pytest.mark.gpu
def test_one_launch_replays_in_a_cuda_graph() -> None:
    # captured once, replayed on new inputs: each replay equals the two launches on them
    inputs = triplet_inputs(256, 4096, 0, "cuda")
    static = inputs[0].clone()
    mhc_triplet(static, *inputs[1:], NORM_EPS, HC_EPS, ITERS)  # warm-up: compile, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = mhc_triplet(static, *inputs[1:], NORM_EPS, HC_EPS, ITERS)
    for seed in (1, 2, 3):
        static.copy_(triplet_inputs(256, 4096, seed * 2, "cuda")[0])
        graph.replay()
        two = mhc_triplet(static, *inputs[1:], NORM_EPS, HC_EPS, ITERS, one_launch=False)
        assert all(torch.equal(a, b) for a, b in zip(outputs, two, strict=True)), seed


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [config for _, config in CONFIGS] + [TripletConfig("tf32x3", 64, 2048, 4)],
    ids=repr,
)
def test_every_configured_launch_shape_matches_reference_on_cuda(config) -> None:
    # every row of the launcher's table (and tf32x3) at a prefill-like T, fp32 and bf16 rows
    cases = [(300, 5120), (300, 5120), (5, 256)]
    _check(triplet_errors(cases, "cuda", config), cases)


@pytest.mark.gpu
def test_kernel_rounds_logits_with_one_fused_multiply_add_on_cuda() -> None:
    _check_fused(fused_rounding_errors("cuda"))
