"""mHC residual update of one site in one launch (`model.md` §3.2):

    R'[t, i, :] = post[t, i] · y[t, :] + Σ_j comb[t, j, i] · R[t, j, :]   (fp32, cast to R's dtype)

The torch version (`mhc_post_reference`, below) materialises the
[T, N, N, D] fp32 products (1.3 GB for a 4K-token chunk at D = 5120) over ~7 launches; here each
program reads its token's N rows of R and y once and writes N rows of R'.

`mhc_post_combine_norm` also forms the next sublayer's input from R' in the same launch:
`rms_norm(mhc_combine(R', w), norm_weight)` (`kernels.mhc_combine.mhc_combine_norm`, bit for
bit: one program per whole row, the same chains and the same reduction), one launch instead of
two where a block's FFN input follows its attention update; with `kernel_order`, a second copy
of that input with each 128 columns in the grouped MXFP4 GEMM's K order, which its decode tiles
read as it is (`grouped_mxfp4_gemm(x_kernel_order=True)`: no reordering copy there).

`mhc_post(..., slots=)` takes an FFN's y unreduced, as the MoE layer leaves it (its shared
expert's output and the routed experts' weighted slots, `kernels.moe_combine`), and forms
`moe_combine(y, slots)` in the same launch, bit for bit: one launch and a [T, D] round trip
fewer per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.grouped_mxfp4_gemm import _kernel_order
from kernels.moe_combine import check_parts, moe_combine_reference
from kernels.rms_norm import MAX_WIDTH, inv_rms, norm_warps
from kernels.rounding import round_to

__all__ = ["mhc_post", "mhc_post_combine_norm", "mhc_post_reference"]

_BLOCK_D = 512


@triton.jit
def _updated_stream(residual_ptr, post_ptr, comb_ptr, y, token, d, in_row, dim, i,
                    N: tl.constexpr):  # fmt: skip
    """fp32 `post[i] · y + Σ_j comb[j, i] · R[j]` of one token over the columns d, as one fixed
    chain: comb[0, i]·R[0], a fused multiply-add per further source stream j in order, then
    fma(post[i], y, ·). No plain add of products is left for the compiler to contract its own
    way, so both kernels here get the same bits for a column (`mhc_combine._combine_streams`'
    NOTE)."""
    rows = residual_ptr + token * N * dim + d
    comb = comb_ptr + token * N * N + i  # comb[t, j, i] at j · N + i
    acc = tl.load(comb) * tl.load(rows, mask=in_row, other=0.0).to(tl.float32)
    for j in tl.static_range(1, N):
        r = tl.load(rows + j * dim, mask=in_row, other=0.0).to(tl.float32)
        acc = tl.fma(r, tl.load(comb + j * N), acc)
    return tl.fma(y, tl.load(post_ptr + token * N + i), acc)


@triton.jit
def _mhc_post_kernel(
    residual_ptr,
    post_ptr,
    comb_ptr,
    y_ptr,
    slots_ptr,
    out_ptr,
    dim,
    N: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """TOP_K > 0: y is a MoE layer's shared output and its update input is
    `moe_combine(y, slots)`, formed here as that kernel forms it: the slots added in slot
    order from 0.0, the shared output added, one rounding to the model dtype."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = d < dim
    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + token * dim + d, mask=in_row, other=0.0).to(tl.float32)
    if TOP_K > 0:
        total = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(slots_ptr + (token * TOP_K + j) * dim + d, mask=in_row, other=0.0)
        y_dtype = y_ptr.dtype.element_ty  # moe_combine's output dtype: the shared output's
        y = round_to(y + total, y_dtype).to(y_dtype).to(tl.float32)
    for i in tl.static_range(N):
        out = _updated_stream(residual_ptr, post_ptr, comb_ptr, y, token, d, in_row, dim, i, N)
        tl.store(out_ptr + token * N * dim + i * dim + d, round_to(out, dtype).to(dtype),
                 mask=in_row)  # fmt: skip


