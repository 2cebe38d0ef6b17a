"""FP8 dense GEMM with the checkpoint's block-scaled weights (`model.md` §2.3, §5.4):

    y[m, n] = Σ_kb  sx[m, kb] · sw[n // B, kb] · Σ_{k in block kb} e4m3(xq[m, k]) · e4m3(W8[n, k])

W stays as stored: float8_e4m3fn [N, K] plus one ue8m0 (power-of-two) scale per B×B tile
(B = `weight_block_size`, 32 in V4.1). Activations are quantized per (row, B-column group) to
e4m3 with a ue8m0 scale, the MXFP8 rule of the window rows (`s = 2^e`, e the smallest integer
with amax ≤ 448·2^e, clamped to [-127, 127]; codes round to nearest even; all-zero groups take
e = -127). Every B-wide slab of K is one FP8 tensor-core product (fp32 result, `tl.dot` on
float8e4nv operands: wgmma on sm90) that is scaled and added into an fp32 accumulator, so the
tensor core's reduced-precision accumulation never spans more than B products. Below 64 rows
per tile Triton emits `mma.sync` on f16 instead (e4m3 → f16 is exact; the same products), which
the weight-bound small-M launches can afford (`tests/kernels/test_fp8_block_gemm.py` compiles
both for sm90 without a GPU and checks the PTX).

Two inputs: activations already quantized (`quantize_activations`, or a producer that emits
codes and scales), or float activations quantized inside the GEMM's K loop (QUANTIZE_A: one
launch, no FP8 copy of x in memory; each N tile re-quantizes the same [BLOCK_M, B] slab, which
costs ~10 ALU operations per element against BLOCK_N multiply-adds).

Grouped form (`groups` G): x [M, G·K], W [G·N, K] → y [M, G·N] with
y[:, gN:(g+1)N] = x[:, gK:(g+1)K] · W[gN:(g+1)N]ᵀ (the attention's `wo_a`, 8 groups).

NOTE: a ue8m0 byte 0 (2^-127) acts as 0 here. It only scales blocks whose values are all below
448·2^-127 (canonical all-zero weight tiles, rows of zeros), so products differ by < 1e-35.

NOTE: Triton's CPU interpreter rounds float32 → float8e4nv wrongly when rounding carries into
the exponent (31.6 → 16). The quantizer therefore rounds in float32 arithmetic (`_e4m3_rne`:
exact power-of-two rescaling and the 1.5·2^23 round-to-even trick) and casts only values that
are already on the e4m3 grid; on the GPU that costs a handful of ALU operations per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = [
    "GemmConfig",
    "default_config",
    "dequantize_weight_reference",
    "fp8_block_gemm",
    "fp8_block_gemm_reference",
    "quantize_activations",
    "quantize_activations_reference",
]

E4M3_MAX = 448.0
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 · 2^23: (t + M) − M rounds 0 ≤ t < 2^22 to even


# ---- shared device functions ------------------------------------------------------------------


@triton.jit
def _group_exponent(amax):
    """Smallest e with amax ≤ 448·2^e, clamped to [-127, 127] (448 = 1.75·2^8: read off the bits
    of amax, no division)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    above = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(exponent - 8 + above, -127), 127)


@triton.jit
def _pow2(exponent):
    """2^e as float32 for integer e in [-126, 127] (exact; bits)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(y):
    """Round float32 y (|y| ≤ 448) to the nearest e4m3 value, ties to even, in float32."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3  # e4m3: 3 mantissa bits, subnormals below 2^-6
    t = tl.abs(y) * _pow2(-ulp_exponent)
    t = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    r = tl.minimum(t * _pow2(ulp_exponent), 448.0)
    # the sign by its bit: compiled, `-r` is 0 − r, which turns −0 into +0 (the reference's
    # cast keeps −0: code 0x80)
    sign = bits & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_slab(x):
    """float32 [R, B] → (e4m3 codes [R, B], int32 biased exponents [R]) per row."""
    exponent = _group_exponent(tl.max(tl.abs(x), axis=1))
    inv = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^-e, e in [-127, 127]
    codes = _e4m3_rne(x * inv[:, None]).to(tl.float8e4nv)
    return codes, exponent + 127


@triton.jit
def _scale_of(biased):
    """ue8m0 byte (int32) → 2^(b-127) as float32; byte 0 → 0 (module NOTE)."""
    return (biased << 23).to(tl.float32, bitcast=True)


# ---- activation quantization ------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])  # step-varying: one variant
def _quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, num_rows, width, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    in_rows = rows < num_rows
    offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=in_rows[:, None], other=0.0).to(tl.float32)
    codes, biased = quantize_slab(x)
    tl.store(codes_ptr + offsets, codes, mask=in_rows[:, None])
    groups = width // BLOCK
    tl.store(scale_ptr + rows.to(tl.int64) * groups + group, biased.to(tl.uint8), mask=in_rows)


def quantize_activations(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """x float [..., K] → (float8_e4m3fn codes [..., K], float8_e8m0fnu scales [..., K/block]).

    Raises:
        ValueError: K not a multiple of `block`, block not a power of two ≥ 16, or not on CUDA
            (or Triton's interpreter).
    """
    width = x.shape[-1]
    _check_block(block)
    if width % block:
        raise ValueError(f"the last dim ({width}) must be a multiple of the block ({block})")
    check_runnable(x, "quantize_activations")
    x = x.contiguous()
    num_rows = x.numel() // max(width, 1)
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], width // block), dtype=torch.uint8, device=x.device)
    if num_rows and width:
        rows = 16
        _quantize_kernel[(triton.cdiv(num_rows, rows), width // block)](
            x, codes, scales, num_rows, width, BLOCK=block, ROWS=rows
        )
    return codes, scales.view(torch.float8_e8m0fnu)


def quantize_activations_reference(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """`quantize_activations` in plain torch (same rule, same bytes)."""
    groups = x.float().unflatten(-1, (-1, block))
    bits = groups.abs().amax(-1).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32) - 8
    exponent = exponent.clamp(-127, 127)
    inv = torch.ldexp(torch.ones_like(groups[..., 0]), -exponent)
    codes = (groups * inv[..., None]).to(torch.float8_e4m3fn).flatten(-2)
    return codes, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


# ---- GEMM -------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "blocks_per_split", "stride_os"])  # step-varying: one variant
def _fp8_block_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    blocks_per_split,
    stride_am,
    stride_asm,
    stride_wsn,
    stride_os,
    stride_om,
    QUANTIZE_A: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid: (split_k · row tiles, column tiles, groups)
    row_tiles = tl.cdiv(M, BLOCK_M)
    split = tl.program_id(0) // row_tiles
    pid_m = tl.program_id(0) % row_tiles
    pid_n = tl.program_id(1)
    group = tl.program_id(2)
    num_k_blocks = K // BLOCK
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < M
    in_cols = cols < N
    w_rows = (group * N + cols).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_k_blocks)
    a_cols = group * K + first * BLOCK + ks
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + a_cols[None, :]
    w_ptrs = w_ptr + w_rows[None, :] * K + (first * BLOCK + ks)[:, None]
    as_ptrs = a_scale_ptr + rows.to(tl.int64) * stride_asm + group * num_k_blocks + first
    ws_ptrs = w_scale_ptr + (w_rows // BLOCK) * stride_wsn + first
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(first, last):
        if QUANTIZE_A:
            a = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0).to(tl.float32)
            a, a_biased = quantize_slab(a)
        else:
            a = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0)
            a_biased = tl.load(as_ptrs, mask=in_rows, other=0).to(tl.int32)
        w = tl.load(w_ptrs, mask=in_cols[None, :], other=0.0)
        w_biased = tl.load(ws_ptrs, mask=in_cols, other=0).to(tl.int32)
        partial = tl.dot(a, w, out_dtype=tl.float32)
        scale = _scale_of(a_biased)[:, None] * _scale_of(w_biased)[None, :]
        acc += partial * scale
        a_ptrs += BLOCK
        w_ptrs += BLOCK
        as_ptrs += 1
        ws_ptrs += 1
    out_ptrs = (
        out_ptr
        + split.to(tl.int64) * stride_os
        + rows.to(tl.int64)[:, None] * stride_om
        + (group * N + cols)[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of one launch: BLOCK_M × BLOCK_N outputs per program, K split `split_k` ways
    (partial sums in fp32, added in a fixed order), `num_warps`, `num_stages` (pipelining)."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int, n: int, k: int, block: int = 32) -> GemmConfig:
    """A tile shape for an M×N×K product by size class (NOTE: not yet tuned on the H200;
    `benchmarks/kernel_speed.py --only fp8_gemm fp8_tiles` measures them and the candidates).
    Small M is bound by the weight bytes: narrow N tiles and a K split give every
    multiprocessor a share of W."""
    if m <= 16:
        block_m, block_n = 16, 64
    elif m <= 64:
        block_m, block_n = 64, 64
    elif m <= 256:
        block_m, block_n = 64, 128
    else:
        return GemmConfig(128, 128, 1, num_warps=8, num_stages=4)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = max(1, min(k // block // 8, 264 // max(tiles, 1)))
    return GemmConfig(block_m, block_n, split_k)


def fp8_block_gemm(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    *,
    block: int = 32,
    groups: int = 1,
    x_scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> Tensor:
    """y = x · Wᵀ per group (module docstring) on FP8 tensor cores.

    Args:
        x: [..., G·K] float activations (quantized inside the kernel), or float8_e4m3fn codes
            with `x_scale` (float8_e8m0fnu or uint8 [..., G·K/block], `quantize_activations`).
        weight: float8_e4m3fn (or uint8 bytes) [G·N, K], the checkpoint's stored weight.
        scale: float8_e8m0fnu (or uint8) [ceil(G·N/block), K/block], its stored tile scales.
        block: the checkpoint's `weight_block_size` (tile side; also the activation group).
        groups: G; N must then be a multiple of `block` so that groups own whole tiles.
        out_dtype: default x's dtype (bfloat16 for FP8 codes).
        config: tile shape; default `default_config`.
    Returns:
        out_dtype [..., G·N] (fp32 accumulation, one rounding at the end).
    Raises:
        ValueError: shapes, dtypes or strides the kernel cannot take, or not on CUDA.
    """
    _check_block(block)
    weight = _as_bytes_view(weight, torch.float8_e4m3fn, "weight")
    w_scale = _as_bytes_view(scale, torch.uint8, "scale")
    total_n, k = weight.shape
    if groups < 1 or total_n % groups or (groups > 1 and (total_n // groups) % block):
        raise ValueError(f"{groups} groups must split N={total_n} into multiples of {block}")
    n = total_n // groups
    if k % block or tuple(w_scale.shape) != (triton.cdiv(total_n, block), k // block):
        raise ValueError(
            f"weight {tuple(weight.shape)} with block {block} needs K % block == 0 and scales "
            f"{(triton.cdiv(total_n, block), k // block)}, got {tuple(w_scale.shape)}"
        )
    if x.shape[-1] != groups * k:
        raise ValueError(f"x's last dim {x.shape[-1]} != groups · K = {groups * k}")
    quantize_a = x_scale is None
    if quantize_a and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"float activations (or FP8 codes with x_scale) expected, got {x.dtype}")
    check_runnable(x, "fp8_block_gemm")
    lead = x.shape[:-1]
    a = x.reshape(-1, groups * k).contiguous()
    m = a.shape[0]
    if quantize_a:
        a_scale = a  # unused
    else:
        a = _as_bytes_view(a, torch.float8_e4m3fn, "x")
        a_scale = _as_bytes_view(x_scale, torch.uint8, "x_scale").reshape(m, -1).contiguous()
        if a_scale.shape[1] != groups * k // block:
            raise ValueError(f"x_scale needs {groups * k // block} groups per row")
    out_dtype = out_dtype or (x.dtype if quantize_a else torch.bfloat16)
    config = config or default_config(m, n, k, block)
    num_k_blocks = k // block
    split_k = max(1, min(config.split_k, num_k_blocks))
    blocks_per_split = triton.cdiv(num_k_blocks, split_k)
    split_k = triton.cdiv(num_k_blocks, blocks_per_split)
    partial_dtype = out_dtype if split_k == 1 else torch.float32
    out = torch.empty((split_k, m, total_n), dtype=partial_dtype, device=x.device)
    if m and total_n:
        grid = (
            split_k * triton.cdiv(m, config.block_m),
            triton.cdiv(n, config.block_n),
            groups,
        )
        _fp8_block_gemm_kernel[grid](
            a,
            a_scale,
            weight,
            w_scale,
            out,
            m,
            n,
            k,
            blocks_per_split,
            a.stride(0),
            a_scale.stride(0),
            w_scale.stride(0),
            out.stride(0),
            out.stride(1),
            QUANTIZE_A=quantize_a,
            BLOCK=block,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    y = out[0] if split_k == 1 else out.sum(0).to(out_dtype)
    return y.reshape(*lead, total_n)


# ---- torch reference --------------------------------------------------------------------------


def dequantize_weight_reference(weight: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """float32 W[i, j] = e4m3(W8[i, j]) · 2^(S[i // block, j // block] − 127)."""
    values = _as_bytes_view(weight, torch.float8_e4m3fn, "weight").float()
    exponent = _as_bytes_view(scale, torch.uint8, "scale").to(torch.int32) - 127
    n, k = values.shape
    tile = exponent.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return torch.ldexp(values, tile)


def fp8_block_gemm_reference(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    *,
    block: int = 32,
    groups: int = 1,
    x_scale: Tensor | None = None,
) -> Tensor:
    """`fp8_block_gemm` in plain torch: quantize x (unless given as codes + `x_scale`) with
    `quantize_activations_reference`, dequantize both operands, multiply in float32.
    Returns float32 [..., G·N]."""
    if x_scale is None:
        codes, x_scale = quantize_activations_reference(x, block)
    else:
        codes = x
    values = _as_bytes_view(codes, torch.float8_e4m3fn, "x").float().unflatten(-1, (-1, block))
    exponent = _as_bytes_view(x_scale, torch.uint8, "x_scale").to(torch.int32) - 127
    a = torch.ldexp(values, exponent[..., None]).flatten(-2)
    w = dequantize_weight_reference(weight, scale, block)
    a = a.unflatten(-1, (groups, -1))  # [..., G, K]
    w = w.unflatten(0, (groups, -1))  # [G, N, K]
    return torch.einsum("...gk,gnk->...gn", a, w).flatten(-2)


# ---- helpers ----------------------------------------------------------------------------------


def _check_block(block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")


def _as_bytes_view(t: Tensor, dtype: torch.dtype, what: str) -> Tensor:
    """`t` reinterpreted as `dtype` (float8_e4m3fn codes or uint8 exponent bytes), same bits."""
    allowed = {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8}
    if t.dtype not in allowed:
        raise ValueError(f"{what}: expected FP8 codes or e8m0/uint8 bytes, got {t.dtype}")
    return t if t.dtype == dtype else t.view(dtype)
