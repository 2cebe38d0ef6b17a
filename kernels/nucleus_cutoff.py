"""Per-row top-k / top-p cut-offs without a sort or a host read (the sampler on CUDA).

For each row of fp32 logits x with top_k k (0 = off) and top_p p in (0, 1], the cut-off c is
the value a row keeps `x >= c` of (ties with it kept, so a row may keep more than k tokens):

    v_k = the k-th largest value (−inf without top_k)
    Z   = Σ exp(x − max) over the k best positions (over the whole row without top_k)
    c   = the largest value t ≥ v_k with Σ_{x ≥ t} exp(x − max) ≥ p · Z, or v_k when p ≥ 1

which is the sampler's sorted rule (keep the best-first prefix while the renormalised mass of
the better tokens is below p): its last kept value is the smallest t whose better tokens hold
less than p, i.e. the largest t whose tokens at or above it hold at least p.

How: one program per row searches the ordered integer keys of the values (the float bits with
the magnitude flipped for negatives, so that keys order as the floats do). A pass over the row,
in tiles, sums the weights of the tokens at or above `NUM_THRESHOLDS` keys spread evenly over
the interval still open and narrows it to one of NUM_THRESHOLDS + 1 parts, until one key is left:
about 8 passes for 32 bits, each a read of the row (the count search for v_k and the mass search
each take theirs). A key found this way is a value of the row, so c is exact; the sums run in a
fixed order (a tile's fp32 tree, then tile after tile in float64), so a row's cut-off does not
depend on the rest of the batch and is the same on every run, but it can differ from a float64
computation of the rule where the mass at the cut-off is within rounding of p (`MASS_TOLERANCE`).

−inf entries weigh 0 (they count for v_k like any value); a row that is all −inf gets −inf.
`nucleus_cutoffs_reference` is the rule in float64 torch, by a sort.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable

__all__ = ["MASS_TOLERANCE", "boundary_gaps", "nucleus_cutoffs", "nucleus_cutoffs_reference"]

# Each mass is a float64 sum over tiles of fp32 tile sums (a tree of 1,024: at most 10 roundings
# of 2^-24 relative) of fp32 exponentials (`ex2.approx` of x·log2 e: a few 2^-24 relative per
# unit of |x − max|, ~1e-7·E|x − max| weighted by mass); together well under this bound, relative
# to the normaliser. Where top_p is further than this from both masses at the float64 cut-off,
# the kernel's cut-off is the float64 one.
MASS_TOLERANCE = 2.0**-18

BLOCK = 1024
NUM_THRESHOLDS = 16
# key(−inf): the smallest key of any non-NaN float
_KEY_NEG_INF = -2139095041


@triton.jit
def _keys(x):
    """Ordered int32 keys of fp32 values (−0.0 as +0.0)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _search(
    row_ptr,
    width,
    row_max,
    lo,
    hi,
    target,
    MASS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM: tl.constexpr,
):
    """The largest key T in [lo, hi) with W(T) ≥ target, where W(T) sums the weights (mass:
    exp(x − row_max); else 1) of the tokens with key ≥ T; W(lo) ≥ target > W(hi) assumed
    (else lo comes back)."""
    parts = tl.arange(0, NUM).to(tl.int64) + 1
    while hi - lo > 1:
        step = (hi - lo + NUM) // (NUM + 1)
        thresholds = tl.minimum(lo + step * parts, hi)
        # NOTE: keys of the open interval fit int32 (only the step's arithmetic needs int64)
        bounds = thresholds.to(tl.int32)
        acc = tl.zeros([NUM], dtype=tl.float64)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(row_ptr + cols, mask=inside, other=-float("inf"))
            weight = tl.exp(x - row_max) if MASS else inside.to(tl.float32)
            hit = _keys(x)[:, None] >= bounds[None, :]
            acc += tl.sum(tl.where(hit, weight[:, None], 0.0), axis=0).to(tl.float64)
        reached = acc >= target
        lo = tl.maximum(lo, tl.max(tl.where(reached, thresholds, lo), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(reached, hi, thresholds), axis=0))
    return lo


@triton.jit
def _row_max(row_ptr, width, BLOCK: tl.constexpr):
    """The largest of a row's `width` fp32 values (−inf for none), read in tiles of BLOCK."""
    row_max = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        row_max = tl.maximum(
            row_max, tl.load(row_ptr + cols, mask=cols < width, other=-float("inf"))
        )
    return tl.max(row_max, axis=0)


