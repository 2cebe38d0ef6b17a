"""mHC mixing coefficients of one hyper-connection site in one launch (`model.md` §3.2).

From the fp32 logits [T, 2N + N²] (N streams) of each token:

    pre  = sigmoid(logits[:N]) + eps                      [T, N]
    post = 2 · sigmoid(logits[N:2N])                      [T, N]
    comb = softmax over columns of logits[2N:] as [N, N], + eps, then normalised over rows
           (dim −2), then `iters − 1` times: over columns, over rows (Sinkhorn)   [T, N, N]

The torch version (`mhc_mix_reference`, below) is ~120 launches
of tiny kernels per site, 80 sites per step; here each token's N² values stay in registers
through every iteration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["mhc_mix", "mhc_mix_reference", "mix_and_store"]

_BLOCK_T = 16


@triton.jit
def mix_and_store(
    pre_logits,
    post_logits,
    comb_logits,
    t,
    is_token,
    pre_ptr,
    post_ptr,
    comb_ptr,
    hc_eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
):
    """Gates and Sinkhorn of a tile of tokens `t` ([BLOCK_T]) from their logits (pre, post
    [BLOCK_T, N]; comb [BLOCK_T, N, N] as [t, j, i]), stored to [T, N], [T, N], [T, N, N]
    (`kernels.mhc_triplet` calls this too)."""
    i = tl.arange(0, N)
    j = tl.arange(0, N)
    gate_mask = is_token[:, None]
    out = t[:, None].to(tl.int64) * N + i[None, :]
    tl.store(pre_ptr + out, tl.sigmoid(pre_logits) + hc_eps, mask=gate_mask)
    tl.store(post_ptr + out, 2.0 * tl.sigmoid(post_logits), mask=gate_mask)
    # comb[t, j, i]: row j (source stream), column i (target stream).
    comb = tl.exp(comb_logits - tl.max(comb_logits, axis=2)[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    cell_out = t[:, None, None].to(tl.int64) * (N * N) + j[None, :, None] * N + i[None, None, :]
    tl.store(comb_ptr + cell_out, comb, mask=is_token[:, None, None])


@triton.jit(do_not_specialize=["num_tokens"])  # step-varying: one variant
def _mhc_mix_kernel(
    logits_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    hc_eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    width: tl.constexpr = 2 * N + N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    is_token = t < num_tokens
    i = tl.arange(0, N)
    row = logits_ptr + t[:, None].to(tl.int64) * width
    pre = tl.load(row + i[None, :], mask=is_token[:, None], other=0.0)
    post = tl.load(row + N + i[None, :], mask=is_token[:, None], other=0.0)
    # loaded as [BLOCK_T, N²] and reshaped: a token's cells in one warp, where the Sinkhorn's
    # sums over j and over i need no shared memory (`mhc_triplet._finish_tile`)
    cell = row + 2 * N + tl.arange(0, N * N)[None, :]
    comb = tl.reshape(tl.load(cell, mask=is_token[:, None], other=0.0), (BLOCK_T, N, N))
    mix_and_store(pre, post, comb, t, is_token, pre_ptr, post_ptr, comb_ptr, hc_eps, ITERS, N)


def mhc_mix(logits: Tensor, n: int, hc_eps: float, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """`mhc_mix_reference` in one launch.

    Raises:
        ValueError: logits not contiguous fp32 [T, 2n + n²] on CUDA, n not a power of two, or
            iters < 1.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] != 2 * n + n * n:
        expected = f"fp32 [T, {2 * n + n * n}]"
        raise ValueError(f"logits must be {expected}, got {logits.dtype} {tuple(logits.shape)}")
    if n < 1 or n & (n - 1) or iters < 1:
        raise ValueError(f"n must be a power of two and iters >= 1, got n={n}, iters={iters}")
    check_runnable(logits, "mhc_mix")
    logits = logits.contiguous()
    num_tokens = logits.shape[0]
    pre = torch.empty(num_tokens, n, dtype=torch.float32, device=logits.device)
    post = torch.empty_like(pre)
    comb = torch.empty(num_tokens, n, n, dtype=torch.float32, device=logits.device)
    if num_tokens:
        grid = (triton.cdiv(num_tokens, _BLOCK_T),)
        _mhc_mix_kernel[grid](
            logits, pre, post, comb, num_tokens, hc_eps, ITERS=iters, N=n, BLOCK_T=_BLOCK_T
        )
    return pre, post, comb


def mhc_mix_reference(
    logits: Tensor, n: int, hc_eps: float, iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 logits [T, 2N + N²] → (pre [T, N], post [T, N], comb [T, N, N]): sigmoid gates and
    a softmax made doubly stochastic by `iters` Sinkhorn normalisations (`kernels.mhc_mix` on
    CUDA: one launch instead of ~120)."""
    pre = torch.sigmoid(logits[:, :n]) + hc_eps
    post = 2 * torch.sigmoid(logits[:, n : 2 * n])
    comb = logits[:, 2 * n :].unflatten(-1, (n, n))
    comb = comb.softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb
