"""The one-launch FP4 row kernels (index quantize / round trip / dequantize, global quantize)
against the model's torch codec, bit for bit (interpreter and CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41 import kv_formats
from kernels.fp4_rows import (
    global_fp4_rows_quantize,
    index_fp4_rows_dequantize,
    index_fp4_rows_quantize,
    index_fp4_rows_round_trip,
)
from tests.kernels.codec_rows import (
    GLOBAL_DIMS,
    INDEX_DIMS,
    ROW_COUNTS,
    global_edges,
    index_edges,
    rows,
    same_bits,
)
from tests.kernels.interpreted import run_interpreted

DTYPES = ("float32", "bfloat16")
INDEX_CASES = [(d, n, t) for d in INDEX_DIMS for n in ROW_COUNTS for t in DTYPES]
# (dim, rows, clamp_scale, dtype name); NeMo's unclamped scale raises above amax 2784.
GLOBAL_CASES = [
    (d, n, c, t) for d in GLOBAL_DIMS for n in ROW_COUNTS for c in (True, False) for t in DTYPES
]


def _index_rows(case, device: str) -> torch.Tensor:
    dim, num_rows, dtype = case
    seed = dim * 1000 + num_rows
    edges = index_edges(torch.Generator().manual_seed(seed))
    return rows(edges, num_rows, dim, seed, (-40, 40)).to(getattr(torch, dtype)).to(device)


def _global_rows(case, device: str) -> torch.Tensor:
    dim, num_rows, clamp_scale, dtype = case
    seed = dim * 1000 + num_rows + clamp_scale
    max_amax = float("inf") if clamp_scale else 2784.0
    edges = global_edges(torch.Generator().manual_seed(seed), max_amax)
    log2_range = (-40, 40) if clamp_scale else (-40, 8)
    return rows(edges, num_rows, dim, seed, log2_range).to(getattr(torch, dtype)).to(device)


def index_mismatches(device: str = "cpu") -> list[str]:
    """Cases where a kernel differs from kv_formats' index_fp4 quantize / round trip /
    dequantize (the dequantize reads the reference's bytes, and every byte value once)."""
    out = []
    for case in INDEX_CASES:
        x = _index_rows(case, device)
        packed = kv_formats.index_fp4_quantize(x)
        checks = {
            "quantize": (index_fp4_rows_quantize(x), packed),
            "round trip": (index_fp4_rows_round_trip(x), kv_formats.index_fp4_round_trip(x)),
            "round trip f32": (
                index_fp4_rows_round_trip(x, torch.float32),
                kv_formats.index_fp4_dequantize(packed),
            ),
            "dequantize": (
                index_fp4_rows_dequantize(packed),
                kv_formats.index_fp4_dequantize(packed),
            ),
        }
        out += [
            f"{name} {case}" for name, (ours, ref) in checks.items() if not same_bits(ours, ref)
        ]
    # Every data byte beside every finite scale byte (255, NaN, is checked as NaN only).
    data = torch.arange(256, dtype=torch.uint8).view(1, 4, 64).expand(255, -1, -1)
    scale = torch.arange(255, dtype=torch.uint8)[:, None, None].expand(-1, 4, 4)
    packed = torch.cat([data, scale], -1).to(device)  # [255 scales, 4 rows, 68 bytes]
    ours = index_fp4_rows_dequantize(packed, torch.bfloat16)
    if not same_bits(ours, kv_formats.index_fp4_dequantize(packed, torch.bfloat16)):
        out.append("dequantize every byte")
    nan_row = torch.full((1, 68), 255, dtype=torch.uint8, device=device)
    if not bool(index_fp4_rows_dequantize(nan_row).isnan().all()):
        out.append("dequantize scale 255")
    x = _index_rows(INDEX_CASES[-1], device)[:12].reshape(3, 4, -1)[:, ::2]  # [T, H, D] strided
    if not same_bits(index_fp4_rows_round_trip(x), kv_formats.index_fp4_round_trip(x)):
        out.append("round trip strided [3, 2, D]")
    return out


def global_mismatches(device: str = "cpu") -> list[str]:
    """Cases where the kernel's bytes differ from kv_formats.global_fp4_quantize's."""
    out = []
    for case in GLOBAL_CASES:
        x = _global_rows(case, device)
        ours = global_fp4_rows_quantize(x, clamp_scale=case[2])
        if not same_bits(ours, kv_formats.global_fp4_quantize(x, clamp_scale=case[2])):
            out.append(str(case))
    return out


_INTERPRETED = """
import json
from tests.kernels.test_fp4_rows import {name}
print(json.dumps({name}()))
"""


@pytest.mark.slow  # ~8 s in the interpreter
def test_index_kernels_match_the_codec_bit_for_bit_in_the_triton_interpreter() -> None:
    assert run_interpreted(_INTERPRETED.format(name="index_mismatches")) == []


@pytest.mark.slow  # ~6 s in the interpreter
def test_global_kernel_matches_the_codec_bit_for_bit_in_the_triton_interpreter() -> None:
    assert run_interpreted(_INTERPRETED.format(name="global_mismatches")) == []


_RAISES = """
import json, torch
from kernels.fp4_rows import global_fp4_rows_quantize
x = torch.ones(3, 64)
x[1, 20] = 2785.0
try:
    global_fp4_rows_quantize(x, clamp_scale=False)
    print(json.dumps("no error"))
except ValueError as error:
    print(json.dumps(str(error)))
"""


def test_global_kernel_raises_for_a_scale_nemo_cannot_store() -> None:
    with pytest.raises(ValueError, match="above 448"):
        x = torch.ones(3, 64)
        x[1, 20] = 2785.0
        kv_formats.global_fp4_quantize(x, clamp_scale=False)
    assert "above 448" in run_interpreted(_RAISES)


def test_launchers_reject_what_the_kernels_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        index_fp4_rows_quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 16"):
        global_fp4_rows_quantize(torch.zeros(2, 40))
    with pytest.raises(TypeError, match="floating"):
        index_fp4_rows_round_trip(torch.zeros(2, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="uint8"):
        index_fp4_rows_dequantize(torch.zeros(2, 68, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 17"):
        index_fp4_rows_dequantize(torch.zeros(2, 66, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CUDA"):
        index_fp4_rows_quantize(torch.zeros(2, 64))


@pytest.mark.gpu
def test_index_kernels_match_the_codec_bit_for_bit_on_cuda() -> None:
    assert index_mismatches("cuda") == []


@pytest.mark.gpu
def test_global_kernel_matches_the_codec_bit_for_bit_on_cuda() -> None:
    assert global_mismatches("cuda") == []


@pytest.mark.parametrize("group", [32, 16])
def test_quantize_kernel_compiles_for_hopper_with_ieee_arithmetic(group: int) -> None:
    # what the interpreter cannot show: the sm90 build keeps IEEE division (div_rn) and does
    # not flush subnormals (index rows with subnormal elements need x * 2^-e exact)
    from kernels.fp4_rows import _fp4_quantize_kernel
    from tests.kernels.interpreted import compile_for_hopper

    index = group == 32
    pointers = {"x_ptr": "*i16", "out_ptr": "*fp32" if index else "*u8"}
    ptx = compile_for_hopper(
        _fp4_quantize_kernel,
        {**pointers, "num_rows": "i32", "x_row_stride": "i32"},
        {"DIM": 512, "BLOCK_HALF": 256, "BLOCK_R": 8, "GROUP": group, "E4M3_SCALE": not index}
        | {"CLAMP_SCALE": True, "ROUND_TRIP": index, "IN_BF16_BITS": True, "OUT_BF16_BITS": False},
        {*pointers, "x_row_stride"},
    )
    assert "div.rn.f32" in ptx and ".ftz" not in ptx and ".local" not in ptx