@triton.jit
def _mhc_post_combine_norm_kernel(
    residual_ptr,
    post_ptr,
    comb_ptr,
    y_ptr,
    out_ptr,
    weights_ptr,
    norm_ptr,
    x_ptr,
    x_kernel_order_ptr,
    dim,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    KERNEL_ORDER: tl.constexpr,
):
    """One token's whole row: R' as `_mhc_post_kernel` stores it, then the combination of the
    rounded R' rows as `mhc_combine._combine_streams` chains it (w₀·r₀, then a fused
    multiply-add per stream) and `rms_norm`'s steps as `_mhc_combine_norm_kernel` takes them
    (`inv_rms` over the same [BLOCK] row, rms_norm's num_warps). KERNEL_ORDER: the normed row
    stored a second time, each 128 columns in the grouped GEMM's K order (`_kernel_order`)."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_row = d < dim
    dtype = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + token * dim + d, mask=in_row, other=0.0).to(tl.float32)
    weights = weights_ptr + token * N
    r = round_to(
        _updated_stream(residual_ptr, post_ptr, comb_ptr, y, token, d, in_row, dim, 0, N), dtype
    )
    tl.store(out_ptr + token * N * dim + d, r.to(dtype), mask=in_row)
    x = tl.load(weights) * r
    for i in tl.static_range(1, N):
        r = round_to(
            _updated_stream(residual_ptr, post_ptr, comb_ptr, y, token, d, in_row, dim, i, N),
            dtype,
        )
        tl.store(out_ptr + token * N * dim + i * dim + d, r.to(dtype), mask=in_row)
        x = tl.fma(r, tl.load(weights + i), x)
    x = round_to(x, dtype)
    normed = x * inv_rms(x, dim, eps)
    normed = normed * tl.load(norm_ptr + d, mask=in_row, other=0.0).to(tl.float32)
    normed = round_to(normed, dtype).to(dtype)
    tl.store(x_ptr + token * dim + d, normed, mask=in_row)
    if KERNEL_ORDER:
        tl.store(x_kernel_order_ptr + token * dim + _kernel_order(d), normed, mask=in_row)


def _check(residual: Tensor, post: Tensor, comb: Tensor, y: Tensor) -> None:
    num_tokens, n, dim = residual.shape
    if n < 1 or n & (n - 1) or y.shape != (num_tokens, dim):
        raise ValueError(f"need residual [T, N, D] with N a power of two and y [T, D]; got "
                         f"{tuple(residual.shape)}, {tuple(y.shape)}")  # fmt: skip
    if post.shape != (num_tokens, n) or comb.shape != (num_tokens, n, n):
        raise ValueError(f"post must be [T, {n}] and comb [T, {n}, {n}]")
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError("post and comb must be fp32")


def mhc_post(
    residual: Tensor, post: Tensor, comb: Tensor, y: Tensor, slots: Tensor | None = None
) -> Tensor:
    """`mhc_post_reference` in one launch.

    residual [T, N, D] and y [T, D] in the model dtype; post fp32 [T, N]; comb fp32 [T, N, N].
    slots: a MoE layer's weighted routed outputs, fp32 [T, k, D]; y is then its shared
    expert's output and the update takes `moe_combine(y, slots)` as its y, bit for bit, in
    the same launch (no [T, D] round trip, one launch fewer).

    Raises:
        ValueError: shapes or dtypes other than those, N not a power of two, or not on CUDA.
    """
    _check(residual, post, comb, y)
    if slots is not None:
        _check_slots(slots, y)
    check_runnable(residual, "mhc_post")
    num_tokens, n, dim = residual.shape
    residual, y = residual.contiguous(), y.contiguous()
    top_k = 0 if slots is None else slots.shape[1]
    slots = y if slots is None else slots.contiguous()
    out = torch.empty_like(residual)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, _BLOCK_D))
        _mhc_post_kernel[grid](
            residual, post.contiguous(), comb.contiguous(), y, slots, out, dim, N=n,
            TOP_K=top_k, BLOCK_D=_BLOCK_D,
        )  # fmt: skip
    return out


def _check_slots(slots: Tensor, y: Tensor) -> None:
    check_parts(y, slots)  # moe_combine's own check
    if slots.shape[1] < 1:
        raise ValueError(f"slots must be float32 [T, k >= 1, D], got {tuple(slots.shape)}")


def mhc_post_combine_norm(
    residual: Tensor,
    post: Tensor,
    comb: Tensor,
    y: Tensor,
    weights: Tensor,
    norm_weight: Tensor,
    eps: float,
    kernel_order: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(R' = `mhc_post(residual, post, comb, y)`, x = `mhc_combine_norm(R', weights,
    norm_weight, eps)`, x in the grouped GEMM's K order or None) in one launch, bit for bit
    the two kernels. weights fp32 [T, N]; norm_weight [D]; kernel_order: make the third (D a
    multiple of 128).

    Raises:
        ValueError: as `mhc_post`; weights not [T, N] fp32, a norm weight not of the row's
            width, rows wider than `rms_norm.MAX_WIDTH`, kernel order for D % 128 != 0.
    """
    _check(residual, post, comb, y)
    num_tokens, n, dim = residual.shape
    if weights.shape != (num_tokens, n) or weights.dtype != torch.float32:
        raise ValueError(f"weights must be fp32 [T, {n}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")  # fmt: skip
    if norm_weight.shape != (dim,) or dim > MAX_WIDTH:
        raise ValueError(f"norm weight [{dim}] for rows of at most {MAX_WIDTH}, got "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    if kernel_order and dim % 128:
        raise ValueError(f"the kernel's K order is per 128 columns, rows have {dim}")
    check_runnable(residual, "mhc_post_combine_norm")
    residual, y = residual.contiguous(), y.contiguous()
    out = torch.empty_like(residual)
    x = torch.empty(num_tokens, dim, dtype=residual.dtype, device=residual.device)
    x_kernel_order = torch.empty_like(x) if kernel_order else None
    if num_tokens and dim:
        size = triton.next_power_of_2(dim)
        _mhc_post_combine_norm_kernel[(num_tokens,)](
            residual,
            post.contiguous(),
            comb.contiguous(),
            y,
            out,
            weights.contiguous(),
            norm_weight.contiguous(),
            x,
            x if x_kernel_order is None else x_kernel_order,
            dim,
            eps,
            N=n,
            BLOCK=size,
            KERNEL_ORDER=kernel_order,
            num_warps=norm_warps(size),  # rms_norm's: the same reduction
        )
    return out, x, x_kernel_order


def mhc_post_reference(
    residual: Tensor, post: Tensor, comb: Tensor, y: Tensor, slots: Tensor | None = None
) -> Tensor:
    """`mhc_post` in plain torch (with slots: after `moe_combine_reference(y, slots)`)."""
    if slots is not None:
        y = moe_combine_reference(y, slots)
    update = post.unsqueeze(-1) * y.float().unsqueeze(1)
    mixed = (comb.unsqueeze(-1) * residual.float().unsqueeze(2)).sum(1)
    return (update + mixed).to(residual.dtype)
