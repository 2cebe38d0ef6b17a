"""Tests for engine/models/deepseek_v41/kv_formats.py (model.md §2.3, §4, §14).

The element grids and the reference quantizers below are rebuilt from the format definitions in
float64 (brute-force nearest grid point, ties to the even code), independent of the module.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.deepseek_v41 import kv_formats as kv

FORMATS = {
    "swa_mxfp8": (kv.swa_mxfp8_quantize, kv.swa_mxfp8_dequantize, kv.swa_mxfp8_round_trip),
    "global_fp4": (kv.global_fp4_quantize, kv.global_fp4_dequantize, kv.global_fp4_round_trip),
    "index_fp4": (kv.index_fp4_quantize, kv.index_fp4_dequantize, kv.index_fp4_round_trip),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (so -0.0 != 0.0 and NaN == NaN)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype))


def wide_rows(num_rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose magnitude varies by 2^-20 .. 2^20 from row to row and block to block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, dim, generator=g)
    row_scale = torch.exp2(torch.randint(-20, 21, (num_rows, 1), generator=g).float())
    col_scale = torch.exp2(torch.randint(-3, 4, (1, dim // 16), generator=g).float())
    return x * row_scale * col_scale.repeat_interleave(16, dim=1)


# ----------------------------------------------------------------------------- reference grids


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """All non-negative finite e4m3 values (float64) and their bytes, from the bit layout."""
    values, codes = [], []
    for byte in range(0x7F):  # 0x7F is NaN
        exp_field, mantissa = byte >> 3, byte & 7
        if exp_field == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exp_field - 7))
        codes.append(byte)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def round_to_grid(v: torch.Tensor, grid: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Nearest grid value to |v| (ties -> even code), saturating, sign restored. float64."""
    magnitude = v.abs().clamp(max=grid.max().item()).unsqueeze(-1)
    dist = (magnitude - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    even = nearest & (codes % 2 == 0)
    pick = torch.where(even.any(-1), even.double().argmax(-1), nearest.double().argmax(-1))
    return torch.where(torch.signbit(v), -grid[pick], grid[pick])


def exact_ceil_log2(v: float) -> int:
    mantissa, exponent = math.frexp(v)
    return exponent - 1 if mantissa == 0.5 else exponent


def ref_round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Float64 reference of the three §2.3 rules (scales per block in Python floats)."""
    block = {"swa_mxfp8": 32, "global_fp4": 16, "index_fp4": 32}[kind]
    blocks = x.double().unflatten(-1, (-1, block))
    grid, grid_codes = e4m3_grid()
    amax = blocks.abs().amax(-1).flatten().tolist()
    if kind == "swa_mxfp8":
        scales = [2.0 ** exact_ceil_log2(max(a / 448, 1e-4)) for a in amax]
    elif kind == "global_fp4":
        ratios = torch.tensor([min(max(a / 6, 2.0**-9), 448.0) for a in amax], dtype=torch.float64)
        scales = round_to_grid(ratios, grid, grid_codes).tolist()
    else:
        scales = [2.0 ** exact_ceil_log2(max(a, 6 * 2.0**-126) / 6) for a in amax]
    s = torch.tensor(scales, dtype=torch.float64).view(*blocks.shape[:-1], 1)
    if kind == "swa_mxfp8":
        out = round_to_grid(blocks / s, grid, grid_codes) * s
    else:
        out = round_to_grid(blocks / s, E2M1, torch.arange(8)) * s
    return out.flatten(-2).float()


# ----------------------------------------------------------------------------- primitives


def test_e4m3_bytes_decode_to_the_bit_layout():
    grid, codes = e4m3_grid()
    decoded = kv.e4m3_to_float(codes.to(torch.uint8))
    assert torch.equal(decoded.double(), grid)
    assert torch.equal(kv.e4m3_to_float((codes | 0x80).to(torch.uint8)).double(), -grid)
    assert torch.isnan(kv.e4m3_to_float(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))).all()


def test_e4m3_round_is_nearest_even_and_saturates():
    grid, codes = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in float32: at most 5 significant bits
    lower_is_even = codes[:-1] % 2 == 0
    expected = torch.where(lower_is_even, codes[:-1], codes[1:]).to(torch.uint8)
    assert torch.equal(kv.e4m3_round(mids.float()).view(torch.uint8), expected)
    assert torch.equal(kv.e4m3_round(-mids.float()).view(torch.uint8), expected | 0x80)
    above = torch.tensor([449.0, 464.0, 480.0, 500.0, 1e30, float("inf")])
    assert (kv.e4m3_round(above).view(torch.uint8) == 0x7E).all()  # 448, never NaN
    assert (kv.e4m3_round(-above).view(torch.uint8) == 0xFE).all()


def test_e2m1_encode_ties_to_even_code_and_saturates():
    y = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0, 1e30])
    expected = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7]
    assert kv.e2m1_encode(y).tolist() == expected
    assert kv.e2m1_encode(-y).tolist() == [c | 8 for c in expected]
    assert kv.e2m1_encode(torch.tensor([-1e-9])).item() == 8  # -0 keeps its sign bit
    grid_values = torch.cat([E2M1, -E2M1]).float()
    assert torch.equal(kv.e2m1_encode(grid_values), torch.arange(16, dtype=torch.uint8))
    assert torch.equal(bits(kv.e2m1_decode(torch.arange(16, dtype=torch.uint8))), bits(grid_values))


def test_e2m1_encode_matches_brute_force_rounding():
    y = torch.linspace(-7, 7, 20001)
    expected = round_to_grid(y.double(), E2M1, torch.arange(8)).float()
    assert torch.equal(kv.e2m1_decode(kv.e2m1_encode(y)), expected)


def test_nibble_order_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert kv.pack_nibbles(codes).tolist() == [[0x21, 0x43]]
    assert torch.equal(kv.unpack_nibbles(kv.pack_nibbles(codes)), codes)


def test_pow2_and_ue8m0_are_exact_over_the_whole_byte_range():
    e = torch.arange(-127, 128)
    assert torch.equal(kv.pow2(e), torch.tensor([2.0**i for i in range(-127, 128)]))
    all_bytes = torch.arange(256, dtype=torch.uint8)
    ours = kv.ue8m0_to_float(all_bytes)
    theirs = all_bytes.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(ours[:255], theirs[:255]) and torch.isnan(ours[255])


def test_ceil_log2_is_exact_next_to_powers_of_two():
    p = torch.tensor([2.0**-13, 1.0, 2.0**20])
    just_above = torch.nextafter(p, torch.tensor(float("inf")))
    just_below = torch.nextafter(p, torch.tensor(0.0))
    assert kv.ceil_log2(p, -127, 127).tolist() == [-13, 0, 20]
    assert kv.ceil_log2(just_above, -127, 127).tolist() == [-12, 1, 21]
    assert kv.ceil_log2(just_below, -127, 127).tolist() == [-13, 0, 20]
    special = torch.tensor([0.0, float("inf"), 2.0**-140, 2.0**126 * 3])
    assert kv.ceil_log2(special, -127, 127).tolist() == [-127, 127, -127, 127]


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("kind", "dim", "nbytes"),
    [
        ("swa_mxfp8", 512, 528),
        ("global_fp4", 512, 288),
        ("index_fp4", 128, 68),
        ("swa_mxfp8", 64, 66),
        ("global_fp4", 64, 36),
        ("index_fp4", 32, 17),
    ],
)
def test_row_bytes_and_packed_shapes(kind, dim, nbytes):
    quantize, dequantize, _ = FORMATS[kind]
    row_bytes = getattr(kv, f"{kind}_row_bytes")
    assert row_bytes(dim) == nbytes
    packed = quantize(torch.randn(2, 3, dim))
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, nbytes)
    assert dequantize(packed).shape == (2, 3, dim)
    assert quantize(torch.randn(0, dim)).shape == (0, nbytes)


@pytest.mark.parametrize(
    ("kind", "block"), [("swa_mxfp8", 32), ("global_fp4", 16), ("index_fp4", 32)]
)
def test_bad_widths_are_rejected(kind, block):
    quantize, dequantize, _ = FORMATS[kind]
    with pytest.raises(ValueError):
        getattr(kv, f"{kind}_row_bytes")(block + block // 2)
    with pytest.raises(ValueError):
        quantize(torch.randn(2, block + 8))
    with pytest.raises(ValueError):
        dequantize(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(TypeError):
        quantize(torch.ones(2, block, dtype=torch.int32))


# ----------------------------------------------------------------------------- scale rules by hand


def test_swa_mxfp8_hand_computed_bytes():
    x = torch.zeros(4, 32)
    x[0, 0], x[0, 1] = 1.0, 0.3  # amax 1: 1/448 -> 2^-8 (byte 119); 1.0 -> 256 (0x78); 0.3 -> 80
    x[1, 0] = 448.0  # amax/448 = 1 -> byte 127; 448 -> 0x7E
    x[2, 0] = 449.0  # just above: 2^1 -> byte 128; 224.5 -> 224 = 0x76
    x[3, 0] = 0.01  # amax/448 < 1e-4 -> floor 2^ceil(log2 1e-4) = 2^-13 (byte 114)
    packed = kv.swa_mxfp8_quantize(x)
    assert packed[:, 32].tolist() == [119, 127, 128, 114]
    assert packed[0, :2].tolist() == [0x78, 0x6A]
    assert packed[1, 0].item() == 0x7E and packed[2, 0].item() == 0x76
    zero = kv.swa_mxfp8_quantize(torch.zeros(1, 32))
    assert zero[0, :32].eq(0).all() and zero[0, 32].item() == 114


def test_swa_mxfp8_nemo_floor_hand_computed_bytes():
    amax = torch.tensor([0.0, 0.01, 0.05, 1.0])
    x = torch.zeros(4, 32)
    x[:, 5] = amax
    spec = kv.swa_mxfp8_quantize(x)[:, 32].tolist()
    nemo = kv.swa_mxfp8_quantize(x, nemo_floor=True)[:, 32].tolist()
    assert spec == [114, 114, 114, 119]
    # max(amax, 1e-4) / 448: 0 -> 2.2e-7 -> 2^-22; 0.01 -> 2.2e-5 -> 2^-15; 0.05 -> 1.1e-4 -> 2^-13
    assert nemo == [105, 112, 114, 119]


def test_global_fp4_hand_computed_bytes():
    x = torch.zeros(3, 16)
    # amax 1: 1/6 -> e4m3 0.171875 = 1.375 * 2^-3 (0x23); 1 -> 5.82 -> 6 (code 7);
    # 0.5 -> 2.91 -> 3 (code 5); -0.25 -> -1.45 -> -1.5 (code 0xB)
    x[0, :3] = torch.tensor([1.0, 0.5, -0.25])
    x[1, 0] = 6.0  # scale 1.0 = 0x38
    x[2, 0] = 1e30  # scale clamped at 448 = 0x7E, value clamped to 6 * 448 = 2688
    packed = kv.global_fp4_quantize(x)
    assert packed[0].tolist() == [0x57, 0x0B, 0, 0, 0, 0, 0, 0, 0x23]
    assert packed[1, 0].item() == 0x07 and packed[1, 8].item() == 0x38
    assert packed[2, 0].item() == 0x07 and packed[2, 8].item() == 0x7E
    decoded = kv.global_fp4_dequantize(packed)
    assert decoded[0, :3].tolist() == [6 * 0.171875, 3 * 0.171875, -1.5 * 0.171875]
    assert decoded[2, 0].item() == 2688.0
    zero = kv.global_fp4_quantize(torch.zeros(1, 16))
    assert zero[0, :8].eq(0).all() and zero[0, 8].item() == 0x01  # floor 2^-9


def test_global_fp4_scale_clamp_only_matters_above_448():
    x = torch.zeros(3, 16)
    x[:, 0] = torch.tensor([2688.0, 2784.0, 6000.0])
    x[:, 1] = 1000.0
    spec = kv.global_fp4_round_trip(x)
    nemo = kv.global_fp4_round_trip(x, clamp_scale=False)
    # amax/6 = 448 and 464 round to 448 either way; 1000 rounds to 1024 without the clamp.
    assert torch.equal(spec[:2], nemo[:2])
    assert spec[0, :2].tolist() == [2688.0, 896.0]  # 1000 / 448 = 2.23 -> 2
    assert spec[2, :2].tolist() == [2688.0, 896.0]
    assert nemo[2, :2].tolist() == [6144.0, 1024.0]  # 6000 / 1024 -> 6, 1000 / 1024 -> 1
    assert torch.equal(
        kv.global_fp4_quantize(x[:2]), kv.global_fp4_quantize(x[:2], clamp_scale=False)
    )
    with pytest.raises(ValueError):
        kv.global_fp4_quantize(x, clamp_scale=False)


def test_index_fp4_hand_computed_bytes():
    x = torch.zeros(3, 32)
    x[0, :2] = torch.tensor([6.0, -0.5])  # s = 1 (127); codes 7 and 9 -> byte 0x97
    x[1, :2] = torch.tensor([7.0, 1.0])  # 7/6 -> s = 2 (128); 3.5 -> 4 (code 6), 0.5 (code 1)
    packed = kv.index_fp4_quantize(x)
    assert packed[0].tolist() == [0x97] + [0] * 15 + [127]
    assert packed[1, 0].item() == 0x16 and packed[1, 16].item() == 128
    assert packed[2].tolist() == [0] * 16 + [1]  # all zero: floor 6 * 2^-126 -> 2^-126
    assert kv.index_fp4_dequantize(packed)[1, :2].tolist() == [8.0, 1.0]


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", FORMATS)
def test_round_trip_matches_float64_reference(kind):
    x = wide_rows(48, 128, seed=1)
    assert torch.equal(bits(FORMATS[kind][2](x)), bits(ref_round_trip(x, kind)))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_identical_to_quantize_dequantize(kind, dtype):
    quantize, dequantize, round_trip = FORMATS[kind]
    x = (wide_rows(32, 128, seed=2) if dtype != torch.float16 else torch.randn(32, 128)).to(dtype)
    direct = round_trip(x)
    assert direct.dtype == dtype
    assert torch.equal(bits(direct), bits(dequantize(quantize(x), dtype=dtype)))


def test_swa_mxfp8_error_bound():
    x = wide_rows(64, 512, seed=3)
    packed = kv.swa_mxfp8_quantize(x)
    scale = kv.ue8m0_to_float(packed[:, 512:]).repeat_interleave(32, dim=1)
    err = (kv.swa_mxfp8_dequantize(packed) - x).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormal spacing 2^-9 * s.
    assert (err <= 2.0**-4 * x.abs() + 2.0**-10 * scale).all()
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, dim=1)
    assert (amax / scale <= 448).all()
    assert (scale <= torch.maximum(2 * amax / 448, torch.tensor(2 * 1e-4))).all()


def test_global_fp4_error_bound():
    x = wide_rows(64, 512, seed=4)
    packed = kv.global_fp4_quantize(x)
    scale = kv.e4m3_to_float(packed[:, 256:]).unsqueeze(-1)
    err = (kv.global_fp4_dequantize(packed) - x).abs().unflatten(-1, (-1, 16))
    amax = x.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
    # Worst e2m1 error: half the 4..6 gap, 1 * s; values above 6 * s (scale rounded down, or
    # saturated at 448) clamp to 6 * s, erring by at most amax - 6 * s.
    assert (err <= scale + (amax - 6 * scale).clamp_min(0)).all()
    # Normal e4m3 scales are amax/6 to 2^-4 relative, so the error is <= (17/96) amax there.
    normal = (amax / 6 >= 2.0**-6) & (amax / 6 <= 448)
    assert normal.float().mean() > 0.25  # the masked checks below see many blocks
    assert ((scale - amax / 6).abs() <= 2.0**-4 * amax / 6)[normal].all()
    assert (err <= amax * 17 / 96)[normal.expand_as(err)].all()
    assert (err.amax(-1) > 0).any()  # quantization is not a no-op


def test_index_fp4_error_bound():
    x = wide_rows(64, 512, seed=4)
    packed = kv.index_fp4_quantize(x)
    scale = kv.ue8m0_to_float(packed[:, 256:]).unsqueeze(-1)
    err = (kv.index_fp4_dequantize(packed) - x).abs().unflatten(-1, (-1, 32))
    amax = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert ((amax / scale > 3) & (amax / scale <= 6)).all()  # smallest power of two
    assert (err <= scale).all() and (err <= amax / 3).all()
    assert (err.amax(-1) > 0).any()


@pytest.mark.parametrize("kind", FORMATS)
def test_values_on_the_grid_survive_bit_exactly(kind):
    g = torch.Generator().manual_seed(5)
    block = 16 if kind == "global_fp4" else 32
    if kind == "swa_mxfp8":
        grid, _ = e4m3_grid()
        unit = torch.exp2(torch.randint(-10, 10, (8, 4, 1), generator=g).float())
        top = 448.0
    else:
        grid = E2M1
        top = 6.0
        if kind == "global_fp4":  # the scale must be a normal e4m3 value <= 448
            unit = torch.exp2(torch.randint(-6, 9, (8, 4, 1), generator=g).float()) * 1.375
        else:
            unit = torch.exp2(torch.randint(-10, 10, (8, 4, 1), generator=g).float())
    picks = grid[torch.randint(0, len(grid), (8, 4, block), generator=g)].float()
    signs = torch.where(torch.rand(8, 4, block, generator=g) < 0.5, -1.0, 1.0)
    picks[..., 0] = top  # pins the scale to `unit`
    x = (picks * signs * unit).flatten(-2)
    assert torch.equal(bits(FORMATS[kind][2](x)), bits(x))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_huge_and_tiny_rows_stay_finite(kind, dtype):
    quantize, dequantize, round_trip = FORMATS[kind]
    x = torch.zeros(4, 64)
    x[1] = 1e30 * torch.linspace(-1, 1, 64)
    x[2] = 1e-30 * torch.linspace(-1, 1, 64)
    x[3, :32], x[3, 32:] = 1e30, 1e-30
    x = x.to(dtype)
    out = round_trip(x)
    assert torch.isfinite(out).all()
    assert torch.equal(bits(out[0]), bits(torch.zeros(64, dtype=dtype)))
    assert torch.isfinite(dequantize(quantize(x))).all()
    big = x[1].float().abs() > 5e29
    if kind == "global_fp4":  # the scale saturates at 448: values clamp to 6 * 448
        assert out[1].float()[big].abs().eq(2688.0).all()
    else:
        rel = ((out[1].float() - x[1].float()).abs() / x[1].float().abs())[big]
        assert (rel <= (2.0**-4 if kind == "swa_mxfp8" else 0.25)).all()


def test_tiny_values_follow_each_floor():
    x = torch.full((1, 32), 1e-30)
    # swa: scale floor 2^-13 flushes to zero; index: scale follows amax down, stays accurate.
    assert kv.swa_mxfp8_round_trip(x).eq(0).all()
    index = kv.index_fp4_round_trip(x)
    assert ((index - x).abs() <= 0.25 * x).all() and (index > 0).all()


def test_nemo_floor_changes_only_blocks_below_00448():
    g = torch.Generator().manual_seed(6)
    amax = torch.exp2(torch.empty(400).uniform_(-24, 4, generator=g))
    x = torch.rand(400, 32, generator=g) * 2 - 1
    x = x / x.abs().amax(-1, keepdim=True) * amax[:, None]
    spec = kv.swa_mxfp8_quantize(x)
    nemo = kv.swa_mxfp8_quantize(x, nemo_floor=True)
    differs = (spec != nemo).any(-1)
    assert not differs[amax >= 0.0448].any()
    # Below 448 * 2^-14 = 0.0273 the NeMo power of two drops under the spec's 2^-13 floor.
    assert differs[amax <= 0.027].all()


# ----------------------------------------------------------------------------- codec


@pytest.mark.parametrize(
    ("kind", "dim"), [("swa_mxfp8", 64), ("global_fp4", 64), ("index_fp4", 32)]
)
def test_codec_round_trip_equals_format_round_trip(kind, dim):
    codec = kv.make_codec(kind, dim)
    x = wide_rows(5, dim, seed=7).view(5, 1, dim)
    stored = codec.encode(x)
    assert stored.dtype == codec.storage_dtype == torch.uint8
    assert stored.shape == (5, 1, codec.row_width) and codec.row_width == getattr(
        kv, f"{kind}_row_bytes"
    )(dim)
    decoded = codec.decode(stored)
    assert decoded.dtype == torch.float32
    assert torch.equal(bits(decoded), bits(FORMATS[kind][2](x)))


def test_exact_codec_stores_float32_unchanged():
    codec = kv.make_codec("global_fp4", 48, quantize=False)
    assert (codec.storage_dtype, codec.row_width, codec.name) == (
        torch.float32,
        48,
        "global_fp4/exact",
    )
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(x)), x.float())


@pytest.mark.parametrize("quantize", [True, False])
def test_rotated_round_trip_is_the_round_trip_of_the_rotated_rows(quantize: bool):
    # the indexer's queries [T, H, D]: off the kernel path, the two steps as before
    from engine.models.deepseek_v41.primitives import rope_frequencies
    from kernels.rope import apply_rope_reference

    codec = kv.make_codec("index_fp4", 64, quantize=quantize)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    positions = torch.arange(5) * 1000
    freqs = rope_frequencies(32, 10000.0, None)
    ours = codec.rotated_round_trip(x, positions, freqs)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, codec.round_trip(apply_rope_reference(x, positions, freqs)))


def test_nemo_codec_uses_nemo_rules():
    x = torch.zeros(1, 64)
    x[0, 0] = 0.01
    x[0, 32] = 1.0
    codec = kv.make_codec("swa_mxfp8", 64, nemo_variant=True)
    assert codec.name == "swa_mxfp8/nemo"
    assert torch.equal(codec.encode(x), kv.swa_mxfp8_quantize(x, nemo_floor=True))
    assert not torch.equal(codec.encode(x), kv.make_codec("swa_mxfp8", 64).encode(x))
    big = torch.zeros(1, 64)
    big[0, 0] = 6000.0
    with pytest.raises(ValueError):
        kv.make_codec("global_fp4", 64, nemo_variant=True).encode(big)


def test_codec_rejects_bad_kinds_and_shapes():
    with pytest.raises(ValueError):
        kv.make_codec("swa_fp8", 64)
    with pytest.raises(ValueError):
        kv.make_codec("index_fp4", 48)
    codec = kv.make_codec("index_fp4", 64)
    with pytest.raises(ValueError):
        codec.encode(torch.randn(2, 32))
    with pytest.raises(ValueError):
        codec.decode(torch.zeros(2, 17, dtype=torch.uint8))
    with pytest.raises(TypeError):
        codec.decode(torch.zeros(2, codec.row_width, dtype=torch.float32))


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("variant", [False, True])
def test_cuda_bytes_match_cpu(kind, variant):
    quantize, dequantize, round_trip = FORMATS[kind]
    kwargs = {"swa_mxfp8": {"nemo_floor": variant}, "global_fp4": {"clamp_scale": not variant}}
    kwargs = kwargs.get(kind, {})
    x = wide_rows(256, 512, seed=8)
    x[0, :64] = 1e30
    x[1] = 0.0
    x[2] = 1e-30
    assert torch.equal(bits(round_trip(x.cuda(), **kwargs).cpu()), bits(round_trip(x, **kwargs)))
    if kind == "global_fp4" and variant:
        x = x.clamp(-2700, 2700)  # an unclamped scale above 464 has no e4m3 byte
    cpu = quantize(x, **kwargs)
    gpu = quantize(x.cuda(), **kwargs)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(bits(dequantize(gpu).cpu()), bits(dequantize(cpu)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_e4m3_round_saturates():
    # A bare CUDA cast to float8_e4m3fn turns values >= 480 into NaN (seen with torch 2.11).
    above = torch.tensor([449.0, 464.0, 480.0, 500.0, 1e30, float("inf")], device="cuda")
    assert (kv.e4m3_round(above).view(torch.uint8) == 0x7E).all()
    assert (kv.e4m3_round(-above).view(torch.uint8) == 0xFE).all()


# ----------------------------------------------------------------------------- kernel path

_CODEC_KERNEL_PATH = """
import json
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from engine.models.deepseek_v41.kv_formats import make_codec
from tests.models.test_kv_formats import wide_rows

class TorchOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))

