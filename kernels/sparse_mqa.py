"""Attention of one CSA2 layer (`model.md` §3.7) reading the encoded KV rows in place.

Each query head of a token at position p attends, in one softmax, to

    window    the `window` positions p − window + 1 .. p of its sequence, read either from the
              layer's ring of MXFP8 rows (`swa_mxfp8`: e4m3 + ue8m0 per 32; position q at row
              q % R; decode steps, whose rows are already written) or from a sequence's bf16
              window rows (prefill chunks: the ring's rows before the chunk, then the chunk's)
    selected  up to K compressed positions chosen by the indexer (−1 = none), read from the
              paged pool of FP4 rows (`global_fp4`: e2m1 + e4m3 scale per 16) through the block
              table: position j lives in block table[j · ratio // 128], row j % (128 // ratio)
    sink      one logit per head with no value

and returns Σ softmax · row (keys are values: MQA over one latent row). The torch path gathers
and decodes [T, K, D] fp32 rows and runs the softmax over materialised scores; here rows are
decoded in registers, tile by tile, with an online softmax.

Precision: a decoded row is exact in bf16 (an e4m3 code times a power of two; an e2m1 code times
an e4m3 scale: at most 6 significant bits), so the dots run on bf16 tensor cores with fp32
accumulation and lose nothing on the row side. An fp32 operand (fp32 queries, the fp32
probabilities) is split into a bf16 head and a bf16 remainder, two dots, ~16 significant bits:
within ~1e-5 of the fp32 reference, whose own summation order differs anyway.

    grid (tokens · heads / BLOCK_H · SPLITS · D / BLOCK_D); per program q [BLOCK_H, D], running
    max and sum, acc [BLOCK_H, BLOCK_D] fp32 over its split's tiles (tile i of the token's
    window-then-selected tiles goes to split i % SPLITS); SPLITS > 1 writes partials that
    `_combine_kernel` folds with the sink (flash-decoding: parallelism for small decode steps)

Every kernel over a token's rows numbers its programs token-major (`_program_of_token`): the
programs of one token (head blocks, row splits, column blocks) are launched side by side, so
the rows and scores they all read come from HBM once and from L2 after, rather than once per
column block when the token index ran fastest (a 256-token layer's scores are ~140 MB, more
than L2).

The launch shape (`MqaTiles`) comes from the `TILES` table by token count (one place to edit,
from `benchmarks/kernel_speed.py --only attention`), or `FIXED_TILES` in batch-invariant mode.

`rotate_back`: the attention's output is rounded to the model dtype and rotated back by its
token's RoPE angle before the output projection. The program that writes the output (the
one-pass kernel, `_combine_kernel` after row splits, the second pass) does both in its store:
`_rotated_back`, `kernels.rope`'s device functions on the rounded values, so the result is bit
for bit `apply_rope(out.to(q.dtype), positions, freqs, inverse=True)`; the main loops are as
without it.

`rotate_q`, its mirror: the queries arrive before their RoPE and every program that loads them
(the one-pass kernel, each row split's and column block's program, the first pass) rotates
their tail as it loads them: `_rotated_query`, `kernels.rope`'s device functions, rounded to
q's dtype as the rope launch stores them, so the result is that of `apply_rope(q,
positions, freqs)` as q; the main loops are as without it. Bit for bit in the interpreter and,
on sm90, in decode launches (the window in the ring); in launches of several tokens per
sequence (the window from bf16 rows) the H100 gave last-bit differences (2026-12-06: up to
2.4e-6 on outputs of order one, up to a fifth of the elements), which `docs/model.md` records.
Launch shapes without `MqaTiles.rotates_q` get the rope launch first instead.

`sparse_mqa` is the launcher; `sparse_mqa_reference` the torch reference (codecs' own
dequantisation, a direct softmax).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import check_runnable, interpreting, sparse_mqa_gluon
from kernels.element_codes import fp4_rows_to_float, mxfp8_rows_to_float
from kernels.mxfp4_unpack import UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3, reads_as_words
from kernels.rope import apply_rope, apply_rope_reference, cos_sin, rotate
from kernels.rounding import round_to

_INTERPRETING = interpreting()
# The interpreter's bf16 dot is not trustworthy: there the operands stay fp32 (the hi/lo split
# still rounds through bf16, so its logic is exercised).
_DOT_DTYPE = tl.float32 if _INTERPRETING else tl.bfloat16
# Triton's CPU interpreter has no libdevice (`kernels.rope`).
_LIBDEVICE = not _INTERPRETING


@dataclass(frozen=True)
class MqaTiles:
    """One launch shape of `_sparse_mqa_kernel`.

    block_h: query heads per program (64 = every head of the released model: the rows are
    decoded once per token, and M = 64 reaches the wgmma). block_n: rows per tile. splits: the
    token's tiles are dealt round-robin to this many programs (flash-decoding: partial max, sum
    and accumulator each, then `_combine_kernel`); the deal depends only on the tile's index,
    so a token's partials never depend on the other tokens or on trailing −1 selections.
    block_d: output columns per program (D / block_d programs per head block, each computing
    the full-D scores, accumulating its columns only: a smaller accumulator); None (or more
    than D) = all D.
    two_pass: scores first, then values (`_mqa_scores_kernel`, `_mqa_values_kernel`): one
    program per head block decodes every row at full D once and writes the token's scores
    [H, rows] with their softmax max and sum; then D / block_d programs each decode only their
    columns and sum exp(score − max) · row. Where block_d < D, the one-pass kernel decodes
    the rows and computes the scores D / block_d times over (once per column program); this
    trades that for the scores' round trip through memory (fp32, 4 bytes per head and row;
    launches of `TWO_PASS_TOKENS` tokens at most). No row splits with it.
    rotates_q: with `rotate_q`, the programs rotate the queries as they load them; otherwise
    the launcher rotates them first with the rope launch (`kernels.rope.apply_rope`): the
    same result (bit for bit in decode launches; see the module docstring). NOTE: at 32 or
    64 heads per program the rotation in the load moves the scores' wgmma operand from
    shared memory into registers and spills more (local sm90 compile, 64 tokens: 188 → 664
    bytes of spill stores), not yet timed on a GPU
    (`benchmarks/attention_passes.py --rotate-q`), so only the 16-head shapes take it.
    unpack_rows (CUDA): the selected FP4 rows decoded by the expert GEMM's in-register unpack
    (`_unpacked_global_rows`: 32-bit words, inline PTX, bf16x2 multiplies) instead of
    `_global_rows`'s per-value conversions; the same exact bf16 rows.
    gluon (sm90): the Gluon kernel instead (`kernels.sparse_mqa_gluon`: one pass, every head
    and column of a token in one program of two warpgroups, block_n rows per tile, the same
    row splits and `_combine_kernel`; bf16 queries); the queries' RoPE as its own launch, the
    output's too without row splits (`rotates_q` changes nothing there). Where the `TILES`
    choice has it and the launch cannot take it, `GLUON_FALLBACK` runs instead.
    persistent (gluon, no row splits): one program per SM over the tokens, the next token's
    queries and first rows loaded under the current one's last products.
    """

    block_h: int
    block_n: int
    splits: int = 1
    block_d: int | None = None
    num_warps: int = 8
    num_stages: int = 1
    two_pass: bool = False
    rotates_q: bool = False
    unpack_rows: bool = False
    gluon: bool = False
    persistent: bool = False

    def __str__(self) -> str:
        d = self.block_d or "D"
        passes = " 2p" if self.two_pass else ""
        rotates = " rq" if self.rotates_q else ""
        stages = f" st{self.num_stages}" if self.num_stages != 1 else ""
        unpack = " up" if self.unpack_rows else ""
        gluon = (" gl" if self.gluon else "") + (" ps" if self.persistent else "")
        return (
            f"h{self.block_h} n{self.block_n} s{self.splits} d{d} w{self.num_warps}{passes}"
            f"{rotates}{stages}{unpack}{gluon}"
        )


# THE CHOICE (edit here after `benchmarks/kernel_speed.py --only attention`): per launch, the
# first entry whose bound is at least the launch's token count. Measured on the H200
# (2026-12-02, one layer of the released shape, 8K context; docs/performance.md): at 16 tokens
# two row splits 54 µs (one: 85 µs); at 64 and 256 every head in one program with 128 output
# columns 138 / 549 µs (16 heads: 162 / 653 µs); prefill 4,096 tokens 32 heads 5.7 ms (64 heads
# with 128 columns: 6.8 ms). 2026-12-03 (`benchmarks/attention_passes.py`): the same shape in two
# passes 138 / 325 µs at 64 / 256 (one pass 136 / 545); a 4,096-token prefill chunk 3.89 ms
# (one pass, 32 heads: 5.58 ms).
# 2026-12-07 (H100, `attention_passes.py`): the selected rows through the register unpack
# (`unpack_rows`) at every shape: 16 tokens 76.8 -> 75.2 µs, 64: 135.3 -> 117.2, 256: 298.7 ->
# 275.4, a 4,096-token chunk 3,677 -> 3,433; launches whose pool it cannot read take the plain
# decode (the same bits).
# 2026-12-07 seventh session (H100, `attention_passes.py`, `5c99b42`): the Gluon kernel
# (`kernels.sparse_mqa_gluon`) against the shapes above: 16 tokens 49.2 -> 31.6 µs (32 rows per
# tile, 8 row splits; 4 splits 33.3), 64: 119.3 -> 52.0 (64 rows, 2 splits), 256: 279.0 ->
# 151.9 (64 rows; persistent 148.7), a 4,096-token chunk 3,432 -> 1,702 (persistent 1,724).
TILES: tuple[tuple[int, MqaTiles], ...] = (
    (16, MqaTiles(64, 32, splits=8, num_warps=8, gluon=True)),
    (64, MqaTiles(64, 64, splits=2, num_warps=8, gluon=True)),
    (1 << 62, MqaTiles(64, 64, num_warps=8, gluon=True)),
)
# Two-pass launches take at most this many tokens each: the scores' buffer (fp32 [tokens, H,
# window + selected rows], ~164 KB per token at the released shape) stays under ~0.7 GB.
TWO_PASS_TOKENS = 4096
# `fixed_tiles` (batch-invariant mode): one shape whatever the launch, so a token's reduction
# never changes with the step's other tokens. Any `MqaTiles` keeps that property. NOTE: this
# shape rotating the queries in its load gave other bits than the rope launch first on the H100
# (`test_rotated_queries_equal_rope_then_attention_on_cuda`, 2026-12-06), so it takes the rope
# launch.
FIXED_TILES = MqaTiles(16, 64)
# What `kernel_speed --only attention` times (with the entries above): the legacy tiles, every
# head in one program (M = 64: wgmma) with the output columns split so the accumulator fits
# (sm90 ptxas, Triton 3.9: d128 at 4 warps spills nothing; d256 at 8 warps ~0.6 KB; all D at
# 64 heads ~8 KB, left out), and row splits for small decode steps.
CANDIDATES: tuple[MqaTiles, ...] = (
    MqaTiles(16, 64),
    MqaTiles(32, 64),
    MqaTiles(64, 32, block_d=256),
    MqaTiles(64, 32, block_d=128, num_warps=4),
    MqaTiles(64, 64, block_d=128, num_warps=4),
    MqaTiles(16, 64, splits=2),
    MqaTiles(16, 64, splits=4),
    MqaTiles(64, 32, splits=2, block_d=128, num_warps=4),
    MqaTiles(64, 32, splits=4, block_d=128, num_warps=4),
    MqaTiles(64, 32, splits=8, block_d=128, num_warps=4),
    MqaTiles(64, 32, splits=4, block_d=256),
    MqaTiles(64, 32, block_d=128, num_warps=4, two_pass=True),
    MqaTiles(64, 32, block_d=128, num_warps=8, two_pass=True),
    MqaTiles(64, 64, block_d=128, num_warps=8, two_pass=True),
    MqaTiles(64, 32, block_d=256, num_warps=8, two_pass=True),
    # the `TILES` shapes with the plain per-value decode of the selected rows
    MqaTiles(16, 64, splits=2, rotates_q=True),
    # the 16-token shape with Triton's pipelined loads: one program per SM there (sm90 compile,
    # Triton 3.6: 228 registers, 128 KB of shared memory), so each tile's gathers wait in full;
    # 2 / 3 stages compile to 234 / 255 registers, no spills (not yet run; 2026-12-07)
    MqaTiles(16, 64, splits=2, rotates_q=True, unpack_rows=True, num_stages=2),
    MqaTiles(16, 64, splits=2, rotates_q=True, unpack_rows=True, num_stages=3),
    # the Gluon kernel (sm90 compile, Triton 3.6, D = 512: 247 / 231 registers at 64 / 32 rows
    # per tile, no spills; shared memory 211 / 138 KB; not yet run, 2026-12-07)
    MqaTiles(64, 64, num_warps=8, gluon=True),
    MqaTiles(64, 32, num_warps=8, gluon=True),
    # and with row splits for small decode steps (16 tokens: 16 programs without)
    MqaTiles(64, 64, splits=2, num_warps=8, gluon=True),
    MqaTiles(64, 32, splits=4, num_warps=8, gluon=True),
    MqaTiles(64, 32, splits=8, num_warps=8, gluon=True),
    # and one program per SM over the tokens (prefill chunks, large decode steps)
    MqaTiles(64, 64, num_warps=8, gluon=True, persistent=True),
    MqaTiles(64, 32, num_warps=8, gluon=True, persistent=True),
)
# What a launch whose `TILES` choice is a Gluon shape runs where that kernel cannot (not sm90,
# fp32 queries, a pool off 4-byte rows): the two-pass shape.
GLUON_FALLBACK = MqaTiles(64, 32, block_d=128, num_warps=4, two_pass=True, unpack_rows=True)
if _INTERPRETING:  # 16 heads per program, as the CUDA shapes that rotate queries in the load
    TILES = ((1 << 62, MqaTiles(16, 16, num_warps=4, rotates_q=True)),)
    FIXED_TILES = MqaTiles(16, 16, num_warps=4, rotates_q=True)


def choose_tiles(num_tokens: int) -> MqaTiles:
    """The `TILES` entry for a launch of `num_tokens` query tokens."""
    return next(tiles for bound, tiles in TILES if num_tokens <= bound)


def _unpack_rows_runs(global_rows: tuple | None) -> bool:
    """Whether `MqaTiles.unpack_rows` can read this launch's pool: on a GPU (not the
    interpreter), with the pool's start and strides on 4-byte boundaries (32-bit word loads).
    Without selected rows it changes nothing."""
    if _INTERPRETING:
        return False
    if global_rows is None:
        return True
    return reads_as_words(global_rows[0])


def _gluon_runs(q: Tensor, window_rows, global_rows: tuple | None) -> bool:
    """Whether `MqaTiles.gluon` can take this launch (`sparse_mqa_gluon.takes`)."""
    if _INTERPRETING or not sparse_mqa_gluon.runs_here(q):
        return False
    pool = None if global_rows is None else global_rows[0]
    return sparse_mqa_gluon.takes(q, pool, None if window_rows is None else window_rows[0])


@triton.jit
def _program_of_token(num_heads, BLOCK_H: tl.constexpr, PER_HEAD_BLOCK: tl.constexpr):
    """(token int64, first head, program within the head block) of a one-axis grid ordered
    token, then head block, then the PER_HEAD_BLOCK programs of a head block (fastest)."""
    program = tl.program_id(0)
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    block = program // PER_HEAD_BLOCK
    token = (block // head_blocks).to(tl.int64)
    return token, (block % head_blocks) * BLOCK_H, program % PER_HEAD_BLOCK


def _token_major_grid(num_tokens: int, num_heads: int, block_h: int, per_head_block: int):
    """The one-axis grid `_program_of_token` reads."""
    return (num_tokens * triton.cdiv(num_heads, block_h) * per_head_block,)


@triton.jit
def _split_dot(a, b, DOT_DTYPE: tl.constexpr):
    """fp32 a [M, K] · b [K, N] (b exact in bf16) as two bf16 dots: a's head and remainder."""
    head = a.to(tl.bfloat16).to(tl.float32)
    out = tl.dot(head.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)
    return tl.dot((a - head).to(tl.bfloat16).to(DOT_DTYPE), b.to(DOT_DTYPE), acc=out)


