"""One hyper-connection site's whole mHC triplet in one launch, or two (`model.md` §3.2).

From the residual streams z = f32(R) [T, N·D] of each token (N streams of width D):

    mix    = (z · fnᵀ) · rsqrt(mean(z²) + norm_eps)                [T, 2N + N²]
    logits = fma(mix, scales, base)    scales = (s0 ×N, s1 ×N, s2 ×N²)
    (pre, post, comb) = `kernels.mhc_mix` of the logits

The torch version (`mhc_triplet_reference`, below) is ~8 launches before `mhc_mix`'s one.

    launch 1  programs (tile of BLOCK_T tokens, slice of split columns): read the slice of
              each row once, dots with fn's 2N + N² rows and Σ z² → partials
              [splits, T, MIX_PAD] (column 2N + N² holds Σ z²)
    launch 2  per tile of tokens: the partials summed in split order, rsqrt, the fused
              multiply-add, then `mhc_mix`'s gates and Sinkhorn (`mix_and_store`)

`one_launch` (the default where it can run) folds launch 2 into launch 1: each program, once
its partials are stored, counts itself done on its token tile's counter (one atomic add), and
the tile's last program to finish resets the counter and runs launch 2's work for the tile.
The sums are the same, in the same order: the outputs are bit for bit the two launches'. The
counters are one persistent int32 buffer per device (`tile_counters`), zero between launches
(each tile's last program puts its counter back), so a captured CUDA graph replays the launch
as it is. A launch whose tiles outgrow the buffer while a graph is being captured (where no
zeroed buffer can be made) takes the two launches.

Launch 1's dots run on tensor cores with fp32 accuracy (`TripletConfig.precision`): "bf16x6"
splits x and fn exactly into three bf16 parts each (hi + mid + lo, from the bits) and sums the
six products down to 2⁻¹⁶ of the whole; "tf32x3" is Triton's three-TF32 form; "ieee" the fp32
FMA loop on CUDA cores (slow: ~1.45 ms per call at 4,096 tokens on the H200). Each BLOCK_K chunk
is dotted from a zero accumulator and added to the fp32 sum on CUDA cores, so the tensor cores'
own (truncating) accumulation never spans more than BLOCK_K columns. The token tile, split
and warps come from `CONFIGS`, a table keyed by T (`benchmarks/mhc_tiles.py` times the
candidates): a row's sums depend on T's table row, so the kernel is not batch-invariant;
`--batch-invariant` takes the torch steps (`primitives.mhc_triplet`). The order of the fp32
sums differs from BLAS: pre / post / comb within ~1e-6 relative (norm) and ~60 ulps of the
torch path in the interpreter (exact products there; `tests/kernels/test_mhc_triplet.py` allows
5e-6 and 256, on the H200 for every table row too); `benchmarks/mhc_tiles.py` prints each
candidate's error against float64 and against the torch path on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting
from kernels.mhc_mix import mhc_mix_reference, mix_and_store
from kernels.tile_counters import tile_counters

__all__ = [
    "CONFIGS",
    "TripletConfig",
    "config_for",
    "mhc_logits_reference",
    "mhc_triplet",
    "mhc_triplet_reference",
]

PRECISIONS = ("bf16x6", "tf32x3", "ieee")
BLOCK_K = 64


@dataclass(frozen=True)
class TripletConfig:
    """Launch 1's shape: how its dots run (`PRECISIONS`), its token tile, the columns of N·D
    per program (the split), its warps. Launch 2 sums the cdiv(N·D, split_cols) partials."""

    precision: str
    block_t: int
    split_cols: int
    num_warps: int = 4
    # BLOCK_K chunks per loop step: independent dot chains (the same sums, the same bits)
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.block_t < 16 or self.block_t & (self.block_t - 1):
            raise ValueError(f"block_t must be a power of two >= 16, got {self.block_t}")
        if self.chunks < 1 or self.chunks & (self.chunks - 1):
            raise ValueError(f"chunks must be a power of two >= 1, got {self.chunks}")
        step = BLOCK_K * self.chunks
        if self.split_cols < step or self.split_cols % step:
            raise ValueError(f"split_cols must be a multiple of {step}, got {self.split_cols}")


_FINISH_BLOCK_T = 16  # launch 2's token tile (and the one launch's finishing sub-tiles)
# (largest T, config): the first row with T <= its bound runs; the last row takes every larger
# T. Chosen by `python3 benchmarks/mhc_tiles.py` on the H200 (2026-12-02, docs/performance.md):
# per site 53.9 / 53.8 / 64.4 / 206.7 µs at T = 16 / 64 / 256 / 4,096 (ieee: 63 / 81 / 134 /
# 1,477 µs), within 2e-6 of the torch path. Above 4,096 the 4,096 row (not timed there).
# Kept on the H100 (2026-12-07, sixth session): narrower splits and `chunks` did not move the
# site inside `gpu_rank`'s step (19 µs a site at 16 tokens in the graph; `do_bench` of one site
# at decode sizes is bound by the host's launch rate, ~25 µs).
CONFIGS: tuple[tuple[int, TripletConfig], ...] = (
    (256, TripletConfig("bf16x6", 16, 1024, 4)),
    (1 << 62, TripletConfig("bf16x6", 64, 1024, 4)),
)


def config_for(num_tokens: int) -> TripletConfig:
    """`CONFIGS`' row for T tokens."""
    return next(config for bound, config in CONFIGS if num_tokens <= bound)