@triton.jit
def _value(key):
    """The fp32 value of an ordered key."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["width", "row_stride"])
def _nucleus_cutoff_kernel(
    x_ptr,
    top_k_ptr,
    top_p_ptr,
    out_ptr,
    width,
    row_stride,
    KEY_NEG_INF: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * row_stride
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    row_max = _row_max(row_ptr, width, BLOCK)
    lo = tl.full([], KEY_NEG_INF, tl.int64)
    hi = _keys(row_max).to(tl.int64) + 1
    if row_max == -float("inf"):
        hi = lo + 1  # nothing to keep or drop
        row_max = 0.0
    if top_k > 0:
        lo = _search(row_ptr, width, row_max, lo, hi, top_k.to(tl.float64), False, BLOCK, NUM)
    if top_p < 1.0:
        norm = tl.zeros([], dtype=tl.float64)
        above = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            x = tl.load(row_ptr + cols, mask=inside, other=-float("inf"))
            strictly = _keys(x).to(tl.int64) > lo
            norm += tl.sum(tl.where(strictly, tl.exp(x - row_max), 0.0), axis=0).to(tl.float64)
            above += (strictly & inside).to(tl.int32)
        if top_k > 0:
            # the k best positions: those above v_k, then copies of v_k
            ties = (top_k - tl.sum(above, axis=0)).to(tl.float64)
            norm += ties * tl.exp(_value(lo) - row_max).to(tl.float64)
        target = top_p.to(tl.float64) * norm
        lo = _search(row_ptr, width, row_max, lo, hi, target, True, BLOCK, NUM)
    tl.store(out_ptr + row, _value(lo))


def _aligned(t: Tensor) -> Tensor:
    """`t`, copied when its data is not 16-byte aligned: Triton compiles one variant per
    pointer alignment, and a row view of a cached tensor may start anywhere."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def nucleus_cutoffs(
    x: Tensor, top_k: Tensor, top_p: Tensor, num_thresholds: int = NUM_THRESHOLDS
) -> Tensor:
    """Each row's cut-off `[n, 1]` fp32 (see the module docstring); a row keeps `x >= cutoff`.

    x: fp32 `[n, vocab]` (rows contiguous); top_k: int `[n]` or `[n, 1]` (0 = off, < vocab);
    top_p: fp32 `[n]` or `[n, 1]` in (0, 1]. One launch; nothing comes back to the host.
    num_thresholds: keys tried per pass (a power of two; fewer: less arithmetic, more passes).

    Raises:
        ValueError: another dtype or shape, or not on CUDA (or Triton's interpreter).
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp32 [rows, vocab] logits with contiguous rows; got {x.dtype} {x.shape}")
    rows = x.shape[0]
    if top_k.numel() != rows or top_p.numel() != rows:
        raise ValueError(f"one top_k and top_p per row ({rows})")
    check_runnable(x, "nucleus_cutoffs")
    out = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows and x.shape[1]:
        _nucleus_cutoff_kernel[(rows,)](
            _aligned(x),
            _aligned(top_k.reshape(rows).to(torch.int64).contiguous()),
            _aligned(top_p.reshape(rows).to(torch.float32).contiguous()),
            out,
            x.shape[1],
            x.stride(0),
            KEY_NEG_INF=_KEY_NEG_INF,
            BLOCK=BLOCK,
            NUM=num_thresholds,
            num_warps=8,
        )
    return out


def _float64_masses(
    x: Tensor, top_k: Tensor, top_p: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(sorted values, renormalised probabilities, mass before each position, in-top-k mask,
    the rule's cut-off), all float64 from one descending sort."""
    values = x.double().sort(dim=-1, descending=True).values
    width = values.shape[1]
    k = top_k.reshape(-1, 1).to(torch.int64)
    p = top_p.reshape(-1, 1).double()
    in_top_k = torch.arange(width, device=x.device) < torch.where(k > 0, k, width)
    probs = values.masked_fill(~in_top_k, -math.inf).softmax(dim=-1)
    probs = probs.nan_to_num(0.0)  # all −inf rows
    before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((before < p) | (p >= 1))
    cutoff = values.gather(1, keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1)
    return values, probs, before, in_top_k, cutoff


def nucleus_cutoffs_reference(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """`nucleus_cutoffs` in plain torch: the rule by one sort, its probabilities in float64."""
    return _float64_masses(x, top_k, top_p)[-1].float()


def boundary_gaps(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """How far top_p is from the rule's decision, float64 `[n]`: min(top_p − mass of the tokens
    above the cut-off, mass at or above it − top_p), renormalised over the top k (inf for rows
    with top_p ≥ 1 or that keep every token). A cut-off computed with rounding error ε in the
    masses can differ from the float64 one only on rows with a gap below ε."""
    values, probs, before, in_top_k, cutoff = _float64_masses(x, top_k, top_p)
    p = top_p.reshape(-1, 1).double()
    above = torch.where(values > cutoff, probs, 0.0).sum(dim=-1, keepdim=True)
    at_or_above = torch.where((values >= cutoff) & in_top_k, probs, 0.0).sum(dim=-1, keepdim=True)
    gap = torch.minimum(p - above, at_or_above - p)
    keeps_all = (values >= cutoff).all(dim=-1, keepdim=True) | (p >= 1)
    return torch.where(keeps_all, math.inf, gap).squeeze(1)