CODEC_MATHS = {"aten::abs", "aten::amax", "aten::frexp", "aten::div", "aten::cat"}
out = {}
for kind, dim in (("swa_mxfp8", 512), ("index_fp4", 128), ("global_fp4", 512)):
    for nemo in (False, True):
        codec = make_codec(kind, dim, nemo_variant=nemo)
        x = wide_rows(12, dim, seed=dim).to(torch.bfloat16).view(3, 4, dim)
        if codec.name == "global_fp4/nemo":
            x = x * 2.0**-14  # below amax 2784, where NeMo's unclamped scales have a byte
        with TorchOps() as ops:
            stored = codec.encode(x)
            trip = codec.round_trip(x) if kind == "index_fp4" else None
            decoded = codec.decode(stored) if kind == "index_fp4" else None
        # The torch codec itself (its maths does not depend on the interpreter).
        ref = codec.encode_fn(x)
        checks = [torch.equal(stored, ref)]
        if kind == "index_fp4":
            ref_decoded = codec.decode_fn(ref)
            checks += [torch.equal(trip.view(torch.int32), ref_decoded.view(torch.int32))]
            checks += [torch.equal(decoded.view(torch.int32), ref_decoded.view(torch.int32))]
        out[codec.name] = [all(checks), sorted(ops.names & CODEC_MATHS)]