@triton.jit
def _split_bf16(x):
    """fp32 x → (hi, mid, lo) bf16 with hi + mid + lo == x exactly: hi and mid keep the top 8
    significant bits (from the bits: no cast rounding, the same in the interpreter) and lo the
    at most 8 left."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    rest = x - hi
    mid = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return hi.to(tl.bfloat16), mid.to(tl.bfloat16), (rest - mid).to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, BF16_DOTS: tl.constexpr):
    """acc + a · b for bf16 parts; without BF16_DOTS (Triton's interpreter, whose bf16 dots
    are wrong) the same exact products from the parts as fp32."""
    if BF16_DOTS:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _chunk_dot(x, w, PRECISION: tl.constexpr, X_IS_BF16: tl.constexpr, BF16_DOTS: tl.constexpr):
    """fp32 x [BLOCK_T, BLOCK_K] · w [BLOCK_K, MIX_PAD] on tensor cores, from a zero
    accumulator (the caller adds it to its fp32 sum: the tensor cores' accumulation never runs
    over more than BLOCK_K columns)."""
    if PRECISION == "tf32x3":
        out = tl.dot(x, w, input_precision="tf32x3")
    else:
        # bf16x6: every product of the parts down to 2⁻¹⁶ of the whole, the small ones first
        w0, w1, w2 = _split_bf16(w)
        x0, x1, x2 = _split_bf16(x)
        out = _dot(x0, w2, tl.zeros((x.shape[0], w.shape[1]), tl.float32), BF16_DOTS)
        if not X_IS_BF16:  # a bf16 x is its own hi part: mid = lo = 0
            out = _dot(x2, w0, out, BF16_DOTS)
            out = _dot(x1, w1, out, BF16_DOTS)
            out = _dot(x1, w0, out, BF16_DOTS)
        out = _dot(x0, w1, out, BF16_DOTS)
        out = _dot(x0, w0, out, BF16_DOTS)
    return out


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])  # step-varying: one variant
def _mhc_partials_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    num_tokens,
    width,
    counter_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_splits,
    inv_width,
    norm_eps,
    hc_eps,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_DOTS: tl.constexpr,
    ONE_LAUNCH: tl.constexpr,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    FINISH_BLOCK_T: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    is_token = t < num_tokens
    m = tl.arange(0, MIX_PAD)
    rows = x_ptr + t[:, None].to(tl.int64) * width
    weights = fn_ptr + m[None, :].to(tl.int64) * width
    dots = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, SPLIT, BLOCK_K * CHUNKS):
        # CHUNKS chunks per step: their dots are independent chains (each from zero), added to
        # the sums in column order, so the bits do not depend on CHUNKS
        for c in tl.static_range(CHUNKS):
            k = split * SPLIT + k0 + c * BLOCK_K + tl.arange(0, BLOCK_K)
            in_row = k < width
            x = tl.load(rows + k[None, :], mask=is_token[:, None] & in_row[None, :], other=0.0)
            x = x.to(tl.float32)
            w = tl.load(weights + k[:, None], mask=(m[None, :] < MIX) & in_row[:, None], other=0.0)
            w = w.to(tl.float32)
            if PRECISION == "ieee":
                dots = tl.dot(x, w, dots, input_precision="ieee")
            else:
                is_bf16 = x_ptr.dtype.element_ty == tl.bfloat16
                dots += _chunk_dot(x, w, PRECISION, is_bf16, BF16_DOTS)
            squares += tl.sum(x * x, axis=1)
    dots = tl.where(m[None, :] == MIX, squares[:, None], dots)
    out = (split.to(tl.int64) * num_tokens + t[:, None]) * MIX_PAD + m[None, :]
    tl.store(part_ptr + out, dots, mask=is_token[:, None])
    if ONE_LAUNCH:
        tile = tl.program_id(0)
        tl.debug_barrier()  # every thread's partials stored before the (releasing) count
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            tl.store(counter_ptr + tile, 0)
            # in launch 2's tiles of FINISH_BLOCK_T tokens: the Sinkhorn's sums over N are
            # laid out (and so associated) by the tile's shape
            for sub in tl.static_range(BLOCK_T // FINISH_BLOCK_T):
                ts = tile * BLOCK_T + sub * FINISH_BLOCK_T + tl.arange(0, FINISH_BLOCK_T)
                _finish_tile(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, ts,
                             ts < num_tokens, num_tokens, num_splits, inv_width, norm_eps,
                             hc_eps, ITERS, N, MIX_PAD, FINISH_BLOCK_T)  # fmt: skip


@triton.jit
def _finish_tile(
    part_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    t,
    is_token,
    num_tokens,
    num_splits,
    inv_width,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Launch 2's work for the tokens `t`: their partials summed in split order, then the
    gates and Sinkhorn, stored. The loads skip L1 (`.cg`): in one launch the partials were
    written by other programs of the same grid."""
    i = tl.arange(0, N)
    # comb as [BLOCK_T, N²] (row j, column i at j·N + i) until the Sinkhorn: a token's cells
    # contiguous in one warp, so that the Sinkhorn's sums over j and over i stay in the warp
    # (as [BLOCK_T, N, N] the compiler spread j over the warps: shared memory and a barrier
    # per sum)
    cell = 2 * N + tl.arange(0, N * N)
    row = part_ptr + t.to(tl.int64) * MIX_PAD
    split_stride = tl.full((), MIX_PAD, tl.int64) * num_tokens  # num_tokens may be a constexpr 1
    pre = tl.zeros((BLOCK_T, N), dtype=tl.float32)
    post = tl.zeros((BLOCK_T, N), dtype=tl.float32)
    comb = tl.zeros((BLOCK_T, N * N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # NOTE: summed one split after another, in split order (no atomics, no tree: loading 16
    # splits per step as one [16, BLOCK_T, N, N] tree made the launch 3x slower on the H200, 40
    # vs 12 µs per site at 64 tokens, `gpu_rank --profile`, 2026-12-02). Sixteen splits' loads
    # per loop step, all issued before their sums wait on them (one step's latency, not
    # sixteen); a split past the last reads zeros, and a sum that starts at +0 is unchanged by
    # adding +0, so the bits are those of the plain split-order loop.
    for split in range(0, num_splits, 16):
        for quad in tl.static_range(4):
            pre, post, comb, squares = _add_four_splits(
                pre, post, comb, squares, row + (split + 4 * quad) * split_stride, split_stride,
                num_splits - split - 4 * quad, i, cell, is_token, N,
            )  # fmt: skip
    r = tl.rsqrt(squares * inv_width + norm_eps)
    # mix = dots · r, rounded, then one fused multiply-add, as the released kernel rounds it
    pre = tl.fma(
        pre * r[:, None],
        tl.load(scale_ptr).to(tl.float32),
        tl.load(base_ptr + i).to(tl.float32)[None, :],
    )
    post = tl.fma(
        post * r[:, None],
        tl.load(scale_ptr + 1).to(tl.float32),
        tl.load(base_ptr + N + i).to(tl.float32)[None, :],
    )
    comb = tl.fma(
        comb * r[:, None],
        tl.load(scale_ptr + 2).to(tl.float32),
        tl.load(base_ptr + cell).to(tl.float32)[None, :],
    )
    comb = tl.reshape(comb, (BLOCK_T, N, N))
    mix_and_store(pre, post, comb, t, is_token, pre_ptr, post_ptr, comb_ptr, hc_eps, ITERS, N)


@triton.jit
def _add_four_splits(
    pre, post, comb, squares, p, split_stride, splits_left, i, cell, is_token, N: tl.constexpr
):
    """The sums plus the partials of the four splits from `p` on, in their order; splits at or
    past `splits_left` read as zeros. The loads skip L1 (`.cg`): in one launch the partials were
    written by other programs of the same grid."""
    args = (p, split_stride, splits_left, i, cell, is_token, N)
    pre0, post0, comb0, squares0 = _split_partials(0, *args)
    pre1, post1, comb1, squares1 = _split_partials(1, *args)
    pre2, post2, comb2, squares2 = _split_partials(2, *args)
    pre3, post3, comb3, squares3 = _split_partials(3, *args)
    pre = pre + pre0 + pre1 + pre2 + pre3
    post = post + post0 + post1 + post2 + post3
    comb = comb + comb0 + comb1 + comb2 + comb3
    squares = squares + squares0 + squares1 + squares2 + squares3
    return pre, post, comb, squares


@triton.jit
def _split_partials(
    index: tl.constexpr, p, split_stride, splits_left, i, cell, is_token, N: tl.constexpr
):
    """Split `index`'s pre [T, N], post [T, N], comb [T, N²] and Σ z² [T] partials (rows
    `p` + index · split_stride), zeros if index >= splits_left."""
    p += index * split_stride
    # per token, not a scalar: the interpreter takes no 0-d mask operand
    live = is_token & (tl.zeros_like(is_token.to(tl.int32)) + index < splits_left)
    pre = tl.load(p[:, None] + i[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    post = tl.load(p[:, None] + N + i[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    comb = tl.load(p[:, None] + cell[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
    squares = tl.load(p + (2 * N + N * N), mask=live, other=0.0, cache_modifier=".cg")
    return pre, post, comb, squares


@triton.jit(do_not_specialize=["num_tokens"])  # step-varying: one variant
def _mhc_finish_kernel(
    part_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    num_splits,
    inv_width,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _finish_tile(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, t, t < num_tokens,
                 num_tokens, num_splits, inv_width, norm_eps, hc_eps, ITERS, N, MIX_PAD,
                 BLOCK_T)  # fmt: skip


def mhc_triplet(
    residual: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    config: TripletConfig | None = None,
    one_launch: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_triplet_reference` in one launch (`one_launch`, where its counters are at hand;
    module docstring) or two, bit for bit the same: residual [T, N, D] (any float dtype), fn
    [2N + N², N·D], base [2N + N²], scale [3] → fp32 pre [T, N], post [T, N], comb [T, N, N].
    config: launch 1's shape (default `config_for(T)`).

    Raises:
        ValueError: shapes that do not fit together, N not a power of two, iters < 1, or not
            on CUDA (nor in Triton's interpreter).
    """
    if residual.dim() != 3 or not residual.dtype.is_floating_point:
        raise ValueError(f"residual must be float [T, N, D], got {residual.dtype} {residual.shape}")
    num_tokens, n, d = residual.shape
    mix = 2 * n + n * n
    if fn.shape != (mix, n * d) or base.shape != (mix,) or scale.shape != (3,):
        shapes = tuple(fn.shape), tuple(base.shape), tuple(scale.shape)
        raise ValueError(f"fn, base, scale must be [{mix}, {n * d}], [{mix}], [3], got {shapes}")
    if n < 1 or n & (n - 1) or iters < 1:
        raise ValueError(f"n must be a power of two and iters >= 1, got n={n}, iters={iters}")
    check_runnable(residual, "mhc_triplet")
    device = residual.device
    pre = torch.empty(num_tokens, n, dtype=torch.float32, device=device)
    post = torch.empty_like(pre)
    comb = torch.empty(num_tokens, n, n, dtype=torch.float32, device=device)
    if not num_tokens:
        return pre, post, comb
    config = config or config_for(num_tokens)
    width = n * d
    mix_pad = max(16, triton.next_power_of_2(mix + 1))
    step = BLOCK_K * config.chunks
    split = min(config.split_cols, triton.cdiv(width, step) * step)
    num_splits = triton.cdiv(width, split)
    num_tiles = triton.cdiv(num_tokens, config.block_t)
    counters = tile_counters(device, num_tiles) if one_launch else None
    partials = torch.empty(num_splits, num_tokens, mix_pad, dtype=torch.float32, device=device)
    x = residual.reshape(num_tokens, width).contiguous()
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    # torch's mean multiplies the sum by the fp32 reciprocal of the count: the float64 1/width
    # rounds to it (no double-rounding tie for integers below 2²⁴), as Triton passes it as fp32
    inv_width = 1.0 / width
    _mhc_partials_kernel[(num_tiles, num_splits)](
        x,
        fn,
        partials,
        num_tokens,
        width,
        partials if counters is None else counters,
        base,
        scale,
        pre,
        post,
        comb,
        num_splits,
        inv_width,
        norm_eps,
        hc_eps,
        MIX=mix,
        MIX_PAD=mix_pad,
        BLOCK_T=config.block_t,
        BLOCK_K=BLOCK_K,
        SPLIT=split,
        PRECISION=config.precision,
        BF16_DOTS=not interpreting(),
        ONE_LAUNCH=counters is not None,
        ITERS=iters,
        N=n,
        FINISH_BLOCK_T=_FINISH_BLOCK_T,
        CHUNKS=config.chunks,
        num_warps=config.num_warps,
    )
    if counters is not None:
        return pre, post, comb
    _mhc_finish_kernel[(triton.cdiv(num_tokens, _FINISH_BLOCK_T),)](
        partials,
        base,
        scale,
        pre,
        post,
        comb,
        num_tokens,
        num_splits,
        inv_width,
        norm_eps,
        hc_eps,
        ITERS=iters,
        N=n,
        MIX_PAD=mix_pad,
        BLOCK_T=_FINISH_BLOCK_T,
        num_warps=config.num_warps,  # the one launch's: the same layouts
    )
    return pre, post, comb


def mhc_logits_reference(mix: Tensor, base: Tensor, scale: Tensor, n: int) -> Tensor:
    """fp32 `mix · scales + base` [T, 2N + N²] with one rounding (scales: s0 for the N pre
    columns, s1 for the N post columns, s2 for the N² comb columns)."""
    scale = scale.float()
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    # One fused multiply-add, as the released kernel rounds it.
    return torch.addcmul(base.float(), mix, scales)


def mhc_triplet_reference(
    residual: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_triplet` in plain torch (BLAS's matmul, torch's mean)."""
    n = residual.shape[1]
    z = residual.flatten(1).float()
    mix = F.linear(z, fn.float()) * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)
    return mhc_mix_reference(mhc_logits_reference(mix, base, scale, n), n, hc_eps, iters)
