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
    index_fp4_rows_rotated_round_trip,
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


# (x shape, positions' dims, rotated channels, dtype name): the indexer's queries [T, H, D]
# (released: 64 heads of 128, 64 rotated), fp32 rows, a fully rotated row, two leading dims
# over a width that is no power of two, no rows.
ROTATED_CASES = [
    ((5, 4, 128), 1, 64, "bfloat16"),
    ((3, 128), 1, 64, "float32"),
    ((7, 16, 64), 1, 64, "bfloat16"),
    ((2, 3, 2, 96), 2, 32, "bfloat16"),
    ((0, 4, 128), 1, 64, "bfloat16"),
    # a position's rows fill whole tiles (the indexer's 64 heads): angles taken once per tile
    ((3, 64, 128), 1, 64, "bfloat16"),
    ((2, 32, 128), 1, 64, "float32"),
]


def _rotated_inputs(case, device: str):
    from engine.models.deepseek_v41.primitives import rope_frequencies

    shape, lead, rot, dtype = case
    generator = torch.Generator().manual_seed(sum(shape) + rot)
    x = (torch.randn(shape, generator=generator) * 3).to(getattr(torch, dtype))
    positions = torch.randint(0, 200_000, shape[:lead], generator=generator)
    freqs = rope_frequencies(rot, 10000.0, None)
    return x.to(device), positions.to(device), freqs.to(device)


def rotated_mismatches(device: str = "cpu") -> list[str]:
    """Cases where the rotated round trip differs from `kernels.rope.apply_rope` followed by
    the round trip (the two launches it replaces), as fp32 and in x's dtype."""
    from kernels.rope import apply_rope

    out = []
    for case in ROTATED_CASES:
        x, positions, freqs = _rotated_inputs(case, device)
        rotated = apply_rope(x, positions, freqs)
        for dtype in (torch.float32, None):
            ours = index_fp4_rows_rotated_round_trip(x, positions, freqs, dtype)
            if not same_bits(ours, index_fp4_rows_round_trip(rotated, dtype)):
                out.append(f"{case} {dtype}")
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


def test_rotated_round_trip_equals_rope_then_round_trip_in_the_triton_interpreter() -> None:
    assert run_interpreted(_INTERPRETED.format(name="rotated_mismatches")) == []


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
    x, positions, freqs = _rotated_inputs(ROTATED_CASES[0], "cpu")
    with pytest.raises(TypeError, match="bf16 or fp32"):
        index_fp4_rows_rotated_round_trip(x.half(), positions, freqs)
    with pytest.raises(ValueError, match="must lead"):
        index_fp4_rows_rotated_round_trip(x, positions[:-1], freqs)
    with pytest.raises(ValueError, match="do not fit"):
        index_fp4_rows_rotated_round_trip(x[..., :32], positions, freqs)
    with pytest.raises(ValueError, match="CUDA"):
        index_fp4_rows_rotated_round_trip(x, positions, freqs)


@pytest.mark.gpu
def test_index_kernels_match_the_codec_bit_for_bit_on_cuda() -> None:
    assert index_mismatches("cuda") == []


@pytest.mark.gpu
def test_global_kernel_matches_the_codec_bit_for_bit_on_cuda() -> None:
    assert global_mismatches("cuda") == []


@pytest.mark.gpu
def test_rotated_round_trip_equals_rope_then_round_trip_on_cuda() -> None:
    assert rotated_mismatches("cuda") == []


@pytest.mark.parametrize(("group", "rotate"), [(32, False), (16, False), (32, True)])
def test_quantize_kernel_compiles_for_hopper_with_ieee_arithmetic(group: int, rotate) -> None:
    # what the interpreter cannot show: the sm90 build keeps IEEE division (div_rn) and does
    # not flush subnormals (index rows with subnormal elements need x * 2^-e exact), the
    # rotated round trip included (the indexer's queries: 128 channels)
    from kernels.fp4_rows import _fp4_quantize_kernel
    from tests.kernels.interpreted import compile_for_hopper

    index = group == 32
    pointers = {"x_ptr": "*i16", "out_ptr": "*fp32" if index else "*u8"}
    pointers |= {"position_ptr": "*i64", "freq_ptr": "*fp32"}
    integers = {"num_rows": "i32", "x_row_stride": "i32", "rows_per_position": "i32"}
    dim = 128 if rotate else 512
    ptx = compile_for_hopper(
        _fp4_quantize_kernel,
        {**pointers, **integers, "pass_pairs": "i32"},
        {"DIM": dim, "BLOCK_HALF": dim // 2, "BLOCK_R": 8, "GROUP": group}
        | {"E4M3_SCALE": not index, "CLAMP_SCALE": True, "ROUND_TRIP": index, "ROTATE": rotate}
        | {"ONE_POSITION": rotate}
        | {"IN_BF16_BITS": True, "OUT_BF16_BITS": False, "LIBDEVICE": True},
        {*pointers, "x_row_stride", "rows_per_position"},
    )
    assert "div.rn.f32" in ptx
    if not rotate:
        assert ".ftz" not in ptx and ".local" not in ptx
        return
    # libdevice's cosf / sinf flush (and reduce huge angles through local memory) as in
    # `kernels.rope`'s own build; nothing else does
    from kernels.rope import _rope_kernel

    rope_types = {"x_ptr": "*bf16", "position_ptr": "*i64", "freq_ptr": "*fp32"}
    rope_types |= {"out_ptr": "*bf16", "rows_per_position": "i32", "width": "i32"}
    rope_types |= {"pass_width": "i32", "half": "i32", "sign": "fp32"}
    rope = compile_for_hopper(
        _rope_kernel,
        rope_types,
        {"BLOCK_R": 16, "BLOCK_PASS": 64, "BLOCK_HALF": 32, "LIBDEVICE": True},
        {"x_ptr", "position_ptr", "freq_ptr", "out_ptr"},
    )

    def flushing(text: str) -> set[str]:
        return {line.split()[0] for line in text.splitlines() if ".ftz" in line}

    assert flushing(ptx) <= flushing(rope)
