"""The indexer's top-k selection (`model.md` §3.7) in one launch, without a sort of the row.

For each row of fp32 scores x [J] and a count k ≤ J, the k largest entries, best first, as
their column indices, −1 in place of a −inf entry:

    v_k   the k-th largest value: a radix select over the ordered integer keys of the values
          (`kernels.nucleus_cutoff._keys`), 8 bits per pass from the top: each pass counts
          the keys that match the digits found so far by their next digit (`tl.histogram`)
          and keeps the digit whose keys at or above it reach the count still wanted; 4
          passes over the row
    take  every entry above v_k, then entries equal to v_k in column order until there are
          k: one pass, each tile's picks placed by a prefix count after the ones before
    order the k picks sorted in registers by (value descending, column ascending)

which is `torch.topk(x, k)` followed by `where(isfinite(values), indices, −1)`
(`index_topk_reference`), with ties broken by the lower column (torch leaves their order
open). The sort is what keeps a selection's order that of the torch path: the attention sums its
rows in selection order. On CUDA torch's top-k of a few hundred rows of thousands of entries is
a multi-block radix select of ~14 launches; the masking of −inf entries two more.

Asked to (`resident_width`), rows of up to `RESIDENT_WIDTH` scores are loaded once and every
pass runs on the registers (meant for the decode steps' rows: few rows, one program each, so
each pass's reload is latency); otherwise each pass reads the row again, in tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable
from kernels.nucleus_cutoff import _keys, _value

__all__ = ["index_topk", "index_topk_pays", "index_topk_reference"]

# Where the kernel is no slower than torch's top-k (H100, 2026-12-06, `benchmarks/indexer_topk.py`,
# docs/performance.md): 256 rows of 4,096 scores 105 µs (torch 146), of 8,192 154 µs (142); 16
# rows 85 / 132 µs (57 / 73); 32,768 and more scores 2-5x slower. One program per row walks the
# row 5 times, so few rows or long rows lose to torch's multi-block radix select.
MIN_ROWS = 128
MAX_WIDTH = 8192

BLOCK = 1024
# The widest row the kernel can hold in registers (≤ 32 fp32 a thread at 8 warps). Not yet the
# launcher's default: never run on a GPU (2026-12-07); `benchmarks/indexer_topk.py` times it
# ("kernel resident") against the streamed passes and torch's top-k, which decides.
RESIDENT_WIDTH = 8192
# the low half of a packed pick: 2³² − 1 − column, so that lower columns sort first
_COLUMN_MASK = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _radix_digits(row_ptr, width, prefix, prefix_mask, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Counts [256] of the 8-bit digit at SHIFT of the unsigned ordered keys that match
    `prefix` on `prefix_mask`, over the row (the others counted in bins past 256, dropped)."""
    counts = tl.zeros([2 * 256], dtype=tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(row_ptr + cols, mask=inside, other=-float("inf"))
        u = _keys(x).to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned, ordered as x
        counts += _digit_counts(u, inside, prefix, prefix_mask, SHIFT)
    return counts


@triton.jit
def _digit_counts(u, inside, prefix, prefix_mask, SHIFT: tl.constexpr):
    """`_radix_digits`' counts over the unsigned ordered keys u of a tile, or of a whole row
    held in registers."""
    digit = ((u >> SHIFT) & 255).to(tl.int32)
    match = inside & ((u & prefix_mask) == prefix)
    return tl.histogram(tl.where(match, digit, 256 + (digit & 255)), 2 * 256)


@triton.jit
def _pick(keys, cols, inside, kth, ties, tied, taken, out_row):
    """Stores the picks among `keys` (at `cols`) after the `taken` ones before: every key
    above kth, and keys equal to kth while fewer than `ties` of them were taken (`tied` seen
    before); returns the new (taken, tied)."""
    is_tie = (keys == kth) & inside
    tie_rank = tied + tl.cumsum(is_tie.to(tl.int32), axis=0) - 1
    pick = ((keys > kth) & inside) | (is_tie & (tie_rank < ties))
    slot = taken + tl.cumsum(pick.to(tl.int32), axis=0) - 1
    packed = (keys.to(tl.int64) << 32) | (_COLUMN_MASK - cols.to(tl.int64))
    tl.store(out_row + slot, packed, mask=pick)
    taken += tl.sum(pick.to(tl.int32), axis=0)
    tied += tl.sum(is_tie.to(tl.int32), axis=0)
    return taken, tied


@triton.jit(do_not_specialize=["width", "row_stride", "k"])
def _index_topk_kernel(
    x_ptr,
    out_ptr,
    width,
    row_stride,
    k,
    BLOCK: tl.constexpr,
    K_PAD: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    """RESIDENT (a power of two ≥ width, or 0): the row loaded once and held in registers
    for every pass; 0: each pass streams the row in BLOCK-wide tiles."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * row_stride
    out_row = out_ptr + row * k
    if RESIDENT:
        cols = tl.arange(0, RESIDENT)
        inside = cols < width
        keys = _keys(tl.load(row_ptr + cols, mask=inside, other=-float("inf")))
        u = keys.to(tl.uint32, bitcast=True) ^ 0x80000000  # unsigned, ordered as x
    # v_k's key, a digit of 8 bits per pass from the top (a radix select): among the keys
    # matching the digits found so far, the digit whose keys at or above it reach the count
    # still wanted
    prefix = tl.zeros([], dtype=tl.uint32)
    prefix_mask = tl.zeros([], dtype=tl.uint32)
    wanted = k
    bins = tl.arange(0, 2 * 256)
    for step in tl.static_range(4):
        if RESIDENT:
            counts = _digit_counts(u, inside, prefix, prefix_mask, 24 - 8 * step)
        else:
            counts = _radix_digits(row_ptr, width, prefix, prefix_mask, 24 - 8 * step, BLOCK)
        counts = tl.where(bins < 256, counts, 0)
        at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
        digit = tl.max(tl.where((at_or_above >= wanted) & (bins < 256), bins, 0), axis=0)
        above = tl.sum(tl.where(bins > digit, counts, 0), axis=0)
        wanted -= above
        prefix |= digit.to(tl.uint32) << (24 - 8 * step)
        prefix_mask |= tl.full([], 255, tl.uint32) << (24 - 8 * step)
    kth = (prefix ^ 0x80000000).to(tl.int32, bitcast=True)  # back to the signed key
    ties = wanted  # entries equal to v_k to take, the first by column
    taken = tl.zeros([], dtype=tl.int32)
    tied = tl.zeros([], dtype=tl.int32)
    if RESIDENT:
        taken, tied = _pick(keys, cols, inside, kth, ties, tied, taken, out_row)
    else:
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            keys = _keys(tl.load(row_ptr + cols, mask=inside, other=-float("inf")))
            taken, tied = _pick(keys, cols, inside, kth, ties, tied, taken, out_row)
    tl.debug_barrier()  # the picks, stored by any thread, read back by others
    slots = tl.arange(0, K_PAD)
    smallest = tl.full([K_PAD], -(2**63), tl.int64)
    packed = tl.load(out_row + slots, mask=slots < k, other=smallest)
    packed = tl.sort(packed, descending=True)
    columns = _COLUMN_MASK - (packed & _COLUMN_MASK)
    finite = _value(packed >> 32) != -float("inf")
    tl.debug_barrier()  # every pick read before any slot is overwritten
    tl.store(out_row + slots, tl.where(finite, columns, -1), mask=slots < k)


def index_topk(scores: Tensor, k: int, *, resident_width: int = 0) -> Tensor:
    """`index_topk_reference` in one launch: fp32 scores [..., J] (unit column stride), 0 ≤ k
    ≤ J → int64 [..., k] column indices, best first (ties: lower column first), −1 where
    the score is −inf. Rows of J ≤ resident_width (at most `RESIDENT_WIDTH`) are held in
    registers, longer ones streamed per pass (the same selection either way).

    Raises:
        ValueError: another dtype, k outside [0, J], or not on CUDA (nor in Triton's
            interpreter).
    """
    if scores.dtype != torch.float32 or scores.dim() < 1 or scores.stride(-1) != 1:
        raise ValueError(f"fp32 scores [..., J] with unit column stride; got {scores.dtype} "
                         f"{tuple(scores.shape)}")  # fmt: skip
    width = scores.shape[-1]
    if not 0 <= k <= width:
        raise ValueError(f"k must be in [0, {width}], got {k}")
    if not 0 <= resident_width <= RESIDENT_WIDTH:
        raise ValueError(f"resident_width must be in [0, {RESIDENT_WIDTH}], got {resident_width}")
    check_runnable(scores, "index_topk")
    out = torch.empty(*scores.shape[:-1], k, dtype=torch.int64, device=scores.device)
    if not out.numel():
        return out
    rows = scores.reshape(-1, width)
    _index_topk_kernel[(rows.shape[0],)](
        rows,
        out,
        width,
        rows.stride(0),
        k,
        BLOCK=BLOCK,
        K_PAD=triton.next_power_of_2(k),
        RESIDENT=triton.next_power_of_2(width) if width <= resident_width else 0,
        num_warps=8,
    )
    return out


def index_topk_pays(rows: int, width: int) -> bool:
    """Whether `index_topk` of `rows` rows of `width` scores is measured no slower than
    `index_topk_reference` (`MIN_ROWS`, `MAX_WIDTH`): a function of shapes only, so a CUDA
    graph's step takes the same path every replay."""
    return rows >= MIN_ROWS and width <= MAX_WIDTH


def index_topk_reference(scores: Tensor, k: int) -> Tensor:
    """`torch.topk` of the last dimension, −1 in place of −inf scores (the order of equal
    scores is torch's)."""
    top = torch.topk(scores, k, dim=-1)
    return torch.where(torch.isfinite(top.values), top.indices, -1)
