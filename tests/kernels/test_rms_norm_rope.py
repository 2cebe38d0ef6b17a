"""RMSNorm then RoPE in one launch against the two kernels and the torch references; and the
same with the rotated row encoded as an MXFP8 window row against the three launches."""

from __future__ import annotations

import pytest
import torch
import triton

from engine.models.deepseek_v41.primitives import rope_frequencies
from kernels.rms_norm_rope import rms_norm_rope, rms_norm_rope_mxfp8
from tests.kernels.interpreted import run_interpreted, sum_of_squares_ops, ulps

# (x shape, rotated channels, dtype name): the released window / latent row (512, 64 rotated),
# the index key (128), a width that is no power of two, leading dims with the whole row
# rotated, a row of zeros (eps keeps it finite), no rows.
CASES = [
    ((5, 512), 64, "bfloat16"),
    ((3, 128), 64, "float32"),
    ((4, 96), 32, "bfloat16"),
    ((2, 3, 64), 64, "bfloat16"),
    ((2, 64), 32, "float32"),
    ((0, 64), 32, "bfloat16"),
]
EPS = 1e-20


def _inputs(case, device: str = "cpu"):
    shape, rot, dtype = case
    generator = torch.Generator().manual_seed(sum(shape) + rot)
    x = (torch.randn(shape, generator=generator) * 3).to(getattr(torch, dtype))
    if shape == (2, 64):
        x[0] = 0
    weight = torch.randn(shape[-1], generator=generator).to(x.dtype)
    positions = torch.randint(0, 200_000, shape[:-1], generator=generator)
    freqs = rope_frequencies(rot, 10000.0, None)
    return x.to(device), weight.to(device), positions.to(device), freqs.to(device)


def mismatches(device: str = "cpu") -> list[list[int]]:
    """Per case: elements of (rotated, normed) that differ from `apply_rope(rms_norm(x))` and
    `rms_norm(x)` of the two kernels (what the fused one replaces); then of the rotated rows
    read as a column slice of wider rows (the attention's packed projection) against them."""
    from kernels.rms_norm import rms_norm
    from kernels.rope import apply_rope

    result = []
    for case in CASES:
        x, weight, positions, freqs = _inputs(case, device)
        rotated, normed = rms_norm_rope(x, weight, EPS, positions, freqs, keep_normed=True)
        two = rms_norm(x, weight, EPS)
        view = torch.cat((torch.full_like(x[..., :16], 7.0), x), -1)[..., 16:]
        pairs = (
            (rotated, apply_rope(two, positions, freqs)),
            (normed, two),
            (rms_norm_rope(view, weight, EPS, positions, freqs)[0], rotated),
        )
        result.append([int((a.view(-1) != b.view(-1)).sum()) for a, b in pairs])
        assert rms_norm_rope(x, weight, EPS, positions, freqs)[1] is None
    return result


def reference_ulps(device: str = "cpu") -> list[float]:
    """Per case: the fused kernel's distance to the torch references, in ulps of the output
    (the norm's reduction order and cos/sin differ there)."""
    from kernels.rms_norm_rope import rms_norm_rope_reference

    result = []
    for case in CASES:
        args = _inputs(case, device)
        ours = rms_norm_rope(*args[:2], EPS, *args[2:])[0]
        reference = rms_norm_rope_reference(*args[:2], EPS, *args[2:])[0]
        # |a| + |b| of the pair as each rotated channel's scale (a sum of two products)
        terms = reference.float().abs().unflatten(-1, (-1, 2)).sum(-1).repeat_interleave(2, -1)
        result.append(ulps(ours, reference, terms))
    return result


