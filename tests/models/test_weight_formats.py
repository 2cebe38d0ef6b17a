"""Tests for engine/models/deepseek_v41/weight_formats.py (model.md §5.3, §5.4)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.deepseek_v41 import weight_formats as wf


def raw(t: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of a float8 / int8 tensor."""
    return t.view(torch.uint8)


def wide_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weight whose rows differ in magnitude by up to 2^+-12."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-12, 13, (n, 1), generator=g).float())
    return torch.randn(n, k, generator=g) * rows


def e4m3_values(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.float8_e4m3fn).to(torch.float64)


def e8m0_powers(t: torch.Tensor) -> torch.Tensor:
    """2^(byte - 127) in float64 (independent of the module's decoder)."""
    return torch.exp2(raw(t).to(torch.float64) - 127)


# ----------------------------------------------------------------------------- byte helpers


def test_e8m0_byte_helpers_keep_bits_and_survive_safetensors(tmp_path):
    exponent_bytes = torch.arange(256, dtype=torch.uint8)
    scale = wf.bytes_to_e8m0(exponent_bytes)
    assert scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(wf.e8m0_to_bytes(scale), exponent_bytes)
    path = tmp_path / "scale.safetensors"
    save_file({"scale": scale}, path)
    assert b'"dtype":"F8_E8M0"' in path.read_bytes()[:200]
    with safe_open(path, framework="pt") as handle:
        loaded = handle.get_tensor("scale")
    assert loaded.dtype == torch.float8_e8m0fnu
    assert torch.equal(wf.e8m0_to_bytes(loaded), exponent_bytes)
    with pytest.raises(TypeError):
        wf.bytes_to_e8m0(torch.zeros(3))
    with pytest.raises(TypeError):
        wf.e8m0_to_bytes(torch.zeros(3))


# ----------------------------------------------------------------------------- FP8 block weights