print(json.dumps(out))
"""


def test_codecs_take_the_one_launch_kernels_on_the_kernel_path() -> None:
    """In Triton's interpreter (the CUDA code path on the CPU), encode / decode / round_trip
    run the kernels (none of the torch codec's maths is dispatched) and store the same bytes."""
    from tests.kernels.interpreted import run_interpreted

    result = run_interpreted(_CODEC_KERNEL_PATH)
    assert result == {name: [True, []] for name in result}
    assert len(result) == 6


def test_round_trip_is_decode_of_encode_on_the_cpu() -> None:
    for kind, dim in (("swa_mxfp8", 64), ("index_fp4", 64), ("global_fp4", 64)):
        for quantize in (True, False):
            codec = kv.make_codec(kind, dim, quantize=quantize)
            x = wide_rows(5, dim, seed=1).to(torch.bfloat16)
            assert torch.equal(bits(codec.round_trip(x)), bits(codec.decode(codec.encode(x))))


@pytest.mark.parametrize("nemo", [False, True])
@pytest.mark.parametrize("quantize", [True, False])
def test_normed_rotated_encode_is_the_encoding_of_the_normed_rotated_rows(
    quantize: bool, nemo: bool
) -> None:
    # the window row [T, D]: off the kernel path, the norm and rotation, then encode, as before
    from engine.models.deepseek_v41.primitives import rope_frequencies
    from kernels.rms_norm_rope import rms_norm_rope_reference

    codec = kv.make_codec("swa_mxfp8", 64, quantize=quantize, nemo_variant=nemo)
    x = wide_rows(5, 64, seed=2).to(torch.bfloat16)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    positions, freqs = torch.arange(5) * 1000, rope_frequencies(16, 10000.0, None)
    ours = codec.normed_rotated_encode(x, weight, 1e-6, positions, freqs)
    rows = rms_norm_rope_reference(x, weight, 1e-6, positions, freqs)[0]
    assert torch.equal(ours, codec.encode(rows))


_NORMED_ROTATED_KERNEL_PATH = """
import json
import torch
from engine.models.deepseek_v41.kv_formats import make_codec
from engine.models.deepseek_v41.primitives import rope_frequencies
from kernels.rms_norm_rope import rms_norm_rope
from tests.kernels.specializations import record_launch_keys
from tests.models.test_kv_formats import wide_rows

x = wide_rows(6, 512, seed=4).to(torch.bfloat16)
positions, freqs = torch.arange(6) * 977, rope_frequencies(64, 10000.0, None)
out = {}
for gain in (1.0, 1e-4):  # 1e-4: amax below the floor, where the two floor rules differ
    weight = (torch.randn(512, generator=torch.Generator().manual_seed(5)) * gain).bfloat16()
    rows = rms_norm_rope(x, weight, 1e-6, positions, freqs)[0]
    for codec in (make_codec("swa_mxfp8", 512), make_codec("swa_mxfp8", 512, nemo_variant=True),
                  make_codec("global_fp4", 512)):
        with record_launch_keys() as launched:
            ours = codec.normed_rotated_encode(x, weight, 1e-6, positions, freqs)
        out[f"{codec.name} {gain}"] = [
            torch.equal(ours, codec.encode_fn(rows)),
            len(launched),
            ours.sum().item(),
        ]
print(json.dumps(out))
"""


def test_normed_rotated_encode_takes_one_launch_on_the_kernel_path() -> None:
    """In Triton's interpreter: the MXFP8 codecs' norm + RoPE + encoding is one launch storing
    the torch codec's bytes of the norm + RoPE kernel's rows, each floor rule its own (they
    differ below the floor); a codec without such a kernel takes the two launches."""
    from tests.kernels.interpreted import run_interpreted

    result = run_interpreted(_NORMED_ROTATED_KERNEL_PATH)
    assert all(same for same, _, _ in result.values())
    assert {key: launches for key, (_, launches, _) in result.items()} == {
        f"{name} {gain}": 2 if name == "global_fp4" else 1
        for name in ("swa_mxfp8", "swa_mxfp8/nemo", "global_fp4")
        for gain in (1.0, 1e-4)
    }
    assert result["swa_mxfp8 0.0001"][2] != result["swa_mxfp8/nemo 0.0001"][2]
