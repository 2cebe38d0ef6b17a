"""Dense GEMM with the checkpoint's FP8 weights and bf16 activations (W8A16), for decode steps:

    y[m, n] = Σ_k x[m, k] · W[n, k],   W[n, k] = e4m3(W8[n, k]) · 2^(S[n // 32, k // 32] − 127)

W stays as stored (float8_e4m3fn [N, K] and one ue8m0 scale per 32 × 32 tile, `model.md` §5.3).
Each weight is decoded in registers to bf16: the hardware's e4m3 → f16 conversion (two codes
per instruction, exact) and f16 → bf16 (exact: three mantissa bits), then one bf16 product by
the tile's power of two, exact wherever the result is a normal bf16 and rounded as the loader's
float32 product cast to bf16 where it is not (both round the exact value once). That is the
value the loader's dequantization stores for the default bf16 path
(`dequantize_weight_reference(...).to(bfloat16)`): so the products are that path's, on bf16
tensor cores with fp32 accumulation, while the weights stream half the bytes. (The first
decode, float32 from the bits with two exact products, took three times the instructions and
held the kernel at a third of the DRAM bandwidth; the interpreter keeps it, `_decoded`.) The
activations are not quantized (unlike `kernels.fp8_block_gemm`, whose products differ).

    grid (token tiles, weight-row tiles, K splits): program (m, n, s) computes the tile of
    BLOCK_M tokens × BLOCK_N weight rows over split s's K steps as outᵀ = W · xᵀ: the weight
    rows on the MMA's M side, the tokens on its N side, so a 16-token decode step is one
    m64n16 product per 16 columns of K

Split K (few weight-row tiles): each split's fp32 partial goes to a workspace; the tile's last
split to count itself done (one atomic add on `kernels.tile_counters`' per-device counters) sums
the partials in split order, stores the tile and puts its counter back to zero: one launch,
the same sums whatever order the splits finish in, replayable in a CUDA graph.

Grouped form (`groups` G, the attention's `wo_a`): x [M, G·K], W [G·N, K] → y [M, G·N] with
y[:, gN:(g+1)N] = x[:, gK:(g+1)K] · W[gN:(g+1)N]ᵀ.

NOTE: a scale byte 0 (2^-127) acts as 0 here (as in `kernels.fp8_block_gemm`): it only scales
tiles whose values are all below 448·2^-127. The scale bytes must be at most 254 (255 is NaN in
ue8m0).

NOTE: Triton's interpreter multiplies bf16 operands wrongly (`tests/kernels/interpreted.py`);
there the dot takes the weights rounded to bf16 by `kernels.rounding.round_to` as float32
values (the GPU's bf16 operands; the interpreter flushes float32 subnormals, so weights below
2^-126 differ there, not on the GPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting, multiprocessors
from kernels.fp8_block_gemm import dequantize_weight_reference
from kernels.rounding import round_to
from kernels.tile_counters import tile_counters

__all__ = [
    "CANDIDATES",
    "WeightGemmTiles",
    "choose_tiles",
    "dequantize_fp8_weight",
    "fp8_weight_gemm",
    "fp8_weight_gemm_reference",
]

BLOCK = 32  # the checkpoint's weight tile side (`weight_block_size`)
_TWO_TO_120 = tl.constexpr(2.0**120)
_INTERPRETING = interpreting()


@dataclass(frozen=True)
class WeightGemmTiles:
    """One launch's shape: BLOCK_M tokens × BLOCK_N weight rows per program, BLOCK_K columns per
    step (a multiple of 32), K cut into `splits` (0: as many as fill the GPU twice, at least
    four steps each), `num_warps`, `num_stages` (Triton's load pipelining)."""

    block_m: int
    block_n: int = 64
    block_k: int = 128
    splits: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        splits = f" k{self.splits}" if self.splits else ""
        return (
            f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} "
            f"s{self.num_stages}{splits}"
        )


# What `benchmarks/fp8_weight_gemm.py` times against cuBLAS on the dequantized bf16 weights.
CANDIDATES: tuple[WeightGemmTiles, ...] = tuple(
    WeightGemmTiles(block_m, block_n, 128, 0, warps, stages)
    for block_m in (16, 32, 64)
    for block_n, warps in ((64, 4), (128, 4), (128, 8))
    for stages in (2, 3, 4)
)


def choose_tiles(m: int) -> WeightGemmTiles:
    """The launch shape for M tokens: tokens fill the MMA's N side in tiles of up to 64. Timed
    (`benchmarks/fp8_weight_gemm.py --all`, H100): within 3 % of the fastest candidate at 16,
    32 and 64 tokens on every released shape but `wo_a` / `wo_b` at 16 (128 weight rows and 8
    warps: 4 % and 8 % faster there)."""
    return WeightGemmTiles(min(64, max(16, triton.next_power_of_2(max(m, 1)))))