@pytest.mark.parametrize(("n", "k"), [(64, 96), (45, 70), (1, 33), (32, 1)])
def test_fp8_block_shapes_and_dequant_formula(n, k):
    w = wide_weight(n, k, seed=n + k)
    weight, scale = wf.fp8_block_quantize(w)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (-(-n // 32), -(-k // 32))
    # W[i, j] = e4m3(W8[i, j]) * 2^(S[i // 32, j // 32] - 127), written out index by index
    rows = torch.arange(n)[:, None] // 32
    cols = torch.arange(k)[None, :] // 32
    expected = e4m3_values(weight) * e8m0_powers(scale)[rows, cols]
    out = wf.fp8_block_dequantize(weight, scale)
    assert out.dtype == torch.float32 and torch.equal(out.double(), expected)
    bf16 = wf.fp8_block_dequantize(raw(weight), raw(scale), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))


def test_fp8_block_error_bound_and_scale_rule():
    w = wide_weight(96, 160, seed=1)
    weight, scale = wf.fp8_block_quantize(w)
    s = e8m0_powers(scale).float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    err = (wf.fp8_block_dequantize(weight, scale) - w).abs()
    # 3 mantissa bits; the subnormal step is 2^-9 of the scale before any canonical halving
    assert (err <= 2.0**-4 * w.abs() + 2.0**-9 * s).all()
    amax = w.abs().view(3, 32, 5, 32).amax(dim=(1, 3))
    ratio = amax / e8m0_powers(scale).float()
    # smallest power of two with amax / s <= 448, except canonical tiles (module NOTE),
    # whose amax / s lies in (448, 464] and whose largest code is exactly 448
    assert ((ratio > 224) & (ratio <= 464)).all()


def test_fp8_block_hand_computed_bytes():
    w = torch.zeros(64, 96)
    w[0, 0], w[1, 1] = 1.0, 0.3  # tile (0,0): 1/448 -> 2^-8 (byte 119); 1 -> 256 (0x78); 0.3 -> 80
    w[40, 40] = 448.0  # tile (1,1): s = 1 (byte 127), 448 -> 0x7E
    w[0, 70] = 229.0  # tile (0,2): s = 1 rounds 229 to 224: canonical s = 1/2 (126), 448 (0x7E)
    weight, scale = wf.fp8_block_quantize(w)
    assert raw(scale).tolist() == [[119, 0, 126], [0, 127, 0]]  # all-zero tiles: byte 0
    assert raw(weight)[0, 0].item() == 0x78 and raw(weight)[1, 1].item() == 0x6A
    assert raw(weight)[40, 40].item() == 0x7E and raw(weight)[0, 70].item() == 0x7E
    out = wf.fp8_block_dequantize(weight, scale)
    assert out[0, 70].item() == 224.0 and out[40, 40].item() == 448.0
    assert out[1, 1].item() == 80 * 2.0**-8
    assert torch.isfinite(out).all() and out.count_nonzero() == 4


def crafted_fp8_tiles(seed: int) -> torch.Tensor:
    """[70, 100] weight mixing wide random tiles, a zero tile, tiny/huge tiles, and tiles whose
    amax / s falls in (224, 232] (rounded down to 224: the case that needs canonical bytes)."""
    g = torch.Generator().manual_seed(seed)
    w = wide_weight(70, 100, seed=seed)
    w[:32, :32] = 0.0
    w[32:64, :32] *= 1e-30
    w[32:64, 32:64] *= 1e30
    for tile_row, tile_col in [(0, 1), (1, 2), (2, 0)]:
        rows, cols = (
            slice(32 * tile_row, 32 * tile_row + 32),
            slice(32 * tile_col, 32 * tile_col + 32),
        )
        tile = w[rows, cols]
        tile.copy_(torch.rand(tile.shape, generator=g) * 200 - 100)
        tile[0, 0] = 226.0  # s = 2^0 before the shift: 226 -> 224
        tile.mul_(2.0**-5)
    return w


def test_fp8_block_quantize_of_dequantize_is_a_fixed_point():
    w = crafted_fp8_tiles(seed=2)
    weight, scale = wf.fp8_block_quantize(w)
    again_weight, again_scale = wf.fp8_block_quantize(wf.fp8_block_dequantize(weight, scale))
    assert torch.equal(raw(again_weight), raw(weight))
    assert torch.equal(raw(again_scale), raw(scale))
    assert raw(scale)[0, 1].item() == 127 - 5 - 1  # the crafted tile took the canonical exponent
    assert torch.isfinite(wf.fp8_block_dequantize(weight, scale)).all()


def test_fp8_block_rejects_a_mismatched_scale_grid():
    weight, scale = wf.fp8_block_quantize(torch.randn(40, 64))
    with pytest.raises(ValueError):
        wf.fp8_block_dequantize(weight, scale[:1])
    with pytest.raises(ValueError):
        wf.fp8_block_dequantize(weight, scale, block=128)


# ----------------------------------------------------------------------------- MXFP4 experts


def test_mxfp4_nibble_order_and_hand_computed_bytes():
    w = torch.zeros(3, 64)
    w[0, :4] = torch.tensor([0.5, 6.0, -1.0, 0.5])  # s = 1 (127); bytes 0x71 and 0x1A
    w[1, :2] = torch.tensor([7.0, 3.0])  # 7/6 -> s = 2 (128); 3.5 -> 4 (code 6), 1.5 (code 3)
    w[2, :2] = torch.tensor([3.2, 0.3])  # s = 1: 3.2 -> 3, 0.3 -> 0.5; canonical s = 1/2 (126),
    # codes doubled to 6 (7) and 1 (2) -> byte 0x27
    packed, scale = wf.mxfp4_quantize(w)
    assert packed.dtype == torch.int8 and packed.shape == (3, 32)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    assert raw(packed)[0, :2].tolist() == [0x71, 0x1A]
    assert raw(packed)[1, 0].item() == 0x36 and raw(packed)[2, 0].item() == 0x27
    assert raw(scale).tolist() == [[127, 0], [128, 0], [126, 0]]
    out = wf.mxfp4_dequantize(packed, scale)
    assert out[0, :4].tolist() == [0.5, 6.0, -1.0, 0.5]
    assert out[1, :2].tolist() == [8.0, 3.0]
    assert out[2, :2].tolist() == [3.0, 0.5]


def test_mxfp4_ties_round_to_even_codes():
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    out = wf.mxfp4_dequantize(*wf.mxfp4_quantize(w))
    assert out[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_mxfp4_dequant_formula_and_error_bound():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 24, 128, generator=g) * torch.exp2(
        torch.randint(-8, 9, (4, 24, 1), generator=g)
    )
    packed, scale = wf.mxfp4_quantize(w)
    assert packed.shape == (4, 24, 64) and scale.shape == (4, 24, 4)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    nibbles = torch.stack([raw(packed) & 15, raw(packed) >> 4], dim=-1).flatten(-2).long()
    expected = grid.double()[nibbles] * e8m0_powers(scale).repeat_interleave(32, -1)
    out = wf.mxfp4_dequantize(packed, scale)
    assert torch.equal(out.double(), expected)
    amax = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    err = (out - w).abs().unflatten(-1, (-1, 32))
    assert (err <= amax / 3).all()  # half the 4..6 gap at a scale s < amax / 3
    assert torch.equal(
        wf.mxfp4_dequantize(raw(packed), raw(scale), dtype=torch.bfloat16), out.bfloat16()
    )


def test_mxfp4_quantize_of_dequantize_is_a_fixed_point():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 256, generator=g) * torch.exp2(torch.randint(-20, 21, (48, 1), generator=g))
    w[0, :32] = 0.0
    w[1, :32] = torch.rand(32, generator=g) * 3.0
    w[1, 0] = 3.2  # amax / s = 3.2 -> rounds to 3 (needs the canonical exponent)
    w[2, :32] *= 1e30
    w[3, :32] = -1e-30
    packed, scale = wf.mxfp4_quantize(w)
    assert raw(scale)[1, 0].item() == 126
    again_packed, again_scale = wf.mxfp4_quantize(wf.mxfp4_dequantize(packed, scale))
    assert torch.equal(again_packed, packed) and torch.equal(raw(again_scale), raw(scale))
    assert torch.isfinite(wf.mxfp4_dequantize(packed, scale)).all()