def mxfp8_mismatches(device: str = "cpu") -> list[str]:
    """Cases where `rms_norm_rope_mxfp8`'s bytes differ from `mxfp8_rows_quantize` of
    `rms_norm_rope` (the two launches it replaces), from the torch codec of the same rotated
    rows, or from its own bytes of the rows read as a column slice of wider rows; with the
    weight scaled up and down (scales from 2^3 to the floor), both floor rules."""
    from engine.models.deepseek_v41.kv_formats import swa_mxfp8_quantize
    from kernels.mxfp8_rows import mxfp8_rows_quantize

    bad = []
    for case in CASES:
        x, weight, positions, freqs = _inputs(case, device)
        view = torch.cat((torch.full_like(x[..., :16], 7.0), x), -1)[..., 16:]
        for gain in (1.0, 1e3, 1e-6):
            w = (weight.float() * gain).to(weight.dtype)
            rotated = rms_norm_rope(x, w, EPS, positions, freqs)[0]
            for nemo in (False, True):
                ours = rms_norm_rope_mxfp8(x, w, EPS, positions, freqs, nemo_floor=nemo)
                others = {
                    "two launches": mxfp8_rows_quantize(rotated, nemo_floor=nemo),
                    "torch codec": swa_mxfp8_quantize(rotated, nemo_floor=nemo),
                    "strided rows": rms_norm_rope_mxfp8(
                        view, w, EPS, positions, freqs, nemo_floor=nemo
                    ),
                }
                bad += [
                    f"{case} gain {gain} nemo {nemo}: {name}"
                    for name, other in others.items()
                    if not torch.equal(ours, other)
                ]
            bad += [
                f"{case} gain {gain}: {why}" for why in _copy_mismatches(x, w, positions, freqs)
            ]
    return bad


def _copy_mismatches(x, weight, positions, freqs) -> list[str]:
    """`copy_to`: the encoded rows also land at their ring rows, nothing else moves."""
    plain = rms_norm_rope_mxfp8(x, weight, EPS, positions, freqs)
    rows = plain.reshape(-1, plain.shape[-1])
    ring = torch.full((2 * rows.shape[0] + 3, rows.shape[1]), 0x5A, dtype=torch.uint8)
    ring = ring.to(x.device)
    index = torch.randperm(ring.shape[0], generator=torch.Generator().manual_seed(1))
    index = index[: rows.shape[0]].to(x.device)
    before = ring.clone()
    ours = rms_norm_rope_mxfp8(x, weight, EPS, positions, freqs, copy_to=(ring, index))
    untouched = torch.ones(ring.shape[0], dtype=torch.bool, device=x.device)
    untouched[index] = False
    checks = {
        "copy: its own output": torch.equal(ours, plain),
        "copy: the ring rows": torch.equal(ring[index], rows),
        "copy: the other rows": torch.equal(ring[untouched], before[untouched]),
    }
    return [name for name, ok in checks.items() if not ok]


_INTERPRETED = """
import json
from tests.kernels.test_rms_norm_rope import mismatches, reference_ulps
print(json.dumps([mismatches(), reference_ulps()]))
"""


def test_kernel_equals_norm_then_rope_in_the_triton_interpreter() -> None:
    exact, gaps = run_interpreted(_INTERPRETED)
    assert exact == [[0, 0, 0]] * len(CASES)
    # the norm's sum in another order and numpy's cos/sin: a few ulps of the references
    assert max(gaps) <= 16