@triton.jit
def _decoded(codes, biased):
    """float32 e4m3(codes) · 2^(biased − 127), exact: codes uint8, biased int32 (1..254; 0 → 0)."""
    c = codes.to(tl.int32)
    unit = (((c & 0x80) << 24) | ((c & 0x7F) << 20)).to(tl.float32, bitcast=True)  # · 2^-120
    return unit * _TWO_TO_120 * (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _per_weight(tiles, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N / 32, BLOCK_K / 32] values, one per 32 × 32 weight tile → [BLOCK_N, BLOCK_K]."""
    tiles = tl.broadcast_to(tiles[:, None, :, None], (BLOCK_N // 32, 32, BLOCK_K // 32, 32))
    return tl.reshape(tiles, (BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["M", "steps_per_split"])  # step-varying: one variant
def _fp8_weight_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    group_n,
    steps_per_split,
    stride_xm,
    stride_wn,
    stride_ws,
    stride_om,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_n = n < N
    in_m = m < M
    x_first = (pid_n * BLOCK_N // group_n) * K  # this tile's group of x columns
    scale_rows = (pid_n * BLOCK_N) // 32 + tl.arange(0, BLOCK_N // 32)
    in_scale_rows = scale_rows < tl.cdiv(N, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_first = split * steps_per_split * BLOCK_K
    for step in range(steps_per_split):
        k = k_first + step * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = k < K
        codes = tl.load(
            w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
            mask=in_n[:, None] & in_k[None, :],
            other=0,
        )
        scale_cols = (k_first + step * BLOCK_K) // 32 + tl.arange(0, BLOCK_K // 32)
        biased = tl.load(
            ws_ptr + scale_rows[:, None] * stride_ws + scale_cols[None, :],
            mask=in_scale_rows[:, None] & (scale_cols < tl.cdiv(K, 32))[None, :],
            other=0,
        )
        x = tl.load(
            x_ptr + m.to(tl.int64)[None, :] * stride_xm + (x_first + k)[:, None],
            mask=in_m[None, :] & in_k[:, None],
            other=0.0,
        )
        if DOT_BF16:  # e4m3 → bf16 (module docstring), times the tile's power of two in bf16
            power = (biased.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
            w = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            acc = tl.dot(w * _per_weight(power, BLOCK_N, BLOCK_K), x, acc)
        else:  # the interpreter: bf16 values, multiplied in float32 (module NOTE)
            w = _decoded(codes, _per_weight(biased.to(tl.int32), BLOCK_N, BLOCK_K))
            acc = tl.dot(round_to(w, tl.bfloat16), x.to(tl.float32), acc)
    out_offsets = m.to(tl.int64)[None, :] * stride_om + n[:, None]
    is_out = in_m[None, :] & in_n[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=is_out)
    else:
        partials = part_ptr + m.to(tl.int64)[None, :] * N + n[:, None]
        tl.store(partials + split.to(tl.int64) * M * N, acc, mask=is_out)
        tile = pid_m * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's partial stored before the (releasing) count
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            tl.store(counter_ptr + tile, 0)
            total = tl.load(partials, mask=is_out, other=0.0)
            for s in range(1, SPLITS):
                total += tl.load(partials + s * M * N, mask=is_out, other=0.0)
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=is_out)


@triton.jit
def _dequantize_kernel(
    w_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_ws, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROUND_IN_BITS: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    codes = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=mask, other=0)
    biased = tl.load(ws_ptr + (n // 32)[:, None] * stride_ws + (k // 32)[None, :], mask=mask)
    w = _decoded(codes, biased.to(tl.int32))
    w = round_to(w, tl.bfloat16) if ROUND_IN_BITS else w  # the interpreter truncates casts
    tl.store(out_ptr + n.to(tl.int64)[:, None] * K + k[None, :], w.to(tl.bfloat16), mask=mask)


def dequantize_fp8_weight(weight: Tensor, scale: Tensor) -> Tensor:
    """bf16 [N, K] of the stored weight (same arguments as `fp8_weight_gemm`), the values the
    kernel multiplies, in one launch: what a product with more rows than a decode step's takes
    before a bf16 GEMM.

    Raises:
        ValueError: as `fp8_weight_gemm` for the weight and its scales.
    """
    weight, scale = _weight_bytes(weight, scale)
    check_runnable(weight, "dequantize_fp8_weight")
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
        _dequantize_kernel[grid](
            weight, scale, out, n, k, weight.stride(0), scale.stride(0), BLOCK_N=64,
            BLOCK_K=128, ROUND_IN_BITS=_INTERPRETING,
        )  # fmt: skip
    return out


def _weight_bytes(weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, scale bytes) as uint8 views, checked: [N, K] codes with K a multiple of 32 and
    one scale per 32 × 32 tile, rows of unit column stride."""
    weight = weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight
    scale = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    if weight.dtype != torch.uint8 or scale.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError("weight and scale must be FP8 codes [N, K] and e8m0 bytes")
    if weight.stride(-1) != 1 or scale.dim() != 2 or scale.stride(-1) != 1:
        raise ValueError("weight and scale rows need unit column stride")
    total_n, k = weight.shape
    if k % BLOCK or tuple(scale.shape) != (triton.cdiv(total_n, BLOCK), k // BLOCK):
        raise ValueError(
            f"weight {tuple(weight.shape)} needs K % {BLOCK} == 0 and scales "
            f"{(triton.cdiv(total_n, BLOCK), k // BLOCK)}, got {tuple(scale.shape)}"
        )
    return weight, scale


def _splits(tiles: WeightGemmTiles, programs: int, steps: int, device: torch.device) -> int:
    """K splits: the tiles' own, or as many as give every multiprocessor two programs per
    tile of tokens (`programs`: weight-row tiles; a function of N alone, so the count, a
    constexpr, does not change with M within a row of `choose_tiles`: the warm-up's powers of
    two reach every compiled variant) while each split keeps four steps or more."""
    if tiles.splits:
        return max(1, min(tiles.splits, steps))
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(2 * multiprocessors(device), max(programs, 1))
    return max(1, min(wanted, steps // 4))


def fp8_weight_gemm(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    *,
    groups: int = 1,
    out_dtype: torch.dtype | None = None,
    tiles: WeightGemmTiles | None = None,
) -> Tensor:
    """y = x · Wᵀ per group (module docstring): x bf16 [..., G·K], weight float8_e4m3fn (or
    uint8 bytes) [G·N, K], scale float8_e8m0fnu (or uint8) [ceil(G·N/32), K/32] → out_dtype
    (default bf16) [..., G·N], fp32 accumulation, one rounding at the end. tiles: default
    `choose_tiles(M)`, with 32 weight rows per tile where groups of N/G rows need them.

    Raises:
        ValueError: shapes, dtypes or tiles the kernel cannot take, or not on CUDA (nor in
            Triton's interpreter).
    """
    weight, scale = _weight_bytes(weight, scale)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 (W8A16), got {x.dtype}")
    total_n, k = weight.shape
    group_n = total_n // max(groups, 1)
    if tiles is None:
        tiles = choose_tiles(x.numel() // max(x.shape[-1], 1))
        if groups > 1 and group_n % tiles.block_n:  # small groups: 32-row tiles
            tiles = dataclasses.replace(tiles, block_n=BLOCK)
    if tiles.block_k % BLOCK or tiles.block_n % BLOCK or tiles.block_m < 16:
        raise ValueError(f"tiles {tiles}: BLOCK_K and BLOCK_N multiples of 32, BLOCK_M >= 16")
    if groups < 1 or total_n % groups or (groups > 1 and group_n % tiles.block_n):
        raise ValueError(f"{groups} groups must split N = {total_n} into tiles' multiples")
    if x.shape[-1] != groups * k:
        raise ValueError(f"x's last dim {x.shape[-1]} != groups · K = {groups * k}")
    check_runnable(x, "fp8_weight_gemm")
    lead = x.shape[:-1]
    rows = x.reshape(-1, groups * k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, total_n, dtype=out_dtype or torch.bfloat16, device=x.device)
    if m and total_n:
        grid_mn = (triton.cdiv(m, tiles.block_m), triton.cdiv(total_n, tiles.block_n))
        steps = triton.cdiv(k, tiles.block_k)
        splits = _splits(tiles, grid_mn[1], steps, x.device)
        steps_per_split = triton.cdiv(steps, splits)
        splits = triton.cdiv(steps, steps_per_split)
        counters = tile_counters(x.device, grid_mn[0] * grid_mn[1]) if splits > 1 else None
        if counters is None:  # one split, or a capture outgrew the counters: no workspace
            splits, steps_per_split, partials, counters = 1, steps, out, out
        else:
            partials = torch.empty(splits, m, total_n, dtype=torch.float32, device=x.device)
        _fp8_weight_gemm_kernel[(*grid_mn, splits)](
            rows,
            weight,
            scale,
            out,
            partials,
            counters,
            m,
            total_n,
            k,
            group_n,
            steps_per_split,
            rows.stride(0),
            weight.stride(0),
            scale.stride(0),
            out.stride(0),
            SPLITS=splits,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k,
            DOT_BF16=not _INTERPRETING,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return out.reshape(*lead, total_n)


def fp8_weight_gemm_reference(x: Tensor, weight: Tensor, scale: Tensor, groups: int = 1) -> Tensor:
    """`fp8_weight_gemm` in plain torch: the weights dequantized and rounded to bf16 as the
    loader stores them for the bf16 path, the products and sums in float32. Returns float32
    [..., G·N]."""
    w = dequantize_weight_reference(weight, scale, BLOCK).to(torch.bfloat16).float()
    a = x.float().unflatten(-1, (groups, -1))  # [..., G, K]
    return torch.einsum("...gk,gnk->...gn", a, w.unflatten(0, (groups, -1))).flatten(-2)