def test_mxfp4_rejects_bad_shapes():
    with pytest.raises(ValueError):
        wf.mxfp4_quantize(torch.randn(4, 48))
    packed, scale = wf.mxfp4_quantize(torch.randn(4, 64))
    with pytest.raises(ValueError):
        wf.mxfp4_dequantize(packed, scale[:, :1])


# ----------------------------------------------------------------------------- Engram rows


def test_fp8_row_scales_are_per_row_per_32_columns():
    w = torch.zeros(3, 64)
    w[0, 0], w[0, 32], w[1, 0] = 1.0, 448.0, 2.0**-20
    weight, scale = wf.fp8_row_quantize(w)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (3, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    # 1/448 -> 2^-8 (119); 448 -> 2^0 (127); 2^-20/448 -> 2^-28 (99); zero blocks -> byte 0
    assert raw(scale).tolist() == [[119, 127], [99, 0], [0, 0]]


def test_fp8_row_gather_equals_full_dequant_rows():
    w = wide_weight(50, 256, seed=5)
    weight, scale = wf.fp8_row_quantize(w)
    full = wf.fp8_row_dequantize(weight, scale)
    assert full.shape == (50, 256)
    assert (full - w).abs().le(2.0**-4 * w.abs() + 2.0**-10 * w.abs().amax(-1, keepdim=True)).all()
    idx = torch.tensor([[3, 3, 49], [0, 17, 8]])
    gathered = wf.fp8_row_dequantize(weight, scale, idx)
    assert gathered.shape == (2, 3, 256) and torch.equal(gathered, full[idx])
    one = wf.fp8_row_dequantize(raw(weight), raw(scale), torch.tensor(7), dtype=torch.bfloat16)
    assert one.shape == (256,) and torch.equal(one, full[7].bfloat16())


def test_fp8_row_dequantize_reads_only_gathered_rows():
    # A 2^40-row table that exists only as a stride-0 view: converting it whole would fail.
    weight, scale = wf.fp8_row_quantize(torch.linspace(-3, 3, 256).view(1, 256))
    huge_weight = weight.expand(2**40, 256)
    huge_scale = scale.expand(2**40, 8)
    idx = torch.tensor([0, 2**40 - 1, 12345])
    out = wf.fp8_row_dequantize(huge_weight, huge_scale, idx)
    assert torch.equal(out, wf.fp8_row_dequantize(weight, scale).expand(3, 256))


def test_fp8_row_quantize_of_dequantize_is_a_fixed_point():
    w = wide_weight(40, 128, seed=6)
    w[0] = 0.0
    w[1, :32] = torch.linspace(-200, 200, 32) * 2.0**-9
    w[1, 0] = 229.0 * 2.0**-9  # rounds to 224 * 2^-9: canonical exponent
    w[2] *= 1e30
    w[3] *= 1e-30
    weight, scale = wf.fp8_row_quantize(w)
    assert raw(scale)[1, 0].item() == 127 - 9 - 1
    again_weight, again_scale = wf.fp8_row_quantize(wf.fp8_row_dequantize(weight, scale))
    assert torch.equal(raw(again_weight), raw(weight)) and torch.equal(raw(again_scale), raw(scale))


def test_fp8_row_rejects_mismatched_scales():
    weight, scale = wf.fp8_row_quantize(torch.randn(5, 64))
    with pytest.raises(ValueError):
        wf.fp8_row_dequantize(weight, scale[:, :1])
    with pytest.raises(ValueError):
        wf.fp8_row_quantize(torch.randn(5, 48))


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    w = crafted_fp8_tiles(seed=7)
    cpu = wf.fp8_block_quantize(w)
    gpu = wf.fp8_block_quantize(w.cuda())
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(raw(a), raw(b).cpu())
    assert torch.equal(wf.fp8_block_dequantize(*gpu).cpu(), wf.fp8_block_dequantize(*cpu))
    x = wide_weight(64, 256, seed=8)
    for quantize, dequantize in [
        (wf.mxfp4_quantize, wf.mxfp4_dequantize),
        (wf.fp8_row_quantize, wf.fp8_row_dequantize),
    ]:
        cpu = quantize(x)
        gpu = quantize(x.cuda())
        for a, b in zip(cpu, gpu, strict=True):
            assert torch.equal(raw(a), raw(b).cpu())
        assert torch.equal(dequantize(*gpu).cpu(), dequantize(*cpu))
    idx = torch.tensor([[1, 5], [63, 0]])
    weight, scale = wf.fp8_row_quantize(x.cuda())
    gathered = wf.fp8_row_dequantize(weight, scale, idx.cuda())
    assert torch.equal(gathered.cpu(), wf.fp8_row_dequantize(weight.cpu(), scale.cpu(), idx))
