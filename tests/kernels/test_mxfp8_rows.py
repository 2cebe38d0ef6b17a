"""The one-launch MXFP8 window-row quantizer against the model's torch codec, bit for bit
(interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.kv_formats import swa_mxfp8_quantize
from kernels.mxfp8_rows import mxfp8_rows_quantize
from tests.kernels.codec_rows import ROW_COUNTS, SWA_DIMS, rows, same_bits, swa_edges
from tests.kernels.interpreted import run_interpreted

# (dim, rows, nemo_floor, dtype name)
CASES = [
    (dim, num_rows, nemo, dtype)
    for dim in SWA_DIMS
    for num_rows in ROW_COUNTS
    for nemo in (False, True)
    for dtype in ("float32", "bfloat16")
]


def _inputs(case, device: str = "cpu") -> tuple[torch.Tensor, bool]:
    dim, num_rows, nemo, dtype = case
    seed = dim * 1000 + num_rows
    edges = swa_edges(torch.Generator().manual_seed(seed))
    x = rows(edges, num_rows, dim, seed, (-40, 40)).to(getattr(torch, dtype))
    return x.to(device), nemo


def mismatches(device: str = "cpu") -> list[str]:
    """The cases where the kernel's bytes differ from `swa_mxfp8_quantize`'s."""
    out = []
    for case in CASES:
        x, nemo = _inputs(case, device)
        if not same_bits(
            mxfp8_rows_quantize(x, nemo_floor=nemo), swa_mxfp8_quantize(x, nemo_floor=nemo)
        ):
            out.append(str(case))
    # Leading dimensions and a row stride other than the width.
    x = _inputs(CASES[-1], device)[0][:12].reshape(3, 4, -1)[:, ::2]
    for nemo in (False, True):
        if not same_bits(
            mxfp8_rows_quantize(x, nemo_floor=nemo), swa_mxfp8_quantize(x, nemo_floor=nemo)
        ):
            out.append(f"strided [3, 2, D] nemo={nemo}")
    return out


_INTERPRETED = """
import json
from tests.kernels.test_mxfp8_rows import mismatches
print(json.dumps(mismatches()))
"""


def test_kernel_matches_the_codec_bit_for_bit_in_the_triton_interpreter() -> None:
    assert run_interpreted(_INTERPRETED) == []


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_rows_quantize(torch.zeros(2, 48))
    with pytest.raises(TypeError, match="floating"):
        mxfp8_rows_quantize(torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="CUDA"):
        mxfp8_rows_quantize(torch.zeros(2, 64))


@pytest.mark.gpu
def test_kernel_matches_the_codec_bit_for_bit_on_cuda() -> None:
    assert mismatches("cuda") == []


def test_kernel_compiles_for_hopper_with_ieee_arithmetic() -> None:
    # what the interpreter cannot show: the sm90 build keeps IEEE division (div_rn) and does
    # not flush subnormals, and the [8, 512] tile stays in registers
    from kernels.mxfp8_rows import _mxfp8_quantize_kernel
    from tests.kernels.interpreted import compile_for_hopper

    pointers = {"x_ptr": "*i16", "out_ptr": "*u8"}
    for nemo in (False, True):
        ptx = compile_for_hopper(
            _mxfp8_quantize_kernel,
            {**pointers, "num_rows": "i32", "x_row_stride": "i32"},
            {"DIM": 512, "BLOCK_D": 512, "BLOCK_R": 8, "NEMO_FLOOR": nemo, "FLOOR": 1e-4}
            | {"BF16_BITS": True},
            {*pointers, "x_row_stride"},
        )
        assert "div.rn.f32" in ptx and ".ftz" not in ptx and ".local" not in ptx
