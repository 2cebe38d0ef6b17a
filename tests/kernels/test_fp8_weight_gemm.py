"""The W8A16 dense GEMM (`kernels.fp8_weight_gemm`: FP8 weights decoded in registers, bf16
activations) against its torch reference: the weights dequantized and rounded to bf16 as the
loader stores them for the bf16 path, products and sums in float32. Triton's interpreter runs
the kernel itself on small tiles (the K splits' one-launch finish included); the `gpu` tests
repeat the checks at the released model's widths. Errors are relative Frobenius norms."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v41.weight_formats import fp8_block_quantize
from kernels.fp8_block_gemm import dequantize_weight_reference
from kernels.fp8_weight_gemm import (
    WeightGemmTiles,
    choose_tiles,
    dequantize_fp8_weight,
    fp8_weight_gemm,
    fp8_weight_gemm_reference,
)
from tests.kernels.interpreted import compile_for_hopper, run_interpreted

# (M, K, N, groups, tiles or None for the table's): a ragged N (96) and a lone token, K split
# two and three ways (the last split short), the grouped form, tokens over two tiles, and
# groups of 32 rows under the table's 64-row tiles (the launcher takes 32-row tiles: the
# `tiny` model's `wo_a`)
CASES = [
    (5, 256, 96, 1, WeightGemmTiles(16, 32, 64, splits=2)),
    (1, 128, 64, 1, WeightGemmTiles(16, 64, 64, splits=2)),
    (16, 384, 64, 1, None),
    (40, 256, 128, 2, WeightGemmTiles(16, 64, 64, splits=3)),
    (70, 128, 64, 1, WeightGemmTiles(64, 64, 64)),
    (3, 64, 32, 2, None),
]


def _operands(m: int, k: int, n: int, groups: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, groups * k, generator=generator)
    x *= torch.logspace(-2, 2, m)[:, None]
    w = torch.randn(groups * n, k, generator=generator) * k**-0.5
    weight, scale = fp8_block_quantize(w, 32)
    return x.bfloat16().to(device), weight.to(device), scale.to(device)


def _rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    ours, reference = ours.float().cpu(), reference.float().cpu()
    return float((ours - reference).norm() / reference.norm())


def gemm_results(device: str = "cpu") -> list[list[float]]:
    """Per case: [relative error (fp32 output), the same bits on a second launch (1/0), the
    counters all back at zero (1/0)]."""
    from kernels.tile_counters import tile_counters

    rows = []
    for m, k, n, groups, tiles in CASES:
        x, weight, scale = _operands(m, k, n, groups, device)
        reference = fp8_weight_gemm_reference(x, weight, scale, groups)
        run = dict(groups=groups, out_dtype=torch.float32, tiles=tiles)
        first = fp8_weight_gemm(x, weight, scale, **run)
        again = fp8_weight_gemm(x, weight, scale, **run)
        zero = not tile_counters(torch.device(device), 1).any().item()
        rows.append([_rel(first, reference), float(torch.equal(first, again)), float(zero)])
    return rows


def decoded_weight_mismatches(
    device: str = "cpu", lowest_scale: int = 10, highest_scale: int = 134
) -> list[int]:
    """Weights read back through x = I (each output one product by 1.0), and from
    `dequantize_fp8_weight`: how many differ from the loader's bf16 values, over every e4m3
    code (NaN aside) under eight scale bytes: the lowest, the highest and six drawn between
    (the interpreter flushes float32 subnormals: it takes 10 and up, where the smallest code,
    2^-9, times 2^(10 − 127) is still normal)."""
    generator = torch.Generator().manual_seed(1)
    columns = torch.randperm(256, generator=generator)
    codes = torch.arange(256, dtype=torch.uint8).repeat(64, 1)[:, columns][:, :128]
    codes[(codes & 0x7F) == 0x7F] = 0x38  # 1.0 for the NaN codes
    scale = torch.randint(lowest_scale, highest_scale + 1, (8,), generator=generator)
    scale[:2] = torch.tensor([lowest_scale, highest_scale])
    scale = scale.to(torch.uint8).view(2, 4)
    x = torch.eye(128).bfloat16().to(device)
    weights = fp8_weight_gemm(
        x, codes.to(device), scale.to(device), out_dtype=torch.float32,
        tiles=WeightGemmTiles(64, 64, 64),
    )  # fmt: skip
    expected = dequantize_weight_reference(codes, scale, 32).to(torch.bfloat16).float().T
    dequantized = dequantize_fp8_weight(codes.to(device), scale.to(device)).float().T.cpu()
    # the codes are a strided view: rows apart
    return [int((weights.cpu() != expected).sum()), int((dequantized != expected).sum())]


_INTERPRETED = """
import json
from tests.kernels.test_fp8_weight_gemm import decoded_weight_mismatches, gemm_results
print(json.dumps({"gemm": gemm_results(), "decoded": decoded_weight_mismatches()}))
"""


@pytest.mark.slow  # ~10 s in the interpreter
def test_kernel_matches_its_reference_in_the_triton_interpreter() -> None:
    result = run_interpreted(_INTERPRETED)
    assert result["decoded"] == [0, 0]
    for error, same, counters_zero in result["gemm"]:
        assert error < 1e-6 and same == 1.0 and counters_zero == 1.0


def test_launcher_rejects_what_the_kernel_cannot_take() -> None:
    x, weight, scale = _operands(4, 64, 64, 1)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_weight_gemm(x.float(), weight, scale)
    with pytest.raises(ValueError, match="scales"):
        fp8_weight_gemm(x, weight, scale[:1])
    with pytest.raises(ValueError, match="K % 32"):
        fp8_weight_gemm(x[:, :48], weight[:, :48], scale)
    with pytest.raises(ValueError, match="groups"):
        fp8_weight_gemm(x, weight, scale, groups=3)
    with pytest.raises(ValueError, match="multiples of 32"):
        fp8_weight_gemm(x, weight, scale, tiles=WeightGemmTiles(16, 64, 48))
    with pytest.raises(ValueError, match="unit column stride"):
        fp8_weight_gemm(x[:, :32], weight[:, ::2], scale[:, :1])
    with pytest.raises(ValueError, match="CUDA"):
        fp8_weight_gemm(x, weight, scale)


def test_tiles_put_a_decode_step_on_one_tile_of_tokens() -> None:
    assert [choose_tiles(m).block_m for m in (1, 16, 17, 64, 256)] == [16, 16, 32, 64, 64]


# ---- on the GPU: compiled tiles (wgmma), the released model's dense shapes ------------------

# (M, K, N, groups): wq_a, wkv, wq_b, wo_a (8 groups), wo_b, shared w1 and w2, at decode sizes
GPU_SHAPES = [
    (1, 5120, 1280, 1),
    (16, 5120, 512, 1),
    (16, 1280, 32768, 1),
    (64, 4096, 1024, 8),
    (256, 8192, 5120, 1),
    (100, 5120, 4608, 1),
    (256, 2304, 5120, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, groups", GPU_SHAPES)
def test_cuda_gemm_matches_reference(m: int, k: int, n: int, groups: int) -> None:
    x, weight, scale = _operands(m, k, n, groups, "cuda")
    reference = fp8_weight_gemm_reference(x, weight, scale, groups)
    run = {"groups": groups, "out_dtype": torch.float32}
    fp32 = fp8_weight_gemm(x, weight, scale, **run)
    assert _rel(fp32, reference) < 1e-5  # the same products; the sums in another order
    assert torch.equal(fp32, fp8_weight_gemm(x, weight, scale, **run))
    bf16 = fp8_weight_gemm(x, weight, scale, groups=groups)
    assert bf16.dtype == torch.bfloat16 and _rel(bf16, reference) < 4e-3


@pytest.mark.gpu
def test_cuda_weights_decode_to_the_loaders_bf16_values() -> None:
    # up to 200: near 254 the largest codes overflow to inf, and x = I's zeros times inf make
    # the read-back NaN (a product's, not the decode's)
    assert decoded_weight_mismatches("cuda", lowest_scale=1, highest_scale=200) == [0, 0]


@pytest.mark.gpu
def test_cuda_splits_finish_in_one_launch_inside_a_graph() -> None:
    """A captured K-split launch replays with its counters back at zero each time."""
    x, weight, scale = _operands(16, 5120, 512, 1, "cuda")
    expected = fp8_weight_gemm(x, weight, scale)
    fp8_weight_gemm(x, weight, scale)  # warm: the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_weight_gemm(x, weight, scale)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


# ---- compiled for sm90 without a GPU ---------------------------------------------------------


@pytest.mark.slow
def test_decode_tile_compiles_to_wgmma_with_the_tokens_on_n() -> None:
    from kernels.fp8_weight_gemm import _fp8_weight_gemm_kernel

    types = {
        "x_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "counter_ptr": "*i32",
        **dict.fromkeys(("M", "N", "K", "group_n", "steps_per_split"), "i32"),
        **dict.fromkeys(("stride_xm", "stride_wn", "stride_ws", "stride_om"), "i32"),
    }  # fmt: skip
    constexprs = {"SPLITS": 4, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_BF16": True}
    aligned = {"x_ptr", "w_ptr", "ws_ptr", "out_ptr", "part_ptr", "N", "K"}
    aligned |= {"stride_xm", "stride_wn"}
    ptx = compile_for_hopper(_fp8_weight_gemm_kernel, types, constexprs, aligned)
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx  # the K splits' count, releasing and acquiring
    assert "cp.async" in ptx  # software-pipelined loads (num_stages)