@triton.jit
def _scores(q_head, q_rest, rows, softmax_scale, Q_SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """q [BH, D] (its bf16 head, and remainder if Q_SPLIT) against rows [BN, D]: [BH, BN]."""
    keys = tl.trans(rows).to(DOT_DTYPE)
    scores = tl.dot(q_head, keys, out_dtype=tl.float32)
    if Q_SPLIT:
        scores = tl.dot(q_rest, keys, acc=scores)
    return scores * softmax_scale


@triton.jit
def _fold_scores(m, total, scores):
    """The running max and sum [BH] after one tile of scores [BH, BN]; with the factor alpha
    the earlier sum was rescaled by and the tile's exp(score − max) p."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, total * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _online_update(m, total, acc, scores, rows, DOT_DTYPE: tl.constexpr):
    """Fold one tile of scores [BH, BN] over rows [BN, BD] into the running softmax."""
    m, total, alpha, p = _fold_scores(m, total, scores)
    acc = acc * alpha[:, None] + _split_dot(p, rows, DOT_DTYPE)
    return m, total, acc


@triton.jit
def _rotated_query(q, position, freq_ptr, pass_width, DTYPE: tl.constexpr,
                   LIBDEVICE: tl.constexpr):  # fmt: skip
    """A token's queries q [BH, D] (fp32 values of `DTYPE`) with the pairs at columns
    ≥ pass_width rotated by position · freq and rounded to `DTYPE`: `kernels.rope`'s launch
    as it stores them (its device functions, on the same operands)."""
    a, b = tl.split(tl.reshape(q, (q.shape[0], q.shape[1] // 2, 2)))
    even = 2 * tl.arange(0, q.shape[1] // 2)
    is_rotated = even >= pass_width
    freq = tl.load(freq_ptr + (even - pass_width) // 2, mask=is_rotated, other=0.0)
    c, s = cos_sin(position.to(tl.float32) * freq, 1.0, LIBDEVICE)
    rotated_even, rotated_odd = rotate(a, b, c[None, :], s[None, :])
    a = tl.where(is_rotated[None, :], round_to(rotated_even, DTYPE), a)
    b = tl.where(is_rotated[None, :], round_to(rotated_odd, DTYPE), b)
    return tl.reshape(tl.join(a, b), (q.shape[0], q.shape[1]))


@triton.jit
def _query_parts(q_ptr, token, heads, is_head, stride_qt, stride_qh, D: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, position_ptr, freq_ptr, pass_width,
                 ROTATE: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    """The token's queries [BH, D] as a bf16 head and remainder, rounded once (bf16 queries:
    the head alone, exact). ROTATE: the RoPE tail rotated first (`_rotated_query`).

    NOTE: rotated, the scores' q operand is computed rather than loaded, so Triton 3.9 feeds a
    64-head tile's wgmma from registers instead of shared memory (more registers held through
    the main loops: `docs/performance.md`, "The queries' RoPE in the attention launch")."""
    d = tl.arange(0, D)
    q_ptrs = q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=is_head[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        position = tl.load(position_ptr + token)
        dtype = q_ptr.dtype.element_ty
        q = _rotated_query(q, position, freq_ptr, pass_width, dtype, LIBDEVICE)
    q_head = q.to(tl.bfloat16)
    q_rest = (q - q_head.to(tl.float32)).to(tl.bfloat16).to(DOT_DTYPE)
    return q_head.to(DOT_DTYPE), q_rest


@triton.jit
def _swa_rows(
    ring_ptr, row_index, valid, d0, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Columns d0 .. d0 + BD of MXFP8 rows as exact bf16 [BLOCK_N, BD] (row bytes: D e4m3
    codes, D/32 ue8m0 scales)."""
    d = d0 + tl.arange(0, BD)
    code_ptrs = ring_ptr + row_index[:, None] + d[None, :]
    codes = tl.load(code_ptrs, mask=valid[:, None], other=0).to(tl.uint16)
    # e4m3 (s, e, m) placed at fp16 bits: 2^(e-15)·(1 + m/8) or m/8·2^-14, i.e. e4m3 · 2^-8.
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
    values = bits.to(tl.float16, bitcast=True).to(tl.float32)
    b = d0 // 32 + tl.arange(0, BD // 32)
    exponent = tl.load(ring_ptr + row_index[:, None] + D + b[None, :], mask=valid[:, None], other=0)
    multiplier = tl.exp2(exponent.to(tl.float32) - (127.0 - 8.0))
    values = tl.reshape(values, (BLOCK_N, BD // 32, 32)) * multiplier[:, :, None]
    return tl.reshape(values, (BLOCK_N, BD)).to(tl.bfloat16)


@triton.jit
def _global_rows(
    pool_ptr, row_index, valid, d0, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Columns d0 .. d0 + BD of FP4 rows as exact bf16 [BLOCK_N, BD] (row bytes: D/2 e2m1
    pairs, D/16 e4m3 scales)."""
    c = d0 // 2 + tl.arange(0, BD // 2)
    packed = tl.load(pool_ptr + row_index[:, None] + c[None, :], mask=valid[:, None], other=0)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BD)).to(tl.uint16)
    # e2m1 (s, e, m) at fp16 bits: e2m1 · 2^-14.
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)
    values = bits.to(tl.float16, bitcast=True).to(tl.float32)
    b = d0 // 16 + tl.arange(0, BD // 16)
    scale_bytes = tl.load(
        pool_ptr + row_index[:, None] + D // 2 + b[None, :], mask=valid[:, None], other=0
    ).to(tl.uint16)
    scale_bits = ((scale_bytes & 0x80) << 8) | ((scale_bytes & 0x7F) << 7)
    # e4m3 · 2^-8 from the fp16 reading, times 2^-14 from the codes': undo both (2^22).
    scales = scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0
    values = tl.reshape(values, (BLOCK_N, BD // 16, 16)) * scales[:, :, None]
    return tl.reshape(values, (BLOCK_N, BD)).to(tl.bfloat16)


# bf16 2^118 in both halves: the unpack's e2m1 · 2^-126 becomes e2m1 · 2^-8 (normal, exact).
_UNPACK_PRESCALE = tl.constexpr(0x7A807A80)
_BF16X2_PRODUCT = tl.constexpr("mul.rn.bf16x2 $0, $1, $2;")


@triton.jit
def _unpacked_global_rows(
    pool_ptr, row_index, valid, d0, D: tl.constexpr, BD: tl.constexpr, BLOCK_N: tl.constexpr
):
    """`_global_rows` (the same exact bf16 values, natural column order) through the expert
    GEMM's in-register unpack (`kernels.mxfp4_unpack`): each 32-bit word of codes becomes four
    bf16x2 registers of e2m1 · 2^-8 (the unpack's multiply by 2^118), then one bf16x2 multiply
    by the row's e4m3 scale · 2^8 of those 16 columns. Every step is exact: e2m1 · e4m3 has at
    most 6 significant bits and lies between 2^-10 and 2^12. Inline PTX: CUDA only."""
    row_ptrs = pool_ptr + row_index
    word = d0 // 8 + tl.arange(0, BD // 8)
    word_ptrs = row_ptrs.to(tl.pointer_type(tl.uint32))[:, None] + word[None, :]
    words = tl.load(word_ptrs, mask=valid[:, None], other=0)
    b = d0 // 16 + tl.arange(0, BD // 16)
    scale_bytes = tl.load(row_ptrs[:, None] + D // 2 + b[None, :], mask=valid[:, None], other=0).to(
        tl.uint16
    )
    scale_bits = ((scale_bytes & 0x80) << 8) | ((scale_bytes & 0x7F) << 7)  # e4m3 · 2^-8 (fp16)
    scales = scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 65536.0
    scales = scales.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
    pairs = scales | (scales << 16)  # one scale per two words
    pairs = tl.broadcast_to(pairs[:, :, None], (BLOCK_N, BD // 16, 2))
    pairs = tl.reshape(pairs, (BLOCK_N, BD // 8))
    args = [words, tl.full((BLOCK_N, BD // 8), _UNPACK_PRESCALE, tl.uint32)]
    out0 = tl.inline_asm_elementwise(UNPACK_0, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out1 = tl.inline_asm_elementwise(UNPACK_1, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out2 = tl.inline_asm_elementwise(UNPACK_2, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out3 = tl.inline_asm_elementwise(UNPACK_3, "=r,r,r", args, tl.uint32, is_pure=True, pack=1)
    out0 = _scaled_pairs(out0, pairs)
    out1 = _scaled_pairs(out1, pairs)
    out2 = _scaled_pairs(out2, pairs)
    out3 = _scaled_pairs(out3, pairs)
    # out j holds values 8w + j (low half) and 8w + j + 4 (high half) of word w
    values = tl.join(tl.join(out0, out1), tl.join(out2, out3))  # [N, W, h, j & 1, j >> 1]
    values = tl.permute(values, (0, 1, 2, 4, 3))  # [N, W, h, j >> 1, j & 1]: column 8w + j + 4h
    return tl.reshape(values, (BLOCK_N, BD))


@triton.jit
def _scaled_pairs(packed, pairs):
    """bf16 [.., 2] of the bf16x2 registers `packed` times `pairs` (low half, high half)."""
    product = tl.inline_asm_elementwise(
        _BF16X2_PRODUCT, "=r,r,r", [packed, pairs], tl.uint32, is_pure=True, pack=1
    )
    low = (product & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.join(low, (product >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _decoded_global_rows(pool_ptr, row_index, valid, d0, D: tl.constexpr, BD: tl.constexpr,
                         BLOCK_N: tl.constexpr, UNPACK_ROWS: tl.constexpr):  # fmt: skip
    """`_unpacked_global_rows` where UNPACK_ROWS (`MqaTiles.unpack_rows`), else `_global_rows`."""
    if UNPACK_ROWS:
        rows = _unpacked_global_rows(pool_ptr, row_index, valid, d0, D, BD, BLOCK_N)
    else:
        rows = _global_rows(pool_ptr, row_index, valid, d0, D, BD, BLOCK_N)
    return rows


@triton.jit
def _window_tile(
    window_ptr,
    window_index,
    seq,
    position,
    floor,
    ring_len,
    stride_window_seq,
    stride_window_row,
    w0,
    d0,
    WINDOW: tl.constexpr,
    WINDOW_IN_RING: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Window rows w0 .. w0 + BLOCK_N (columns d0 .. d0 + BD) as bf16, and which are real.

    Row `offset` holds key position start + offset (start = position − WINDOW + 1), real from
    the floor on. All per-row arithmetic is 32-bit (positions stay below 2^31): in the ring
    (ring_len ≥ WINDOW, as the launcher checks) key position p sits at row p % ring_len, which
    is start % ring_len + offset, less ring_len past the end (for start < 0 the real rows are
    start + offset < WINDOW). A remainder per row of the int64 positions called a 64-bit
    division routine per row, and the int64 vectors held registers the tiles need."""
    offset = w0 + tl.arange(0, BLOCK_N)
    start = (position - (WINDOW - 1)).to(tl.int32)
    valid = (offset >= (floor - start).to(tl.int32)) & (offset < WINDOW)
    if WINDOW_IN_RING:
        base = tl.where(start >= 0, start % ring_len, start)
        slot = base + offset
        slot = tl.where(slot >= ring_len, slot - ring_len, slot)
        row_index = tl.where(valid, slot, 0) * stride_window_row
        rows = _swa_rows(
            window_ptr + window_index * stride_window_seq, row_index, valid, d0, D, BD, BLOCK_N
        )
    else:
        d = d0 + tl.arange(0, BD)
        row_ptrs = (
            window_ptr
            + seq * stride_window_seq
            + (window_index + offset)[:, None] * stride_window_row
            + d[None, :]
        )
        rows = tl.load(row_ptrs, mask=valid[:, None], other=0.0).to(tl.bfloat16)
    return rows, valid


@triton.jit
def _selected_tile(
    selection_ptr, block_table_ptr, token, seq, tile, num_selected, stride_sel, stride_table,
    stride_pool_block, stride_pool_row, RATIO: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Byte offsets in the pool of the selected tile's rows [BLOCK_N], and which are real."""
    k = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.load(selection_ptr + token * stride_sel + k, mask=k < num_selected, other=-1)
    valid = j >= 0
    j = tl.where(valid, j, 0)
    block = tl.load(block_table_ptr + seq * stride_table + (j * RATIO) // 128)
    rows_per_block: tl.constexpr = 128 // RATIO
    return block * stride_pool_block + (j % rows_per_block) * stride_pool_row, valid


@triton.jit
def _token_rows(seq_ptr, position_ptr, window_index_ptr, window_floor_ptr, token,
                WINDOW_IN_RING: tl.constexpr, HAS_FLOOR: tl.constexpr):  # fmt: skip
    """(sequence, position, first visible window position, window index) of a token."""
    seq = tl.load(seq_ptr + token)
    position = tl.load(position_ptr + token)
    floor = 0
    if HAS_FLOOR:
        floor = tl.load(window_floor_ptr + seq)
    if WINDOW_IN_RING:  # the sequence's slot
        window_index = tl.load(window_index_ptr + seq)
    else:  # the token's first row in its sequence's rows
        window_index = tl.load(window_index_ptr + token)
    return seq, position, floor, window_index


@triton.jit
def _rotated_back(out, position, freq_ptr, d0, pass_width, BLOCK_D: tl.constexpr,
                  DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    """A token's output columns d0 .. d0 + BLOCK_D [BH, BLOCK_D] (fp32) rounded to `DTYPE`,
    the pairs at columns ≥ pass_width rotated by −position · freq (`kernels.rope`'s inverse
    rotation of the rounded values, its device functions); in `DTYPE`, ready to store."""
    out = round_to(out, DTYPE)
    if d0 + BLOCK_D > pass_width:  # the block holds rotated columns
        a, b = tl.split(tl.reshape(out, (out.shape[0], BLOCK_D // 2, 2)))
        even = d0 + 2 * tl.arange(0, BLOCK_D // 2)
        is_rotated = even >= pass_width
        freq = tl.load(freq_ptr + (even - pass_width) // 2, mask=is_rotated, other=0.0)
        c, s = cos_sin(position.to(tl.float32) * freq, -1.0, LIBDEVICE)
        rotated_even, rotated_odd = rotate(a, b, c[None, :], s[None, :])
        a = tl.where(is_rotated[None, :], round_to(rotated_even, DTYPE), a)
        b = tl.where(is_rotated[None, :], round_to(rotated_odd, DTYPE), b)
        out = tl.reshape(tl.join(a, b), (out.shape[0], BLOCK_D))
    return out.to(DTYPE)


# Integers that change from step to step (token and selection counts, prefill window lengths,
# block-table widths) are not specialised, so one compiled variant per `TILES` row, layer
# kind and window source serves every step (`warm_up.py`).
@triton.jit(
    do_not_specialize=[
        "num_tokens", "num_selected", "ring_len", "stride_window_seq", "stride_sel",
        "stride_table",
    ]
)  # fmt: skip
def _sparse_mqa_kernel(
    q_ptr,
    seq_ptr,
    position_ptr,
    window_ptr,
    window_index_ptr,
    window_floor_ptr,
    pool_ptr,
    selection_ptr,
    block_table_ptr,
    sink_ptr,
    out_ptr,
    m_part_ptr,
    total_part_ptr,
    acc_part_ptr,
    num_tokens,
    num_heads,
    num_selected,
    ring_len,
    softmax_scale,
    stride_qt,
    stride_qh,
    stride_window_seq,
    stride_window_row,
    stride_pool_block,
    stride_pool_row,
    stride_sel,
    stride_table,
    stride_ot,
    stride_oh,
    freq_ptr,
    pass_width,
    q_freq_ptr,
    q_pass_width,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_IN_RING: tl.constexpr,
    WINDOW_SEQ_ALIGNED: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    D: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    ROTATE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    ROTATE_Q: tl.constexpr,
    UNPACK_ROWS: tl.constexpr,
):
    """grid (tokens · heads / BLOCK_H · SPLITS · D / BLOCK_D), token-major
    (`_program_of_token`). With SPLITS = 1 the program
    writes its output columns (ROTATE: rounded and rotated back, `_rotated_back`); otherwise
    its split's running max and sum [SPLITS, T, H] and accumulator [SPLITS, T, H, D] for
    `_combine_kernel`. ROTATE_Q: the queries' RoPE as they are loaded (`_rotated_query`)."""
    if WINDOW_SEQ_ALIGNED:  # the launcher passed stride / 16: the rows' base is known aligned
        stride_window_seq = stride_window_seq * 16  # and they load in vectors
    token, first_head, column = _program_of_token(num_heads, BLOCK_H, SPLITS * (D // BLOCK_D))
    heads = first_head + tl.arange(0, BLOCK_H)
    split = column // (D // BLOCK_D)
    d0 = (column % (D // BLOCK_D)) * BLOCK_D
    is_head = heads < num_heads
    q_head, q_rest = _query_parts(
        q_ptr, token, heads, is_head, stride_qt, stride_qh, D, DOT_DTYPE, position_ptr,
        q_freq_ptr, q_pass_width, ROTATE_Q, LIBDEVICE,
    )  # fmt: skip
    # The running max starts finite, so an all-masked tile gives exp(...) = 0, not NaN.
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    seq, position, floor, window_index = _token_rows(
        seq_ptr, position_ptr, window_index_ptr, window_floor_ptr, token, WINDOW_IN_RING,
        HAS_FLOOR,
    )  # fmt: skip
    # Tile i of the token's rows (window tiles, then selected tiles) belongs to split i % SPLITS.
    window_tiles: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    for tile in range(split, window_tiles, SPLITS):
        rows, valid = _window_tile(
            window_ptr, window_index, seq, position, floor, ring_len, stride_window_seq,
            stride_window_row, tile * BLOCK_N, 0, WINDOW, WINDOW_IN_RING, D, D, BLOCK_N,
        )  # fmt: skip
        scores = _scores(q_head, q_rest, rows, softmax_scale, Q_SPLIT, DOT_DTYPE)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        if BLOCK_D != D:
            rows, valid = _window_tile(
                window_ptr, window_index, seq, position, floor, ring_len, stride_window_seq,
                stride_window_row, tile * BLOCK_N, d0, WINDOW, WINDOW_IN_RING, D, BLOCK_D,
                BLOCK_N,
            )  # fmt: skip
        m, total, acc = _online_update(m, total, acc, scores, rows, DOT_DTYPE)
    if RATIO > 0:
        first_tile = (split + (SPLITS - window_tiles % SPLITS)) % SPLITS
        for tile in range(first_tile, tl.cdiv(num_selected, BLOCK_N), SPLITS):
            row_index, valid = _selected_tile(
                selection_ptr, block_table_ptr, token, seq, tile, num_selected, stride_sel,
                stride_table, stride_pool_block, stride_pool_row, RATIO, BLOCK_N,
            )  # fmt: skip
            rows = _decoded_global_rows(pool_ptr, row_index, valid, 0, D, D, BLOCK_N, UNPACK_ROWS)
            scores = _scores(q_head, q_rest, rows, softmax_scale, Q_SPLIT, DOT_DTYPE)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            if BLOCK_D != D:
                rows = _decoded_global_rows(
                    pool_ptr, row_index, valid, d0, D, BLOCK_D, BLOCK_N, UNPACK_ROWS
                )
            m, total, acc = _online_update(m, total, acc, scores, rows, DOT_DTYPE)
    out_d = d0 + tl.arange(0, BLOCK_D)
    if SPLITS == 1:
        sink = tl.load(sink_ptr + heads, mask=is_head, other=0.0)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.exp(sink - m_new)
        out = acc * alpha[:, None] / total[:, None]
        if ROTATE:
            dtype = out_ptr.dtype.element_ty
            out = _rotated_back(out, position, freq_ptr, d0, pass_width, BLOCK_D, dtype, LIBDEVICE)
        out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + out_d[None, :]
        tl.store(out_ptrs, out, mask=is_head[:, None])
    else:
        part = (split * num_tokens + token) * num_heads + heads
        first_columns = is_head & (heads * 0 + d0 == 0)
        tl.store(m_part_ptr + part, m, mask=first_columns)
        tl.store(total_part_ptr + part, total, mask=first_columns)
        tl.store(acc_part_ptr + part[:, None] * D + out_d[None, :], acc, mask=is_head[:, None])


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(
    m_part_ptr,
    total_part_ptr,
    acc_part_ptr,
    sink_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    position_ptr,
    freq_ptr,
    pass_width,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    ROTATE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """grid (tokens, heads): one softmax from the splits' partials and the sink. A split that
    saw no real row (max −1e30, sum and accumulator 0) adds exact zeros. ROTATE: the output
    rounded and rotated back (`_rotated_back`)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (tl.arange(0, SPLITS) * num_tokens + token) * num_heads + head
    m = tl.load(m_part_ptr + part)
    total = tl.load(total_part_ptr + part)
    sink = tl.load(sink_ptr + head)
    m_all = tl.maximum(tl.max(m, axis=0), sink)
    weight = tl.exp(m - m_all)
    denominator = tl.sum(total * weight, axis=0) + tl.exp(sink - m_all)
    d = tl.arange(0, D)
    acc = tl.load(acc_part_ptr + part[:, None] * D + d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / denominator
    if ROTATE:
        position = tl.load(position_ptr + token)
        dtype = out_ptr.dtype.element_ty
        out = _rotated_back(out[None, :], position, freq_ptr, 0, pass_width, D, dtype, LIBDEVICE)
        out = tl.reshape(out, (D,))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out)


@triton.jit(
    do_not_specialize=[
        "num_selected", "ring_len", "stride_window_seq", "stride_sel", "stride_table",
        "stride_st", "stride_sh",
    ]
)  # fmt: skip
def _mqa_scores_kernel(
    q_ptr,
    seq_ptr,
    position_ptr,
    window_ptr,
    window_index_ptr,
    window_floor_ptr,
    pool_ptr,
    selection_ptr,
    block_table_ptr,
    sink_ptr,
    scores_ptr,
    m_ptr,
    total_ptr,
    num_heads,
    num_selected,
    ring_len,
    softmax_scale,
    stride_qt,
    stride_qh,
    stride_window_seq,
    stride_window_row,
    stride_pool_block,
    stride_pool_row,
    stride_sel,
    stride_table,
    stride_st,
    stride_sh,
    q_freq_ptr,
    q_pass_width,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_IN_RING: tl.constexpr,
    WINDOW_SEQ_ALIGNED: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    D: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROTATE_Q: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    UNPACK_ROWS: tl.constexpr,
):
    """Pass one of `MqaTiles.two_pass`, grid (tokens · heads / BLOCK_H), token-major: the
    scaled scores of
    the token's rows (window tiles, then selected tiles; −inf where a row is not real) into
    scores [T, H, columns] at column tile · BLOCK_N, and per head the max and the sum of
    exp(score − max) over them and the sink. ROTATE_Q: the queries' RoPE as they are loaded
    (`_rotated_query`)."""
    if WINDOW_SEQ_ALIGNED:
        stride_window_seq = stride_window_seq * 16
    token, first_head, _single = _program_of_token(num_heads, BLOCK_H, 1)
    heads = first_head + tl.arange(0, BLOCK_H)
    is_head = heads < num_heads
    q_head, q_rest = _query_parts(
        q_ptr, token, heads, is_head, stride_qt, stride_qh, D, DOT_DTYPE, position_ptr,
        q_freq_ptr, q_pass_width, ROTATE_Q, LIBDEVICE,
    )  # fmt: skip
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    seq, position, floor, window_index = _token_rows(
        seq_ptr, position_ptr, window_index_ptr, window_floor_ptr, token, WINDOW_IN_RING,
        HAS_FLOOR,
    )  # fmt: skip
    score_ptrs = scores_ptr + token * stride_st + heads[:, None] * stride_sh
    score_ptrs += tl.arange(0, BLOCK_N)[None, :]
    window_tiles: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    for tile in range(window_tiles):
        rows, valid = _window_tile(
            window_ptr, window_index, seq, position, floor, ring_len, stride_window_seq,
            stride_window_row, tile * BLOCK_N, 0, WINDOW, WINDOW_IN_RING, D, D, BLOCK_N,
        )  # fmt: skip
        scores = _scores(q_head, q_rest, rows, softmax_scale, Q_SPLIT, DOT_DTYPE)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        tl.store(score_ptrs + tile * BLOCK_N, scores, mask=is_head[:, None])
        m, total, _, _ = _fold_scores(m, total, scores)
    if RATIO > 0:
        for tile in range(tl.cdiv(num_selected, BLOCK_N)):
            row_index, valid = _selected_tile(
                selection_ptr, block_table_ptr, token, seq, tile, num_selected, stride_sel,
                stride_table, stride_pool_block, stride_pool_row, RATIO, BLOCK_N,
            )  # fmt: skip
            rows = _decoded_global_rows(pool_ptr, row_index, valid, 0, D, D, BLOCK_N, UNPACK_ROWS)
            scores = _scores(q_head, q_rest, rows, softmax_scale, Q_SPLIT, DOT_DTYPE)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            tl.store(score_ptrs + (window_tiles + tile) * BLOCK_N, scores, mask=is_head[:, None])
            m, total, _, _ = _fold_scores(m, total, scores)
    sink = tl.load(sink_ptr + heads, mask=is_head, other=0.0)
    m_new = tl.maximum(m, sink)
    total = total * tl.exp(m - m_new) + tl.exp(sink - m_new)
    tl.store(m_ptr + token * num_heads + heads, m_new, mask=is_head)
    tl.store(total_ptr + token * num_heads + heads, total, mask=is_head)


@triton.jit(
    do_not_specialize=[
        "num_selected", "ring_len", "stride_window_seq", "stride_sel", "stride_table",
        "stride_st", "stride_sh",
    ]
)  # fmt: skip
def _mqa_values_kernel(
    seq_ptr,
    position_ptr,
    window_ptr,
    window_index_ptr,
    window_floor_ptr,
    pool_ptr,
    selection_ptr,
    block_table_ptr,
    scores_ptr,
    m_ptr,
    total_ptr,
    out_ptr,
    num_heads,
    num_selected,
    ring_len,
    stride_window_seq,
    stride_window_row,
    stride_pool_block,
    stride_pool_row,
    stride_sel,
    stride_table,
    stride_st,
    stride_sh,
    stride_ot,
    stride_oh,
    freq_ptr,
    pass_width,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_IN_RING: tl.constexpr,
    WINDOW_SEQ_ALIGNED: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
    D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTATE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    UNPACK_ROWS: tl.constexpr,
):
    """Pass two of `MqaTiles.two_pass`, grid (tokens · heads / BLOCK_H · D / BLOCK_D),
    token-major (the column blocks of a token's scores side by side): the
    output columns d0 .. d0 + BLOCK_D, Σ exp(score − max) · row / sum, over the same tiles
    (ROTATE: rounded and rotated back, `_rotated_back`)."""
    if WINDOW_SEQ_ALIGNED:
        stride_window_seq = stride_window_seq * 16
    token, first_head, column = _program_of_token(num_heads, BLOCK_H, D // BLOCK_D)
    heads = first_head + tl.arange(0, BLOCK_H)
    d0 = column * BLOCK_D
    is_head = heads < num_heads
    m = tl.load(m_ptr + token * num_heads + heads, mask=is_head, other=0.0)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    seq, position, floor, window_index = _token_rows(
        seq_ptr, position_ptr, window_index_ptr, window_floor_ptr, token, WINDOW_IN_RING,
        HAS_FLOOR,
    )  # fmt: skip
    score_ptrs = scores_ptr + token * stride_st + heads[:, None] * stride_sh
    score_ptrs += tl.arange(0, BLOCK_N)[None, :]
    window_tiles: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    for tile in range(window_tiles):
        rows, valid = _window_tile(
            window_ptr, window_index, seq, position, floor, ring_len, stride_window_seq,
            stride_window_row, tile * BLOCK_N, d0, WINDOW, WINDOW_IN_RING, D, BLOCK_D, BLOCK_N,
        )  # fmt: skip
        scores = tl.load(score_ptrs + tile * BLOCK_N, mask=is_head[:, None], other=float("-inf"))
        acc += _split_dot(tl.exp(scores - m[:, None]), rows, DOT_DTYPE)
    if RATIO > 0:
        for tile in range(tl.cdiv(num_selected, BLOCK_N)):
            row_index, valid = _selected_tile(
                selection_ptr, block_table_ptr, token, seq, tile, num_selected, stride_sel,
                stride_table, stride_pool_block, stride_pool_row, RATIO, BLOCK_N,
            )  # fmt: skip
            rows = _decoded_global_rows(
                pool_ptr, row_index, valid, d0, D, BLOCK_D, BLOCK_N, UNPACK_ROWS
            )
            scores = tl.load(
                score_ptrs + (window_tiles + tile) * BLOCK_N,
                mask=is_head[:, None],
                other=float("-inf"),
            )
            acc += _split_dot(tl.exp(scores - m[:, None]), rows, DOT_DTYPE)
    total = tl.load(total_ptr + token * num_heads + heads, mask=is_head, other=1.0)
    out_d = d0 + tl.arange(0, BLOCK_D)
    out_ptrs = out_ptr + token * stride_ot + heads[:, None] * stride_oh + out_d[None, :]
    out = acc / total[:, None]
    if ROTATE:
        dtype = out_ptr.dtype.element_ty
        out = _rotated_back(out, position, freq_ptr, d0, pass_width, BLOCK_D, dtype, LIBDEVICE)
    tl.store(out_ptrs, out, mask=is_head[:, None])


GlobalRows = tuple[Tensor, Tensor, Tensor, int]


def _two_passes(
    q, seq_of_token, positions, sources, sink, out, num_selected, softmax_scale, row_strides,
    tiles, block_d, common, rotation, q_rotation,
) -> None:  # fmt: skip
    """`MqaTiles.two_pass` over the tokens of `q` (sources and out sliced to them)."""
    num_tokens, num_heads, dim = q.shape
    rows = sources[0]
    window_tiles = -(-common["WINDOW"] // tiles.block_n)
    columns = (window_tiles + -(-num_selected // tiles.block_n)) * tiles.block_n
    scores = torch.empty(num_tokens, num_heads, columns, device=q.device)
    m_all = torch.empty(num_tokens, num_heads, device=q.device)
    total_all = torch.empty_like(m_all)
    score_strides = (scores.stride(0), scores.stride(1))
    _mqa_scores_kernel[_token_major_grid(num_tokens, num_heads, tiles.block_h, 1)](
        q, seq_of_token, positions, *sources, sink, scores, m_all, total_all, num_heads,
        num_selected, rows.shape[1], softmax_scale, q.stride(0), q.stride(1),
        *row_strides, *score_strides, Q_SPLIT=q.dtype != torch.bfloat16, **common,
        **q_rotation, LIBDEVICE=_LIBDEVICE,
    )  # fmt: skip
    freqs, pass_width, rotating = rotation
    values_grid = _token_major_grid(num_tokens, num_heads, tiles.block_h, dim // block_d)
    _mqa_values_kernel[values_grid](
        seq_of_token, positions, *sources, scores, m_all, total_all, out, num_heads,
        num_selected, rows.shape[1], *row_strides, *score_strides, out.stride(0),
        out.stride(1), freqs, pass_width, BLOCK_D=block_d, **common, **rotating,
    )  # fmt: skip


def sparse_mqa(
    q: Tensor,
    seq_of_token: Tensor,
    positions: Tensor,
    sink: Tensor,
    window: int,
    softmax_scale: float,
    *,
    ring: tuple[Tensor, Tensor] | None = None,
    window_rows: tuple[Tensor, Tensor] | None = None,
    global_rows: GlobalRows | None = None,
    window_floor: Tensor | None = None,
    fixed_tiles: bool = False,
    tiles: MqaTiles | None = None,
    rotate_back: Tensor | None = None,
    rotate_q: Tensor | None = None,
    q_scratch: bool = False,
) -> Tensor:
    """fp32 [T, H, D] attention output of T query tokens (with `rotate_back`: in q's dtype).

    q: [T, H, D] (bf16 or fp32). seq_of_token, positions: int64 [T] (the token's sequence
    index b and position). sink: fp32 [H]. The window comes from exactly one of
      ring: (uint8 [slots, R, D + D/32] MXFP8 rows, slots int64 [B]); every position a token
        reads already written (R > window, so a step may write its own rows first);
      window_rows: (bf16 [B, L, D], first int64 [T]): token t reads rows first[t] .. first[t] +
        window − 1 of its sequence, the last one being its own position.
    global_rows: (pool uint8 [blocks, 128/ratio, D/2 + D/16], selection int64 [T, K] with −1
    for none, block_tables int64 [B, max_blocks], ratio) for layers with a KV source.
    window_floor: int64 [B], sequence b's window rows below position window_floor[b] are
    invisible (a prefix-cache replay: the ring holds no rows before its floor).
    fixed_tiles: `FIXED_TILES` whatever the shapes (batch-invariant mode): a token's result
    is then the same whichever tokens share the launch, given the same rows in the same order
    (extra −1 selections past its own add nothing: their tiles fold in as exact no-ops).
    tiles: a launch shape of its own (benchmarks, tests); default `choose_tiles(T)`.
    rotate_back: fp32 frequencies [R ≤ D/2] of the rotated tail: the output is
    `apply_rope(out.to(q.dtype), positions, rotate_back, inverse=True)` (`kernels.rope`), bit
    for bit, from the same launches.
    rotate_q: fp32 frequencies [R ≤ D/2] of the queries' rotated tail: the result is that of
    `apply_rope(q, positions, rotate_q)` (`kernels.rope`, rounded to q's dtype) as q (bit for
    bit in decode launches, module docstring); applied as the queries are loaded (without that
    launch) where `tiles.rotates_q`.
    q_scratch: the caller does not read q again: where the tiles take the rope launch, it
    rotates q in place (only the rotated channels move, `apply_rope(in_place=True)`).

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take (D not a power of two
            ≥ 32, an empty window, non-unit row strides, not exactly one window source, tiles
            that do not divide D, a rotated tail wider than D).
    """
    num_tokens, num_heads, dim = q.shape
    if dim < 32 or dim & (dim - 1) or window < 1:
        raise ValueError(
            "need a power-of-two head dim >= 32 and a window of at least one row; got "
            f"dim {dim}, window {window}"
        )
    if (ring is None) == (window_rows is None):
        raise ValueError("give the window as exactly one of ring= or window_rows=")
    if q.stride(-1) != 1 or sink.dtype != torch.float32 or sink.shape != (num_heads,):
        raise ValueError("q needs unit column stride; sink must be fp32 [heads]")
    if ring is not None:
        rows, window_index = ring
        if rows.dtype != torch.uint8 or rows.shape[-1] != dim + dim // 32:
            raise ValueError(f"ring must be uint8 [.., .., {dim + dim // 32}]")
        if rows.shape[1] < window:
            raise ValueError(f"a ring of {rows.shape[1]} rows cannot hold a window of {window}")
    else:
        rows, window_index = window_rows
        if (
            rows.dtype != torch.bfloat16
            or rows.shape[-1] != dim
            or window_index.shape != (num_tokens,)
        ):
            raise ValueError(f"window rows must be bf16 [B, L, {dim}] with a first row per token")
    if rows.stride(-1) != 1:
        raise ValueError("window rows need unit column stride")
    if window_floor is not None and (window_floor.dtype != torch.long or window_floor.dim() != 1):
        raise ValueError("window_floor must be int64 [sequences]")
    if tiles is None:
        tiles = FIXED_TILES if fixed_tiles else choose_tiles(num_tokens)
        if tiles.gluon and not _gluon_runs(q, window_rows, global_rows):
            tiles = GLUON_FALLBACK
        if tiles.unpack_rows and not _unpack_rows_runs(global_rows):
            tiles = dataclasses.replace(tiles, unpack_rows=False)  # the same rows, bit for bit
    elif tiles.gluon and not _gluon_runs(q, window_rows, global_rows):
        raise ValueError(
            f"tiles {tiles}: the Gluon kernel needs sm90, bf16 queries of width 64..512 and "
            "16-byte window rows, 4-byte pool rows"
        )
    block_d = min(tiles.block_d or dim, dim)
    if block_d < 32 or dim % block_d or tiles.splits & (tiles.splits - 1):
        raise ValueError(f"tiles {tiles} need 32 <= block_d | {dim} and power-of-two splits")
    if tiles.two_pass and tiles.splits != 1:
        raise ValueError(f"tiles {tiles}: two passes take no row splits")
    if tiles.persistent and (not tiles.gluon or tiles.splits != 1):
        raise ValueError(f"tiles {tiles}: persistent programs are the Gluon kernel's, unsplit")
    if tiles.unpack_rows and _INTERPRETING:
        raise ValueError(f"tiles {tiles}: the rows' inline-PTX unpack needs a GPU")
    for freqs in (rotate_back, rotate_q):
        if freqs is not None and 2 * freqs.numel() > dim:
            raise ValueError(f"{2 * freqs.numel()} rotated channels do not fit D = {dim}")
    check_runnable(q, "sparse_mqa")
    # the rope launch first where the programs do not rotate q as they load it (`MqaTiles`;
    # the Gluon kernel never does)
    if rotate_q is not None and (not tiles.rotates_q or tiles.gluon):
        q, rotate_q = (
            apply_rope(q, positions, rotate_q, in_place=q_scratch and q.is_contiguous()),
            None,
        )
    out_dtype = torch.float32 if rotate_back is None else q.dtype
    out = torch.empty(num_tokens, num_heads, dim, dtype=out_dtype, device=q.device)
    freqs, pass_width, is_rotated = _rotation(rotate_back, dim, sink)
    rotation = (freqs, pass_width, {"ROTATE": is_rotated, "LIBDEVICE": _LIBDEVICE})
    freqs, pass_width, is_rotated = _rotation(rotate_q, dim, sink)
    q_rotation = {"q_freq_ptr": freqs, "q_pass_width": pass_width, "ROTATE_Q": is_rotated}
    if global_rows is None:
        pool, selection, tables, ratio = rows, positions[:, None], positions[:, None], 0
    else:
        pool, selection, tables, ratio = global_rows
        if pool.dtype != torch.uint8 or pool.shape[-2:] != (128 // ratio, dim // 2 + dim // 16):
            raise ValueError(f"pool must be uint8 [blocks, {128 // ratio}, {dim // 2 + dim // 16}]")
        if selection.shape[0] != num_tokens:
            raise ValueError("the selection needs one row per token")
        if tiles.unpack_rows and not _unpack_rows_runs(global_rows):
            raise ValueError(f"tiles {tiles} read the pool's rows as 32-bit words: 4-byte rows")
    if not num_tokens:
        return out
    # The per-sequence stride of the window rows is a multiple of 16 elements for every model
    # but the smallest (ring rows of 33·D/32 bytes, bf16 rows of D). It varies with the prefill
    # window, so it is not specialised; the kernel learns its alignment from a constexpr (that
    # alone is 1.2-1.7x of the decode launch, `benchmarks/kernel_specialisation.py`).
    window_seq_aligned = rows.stride(0) % 16 == 0
    common = {
        "RATIO": ratio,
        "WINDOW": window,
        "WINDOW_IN_RING": ring is not None,
        "WINDOW_SEQ_ALIGNED": window_seq_aligned,
        "HAS_FLOOR": window_floor is not None,
        "D": dim,
        "DOT_DTYPE": _DOT_DTYPE,
        "BLOCK_H": tiles.block_h,
        "BLOCK_N": tiles.block_n,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        "UNPACK_ROWS": tiles.unpack_rows,
    }
    sources = (
        rows,
        window_index,
        window_index if window_floor is None else window_floor,
        pool,
        selection,
        tables,
    )
    num_selected = selection.shape[1] if ratio else 0
    row_strides = (
        rows.stride(0) // 16 if window_seq_aligned else rows.stride(0),
        rows.stride(1),
        pool.stride(0),
        pool.stride(1),
        selection.stride(0),
        tables.stride(0),
    )
    if tiles.gluon:
        _gluon_attention(
            q, seq_of_token, positions, sources, sink, out, softmax_scale, tiles, ratio,
            window, ring is not None, window_floor is not None, rotate_back, rotation,
        )  # fmt: skip
        return out
    if tiles.two_pass:
        window_per_token = ring is None
        for start in range(0, num_tokens, TWO_PASS_TOKENS):
            part = slice(start, start + TWO_PASS_TOKENS)
            first = window_index[part] if window_per_token else window_index
            group_sources = (
                rows,
                first,
                first if window_floor is None else window_floor,
                pool,
                selection[part],
                tables if ratio else tables[part],  # without a KV source: per token
            )
            _two_passes(
                q[part], seq_of_token[part], positions[part], group_sources, sink, out[part],
                num_selected, softmax_scale, row_strides, tiles, block_d, common, rotation,
                q_rotation,
            )  # fmt: skip
        return out
    splits = tiles.splits
    partials = _split_partials(splits, q) if splits > 1 else (out, out, out)
    freqs, pass_width, rotating = rotation
    grid = _token_major_grid(num_tokens, num_heads, tiles.block_h, splits * (dim // block_d))
    _sparse_mqa_kernel[grid](
        q, seq_of_token, positions, *sources, sink, out, *partials, num_tokens, num_heads,
        num_selected, rows.shape[1], softmax_scale, q.stride(0), q.stride(1), *row_strides,
        out.stride(0), out.stride(1), freqs, pass_width, Q_SPLIT=q.dtype != torch.bfloat16,
        BLOCK_D=block_d, SPLITS=splits, **common, **rotating, **q_rotation,
    )  # fmt: skip
    if splits > 1:
        _combine(partials, sink, out, positions, rotation)
    return out


def _split_partials(splits: int, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The row splits' partial max and sum (fp32 [splits, T, H]) and accumulators (fp32
    [splits, T, H, D]) of the launch of queries q."""
    num_tokens, num_heads, dim = q.shape
    m_part = torch.empty(splits, num_tokens, num_heads, device=q.device)
    acc_part = torch.empty(splits, num_tokens, num_heads, dim, device=q.device)
    return m_part, torch.empty_like(m_part), acc_part


def _combine(partials: tuple[Tensor, Tensor, Tensor], sink, out, positions, rotation) -> None:
    """`_combine_kernel`: out from the row splits' partials (`_split_partials`) and the sink,
    rotated back in its store where `rotation` (`sparse_mqa`'s, of `rotate_back`) says."""
    splits, num_tokens, num_heads, dim = partials[2].shape
    freqs, pass_width, rotating = rotation
    _combine_kernel[(num_tokens, num_heads)](
        *partials, sink, out, num_tokens, num_heads, out.stride(0), out.stride(1), positions,
        freqs, pass_width, D=dim, SPLITS=splits, num_warps=4, **rotating,
    )  # fmt: skip


def _gluon_attention(
    q, seq_of_token, positions, sources, sink, out, softmax_scale, tiles, ratio, window,
    window_in_ring, has_floor, rotate_back, rotation,
) -> None:  # fmt: skip
    """`MqaTiles.gluon`: `sparse_mqa_gluon.launch` into out, with row splits through
    `_combine` (which rotates back in its store), else the output's inverse RoPE as its own
    launch on the rounded output (the same bits as `_rotated_back`)."""
    shape = {"ratio": ratio, "window": window, "window_in_ring": window_in_ring}
    shape |= {"has_floor": has_floor, "block_n": tiles.block_n, "persistent": tiles.persistent}
    if tiles.splits == 1:
        sparse_mqa_gluon.launch(q, seq_of_token, positions, sources, sink, out, softmax_scale,
                                **shape)  # fmt: skip
        if rotate_back is not None:
            apply_rope(out, positions, rotate_back, inverse=True, in_place=True)
        return
    m_part, total_part, acc_part = partials = _split_partials(tiles.splits, q)
    sparse_mqa_gluon.launch(q, seq_of_token, positions, sources, sink, acc_part, softmax_scale,
                            partials=(m_part, total_part), **shape)  # fmt: skip
    _combine(partials, sink, out, positions, rotation)


def _rotation(freqs: Tensor | None, dim: int, placeholder: Tensor) -> tuple[Tensor, int, bool]:
    """(fp32 frequencies, width of the unrotated head, whether to rotate) of a rotated tail as
    the kernels take them; without one, `placeholder` and 0 (the flag alone picks the variant).
    """
    if freqs is None:
        return placeholder, 0, False
    freqs = freqs.to(device=placeholder.device, dtype=torch.float32).contiguous()
    return freqs, dim - 2 * freqs.numel(), True


def sparse_mqa_reference(
    q: Tensor,
    seq_of_token: Tensor,
    positions: Tensor,
    sink: Tensor,
    window: int,
    softmax_scale: float,
    *,
    ring: tuple[Tensor, Tensor] | None = None,
    window_rows: tuple[Tensor, Tensor] | None = None,
    global_rows: GlobalRows | None = None,
    window_floor: Tensor | None = None,
    rotate_back: Tensor | None = None,
    rotate_q: Tensor | None = None,
) -> Tensor:
    """`sparse_mqa` in plain torch: (with `rotate_q`, `kernels.rope`'s reference rotation of
    q first) decode the rows, one softmax (then, with `rotate_back`, the reference rotation of
    the output rounded to q's dtype)."""
    if rotate_q is not None:
        q = apply_rope_reference(q, positions, rotate_q)
    offsets = torch.arange(window, device=q.device)
    key_positions = positions[:, None] - (window - 1) + offsets[None, :]  # [T, W]
    if ring is not None:
        stored, slots = ring
        slot = slots[seq_of_token][:, None]
        rows = mxfp8_rows_to_float(stored[slot, key_positions.clamp(min=0) % stored.shape[1]])
    else:
        stored, first = window_rows
        index = (first[:, None] + offsets[None, :]).clamp(max=stored.shape[1] - 1)
        rows = stored[seq_of_token[:, None], index].float()
    floor = 0 if window_floor is None else window_floor[seq_of_token][:, None]
    masks = [key_positions >= floor]
    if global_rows is not None:
        pool, selection, tables, ratio = global_rows
        j = selection.clamp(min=0)
        blocks = torch.gather(tables[seq_of_token], 1, j * ratio // 128)
        selected = fp4_rows_to_float(pool[blocks, j % (128 // ratio)])
        rows = torch.cat((rows, selected), 1)
        masks.append(selection >= 0)
    scores = torch.einsum("thd,tkd->thk", q.float(), rows) * softmax_scale
    scores = scores.masked_fill(~torch.cat(masks, 1)[:, None, :], float("-inf"))
    sinks = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat((scores, sinks), -1).softmax(-1)[..., :-1]
    out = torch.einsum("thk,tkd->thd", probs, rows)
    if rotate_back is None:
        return out
    return apply_rope_reference(out.to(q.dtype), positions, rotate_back, inverse=True)