@pytest.mark.slow  # ~8 s in the interpreter
def test_mxfp8_rows_equal_norm_rope_then_quantize_in_the_triton_interpreter() -> None:
    code = (
        "import json\nfrom tests.kernels.test_rms_norm_rope import mxfp8_mismatches\n"
        "print(json.dumps(mxfp8_mismatches()))"
    )
    assert run_interpreted(code) == []


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, weight, positions, freqs = _inputs(CASES[0])
    with pytest.raises(ValueError, match="leading shape"):
        rms_norm_rope(x, weight, EPS, positions[:-1], freqs)
    with pytest.raises(ValueError, match="leading shape"):
        rms_norm_rope(x, weight[:-2], EPS, positions, freqs)
    with pytest.raises(ValueError, match="rotated channels"):
        rms_norm_rope(x[..., :32], weight[:32], EPS, positions, freqs)
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm_rope(x, weight, EPS, positions, freqs)
    with pytest.raises(ValueError, match="blocks of 32"):
        rms_norm_rope_mxfp8(x[..., :80], weight[:80], EPS, positions, freqs)
    with pytest.raises(ValueError, match="blocks of 32"):
        rms_norm_rope_mxfp8(x.double(), weight.double(), EPS, positions, freqs)
    ring = torch.zeros(64, x.shape[-1] + x.shape[-1] // 32, dtype=torch.uint8)
    index = torch.arange(positions.numel())
    with pytest.raises(ValueError, match="copy_to"):
        rms_norm_rope_mxfp8(x, weight, EPS, positions, freqs, copy_to=(ring[:, :-1], index))
    with pytest.raises(ValueError, match="copy_to"):
        rms_norm_rope_mxfp8(x, weight, EPS, positions, freqs, copy_to=(ring, index[:-1]))


def _compiled_rms_norm_rope(width: int, mxfp8: bool, aligned: set[str]) -> str:
    """sm90 PTX of the norm + RoPE kernel on bf16 rows (keeping the normed rows), or with
    `mxfp8` encoding them instead."""
    from kernels.rms_norm import norm_warps
    from kernels.rms_norm_rope import _rms_norm_rope_kernel
    from tests.kernels.interpreted import compile_for_hopper

    block = triton.next_power_of_2(width)
    out = "*u8" if mxfp8 else "*bf16"
    options = {"BLOCK": block, "KEEP_NORMED": not mxfp8, "LIBDEVICE": True}
    if mxfp8:
        options |= {"MXFP8": True, "ROW_DTYPE": triton.language.bfloat16, "FLOOR": 1e-4}
    return compile_for_hopper(
        _rms_norm_rope_kernel,
        {"x_ptr": "*bf16", "weight_ptr": "*bf16", "position_ptr": "*i64", "freq_ptr": "*fp32"}
        | {"out_ptr": out, "normed_ptr": out, "pass_pairs": "i32"}
        | {"copy_ptr": out, "copy_row_ptr": "*i64"}
        | {"width": "i32", "x_row_stride": "i32", "eps": "fp32"},
        options,
        aligned,
        {"num_warps": norm_warps(block)},
    )


@pytest.mark.parametrize("mxfp8", [False, True], ids=["rows", "mxfp8"])
@pytest.mark.parametrize("width", [512, 128, 96])
def test_compiled_kernel_sums_squares_as_rms_norm_does(width: int, mxfp8: bool) -> None:
    # What the interpreter cannot show: the CUDA build reduces the row as rms_norm's does (the
    # same [BLOCK] row and num_warps; `inv_rms`'s NOTE), so the scale has the same bits; the
    # MXFP8 encoding keeps IEEE division and adds no flushing (ftz) operation.
    from kernels.rms_norm import _rms_norm_kernel, norm_warps
    from tests.kernels.interpreted import compile_for_hopper

    block = triton.next_power_of_2(width)
    warps = {"num_warps": norm_warps(block)}
    scalars = {"width": "i32", "x_row_stride": "i32", "eps": "fp32"}
    aligned = {"x_ptr", "weight_ptr", "out_ptr", "normed_ptr", "position_ptr", "freq_ptr"}
    aligned |= {"codes_ptr", "scale_ptr"}
    aligned |= {"width", "x_row_stride"} if width % 16 == 0 else set()
    fused = _compiled_rms_norm_rope(width, mxfp8, aligned)
    if mxfp8:
        rows = _compiled_rms_norm_rope(width, False, aligned)
        assert "div.rn.f32" in fused and fused.count(".ftz") == rows.count(".ftz")
    two = compile_for_hopper(
        _rms_norm_kernel,
        {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "codes_ptr": "*fp32"}
        | {"scale_ptr": "*fp32"}
        | scalars,
        {"HAS_WEIGHT": True, "EMIT_FP8": False, "BLOCK": block, "GROUP": 1},
        aligned,
        warps,
    )
    per_thread = max(1, block // (32 * warps["num_warps"]))
    assert sum_of_squares_ops(fused, per_thread) == sum_of_squares_ops(two, per_thread)


@pytest.mark.gpu
def test_kernel_equals_norm_then_rope_on_cuda() -> None:
    assert mismatches("cuda") == [[0, 0, 0]] * len(CASES)
    assert max(reference_ulps("cuda")) <= 16
    assert mxfp8_mismatches("cuda") == []
