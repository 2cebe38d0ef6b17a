"""`sparse_mqa`'s attention in one pass over full-width rows, written in Gluon for Hopper: every
head of a token in one program (the wgmma's M = 64), every output column in it, the rows
decoded once into shared memory and read there by both products (FlashMLA's layout, which
Triton's `tl.dot` path spilled on):

    per program: one token's 64 heads; q [64, D] bf16 in shared memory (cp.async)
    per tile of BLOCK_N rows (the window's, then the selected ones):
        rows -> shared memory [BLOCK_N, D] bf16 (bf16 window rows by cp.async; MXFP8 ring
                rows and FP4 pool rows decoded in registers, stored)
        S = q · rowsᵀ                          wgmma, the two warpgroups half the rows each
        online softmax over S (each warpgroup's row maxima exchanged through shared memory)
        P = exp(S − max) as a bf16 head and remainder in shared memory (~16 bits, as the
            Triton kernels' `_split_dot`)
        O[:, half w] = O · alpha + P_head · rows + P_rest · rows   wgmma, warpgroup w: D/2
                columns of O (128 fp32 registers a thread at D = 512); the sums likewise as
                P · ones (no cross-warpgroup sum per tile)
      the next tile's rows are loaded and decoded while the tensor cores run P · rows.
    end: the sink folded in, O / sum stored (fp32, or rounded to q's dtype); with row splits
    (SPLITS programs per token, tile i to split i % SPLITS, for decode steps of few tokens)
    the partial max, sum and O for `sparse_mqa._combine_kernel`. PERSISTENT: one program per
    SM over the tokens, the next token's q and first tile loaded while the current token's
    last products run (its prologue otherwise waits on those copies alone).

Against the Triton two-pass kernels (`sparse_mqa._mqa_scores_kernel`, `_mqa_values_kernel`) a
4,096-token chunk's scores make no round trip through memory (~2.7 GB per layer) and each row
is decoded once per token instead of once per column block.

Contract (what `launch` checks): q bf16 [T, H, D] with D a power of two from 64 to 512 (the
products' N per warpgroup at most 256), any H (programs of 64 heads, the missing ones zero
and never stored), rows as `sparse_mqa` takes them, a pool whose rows start on 4-byte
boundaries (32-bit word loads). The RoPE of queries and output stays with the caller
(`kernels.rope` launches, the same bits as `sparse_mqa`'s rounding then rotation).

Gluon is experimental: `AVAILABLE` is False where this Triton lacks it, and `runs_here` False
off sm90; `sparse_mqa` then keeps its Triton shapes. The torch reference is
`sparse_mqa.sparse_mqa_reference`; the `gpu` tests compare with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import multiprocessors, on_sm90
from kernels.mxfp4_unpack import UNPACK_0, UNPACK_1, UNPACK_2, UNPACK_3, reads_as_words

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Triton 3.6 names the cp.async copy `async_copy_global_to_shared`, later ones `async_load`
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # and its CTA barrier `thread_barrier`, later ones `barrier`
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    AVAILABLE = True
except (ImportError, AttributeError):  # a Triton without (this) Gluon
    AVAILABLE = False

HEADS = 64  # query heads per program: the wgmma's M
NUM_WARPS = 8  # two warpgroups, each owning half of the output columns
CHUNK = 256  # columns of a tile decoded in registers at once
BLOCK_NS = (32, 64)  # rows per tile that fit shared memory beside q at D = 512
SUM_COLUMNS = 16  # P · ones [BLOCK_N, SUM_COLUMNS]: the wgmma's narrowest N, 8 per warpgroup


if AVAILABLE:
    _HEADS = gl.constexpr(HEADS)
    _SUM_COLUMNS = gl.constexpr(SUM_COLUMNS)
    # bf16 2^118 in both halves: the unpack's e2m1 · 2^-126 becomes e2m1 · 2^-8 (normal, exact)
    _PRESCALE = gl.constexpr(0x7A807A80)
    _BF16X2_PRODUCT = gl.constexpr("mul.rn.bf16x2 $0, $1, $2;")

    @gluon.constexpr_function
    def _product_layout(n):
        """Accumulator of [64, n]: the two warpgroups take n / 2 columns each."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16]
        )

    @gluon.constexpr_function
    def _chunk_width(d):
        """Columns of a tile decoded in registers at once: CHUNK, or all of a narrower D."""
        return min(CHUNK, d)

    @gluon.constexpr_function
    def _bf16_rows_layout():
        """[rows, columns] bf16 tiles (q, window rows, the ones): 8 contiguous values, 16 bytes,
        per thread (one `cp.async` each)."""
        return gl.BlockedLayout(
            size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0]
        )

    @gluon.jit
    def _window_valid(offset, position, floor, WINDOW: gl.constexpr):
        """Which window rows `offset` (row i: key position p − WINDOW + 1 + i) are real."""
        start = (position - (WINDOW - 1)).to(gl.int32)
        return (offset >= (floor - start).to(gl.int32)) & (offset < WINDOW)

    @gluon.jit
    def _selected_rows(selection_ptr, block_table_ptr, token, seq, k, num_selected, stride_sel,
                       stride_table, stride_pool_block, stride_pool_row,
                       RATIO: gl.constexpr):  # fmt: skip
        """Byte offsets in the pool of selected rows k, and which are real."""
        j = gl.load(selection_ptr + token * stride_sel + k, mask=k < num_selected, other=-1)
        valid = j >= 0
        j = gl.where(valid, j, 0)
        block = gl.load(block_table_ptr + seq * stride_table + (j * RATIO) // 128)
        rows_per_block: gl.constexpr = 128 // RATIO
        return block * stride_pool_block + (j % rows_per_block) * stride_pool_row, valid

    @gluon.jit
    def _scaled(packed, pairs):
        """bf16 [.., 2] of the bf16x2 registers `packed` times `pairs` (low half, high half)."""
        product = gl.inline_asm_elementwise(
            _BF16X2_PRODUCT, "=r,r,r", [packed, pairs], gl.int32, is_pure=True, pack=1
        )
        low = (product & 0xFFFF).to(gl.uint16).to(gl.bfloat16, bitcast=True)
        return gl.join(low, (product >> 16).to(gl.uint16).to(gl.bfloat16, bitcast=True))

    @gluon.constexpr_function
    def _fp4_words_layout(block_n, width):
        """[block_n, width / 8] words of codes over the 256 threads exactly once, each thread's
        words contiguous (one vector load)."""
        words = width // 8
        per_thread = min(4, max(1, block_n * words // 256))
        lanes = words // per_thread
        return gl.BlockedLayout(
            size_per_thread=[1, per_thread], threads_per_warp=[32 // lanes, lanes],
            warps_per_cta=[8, 1], order=[1, 0],
        )  # fmt: skip

    @gluon.jit
    def _fp4_chunk_loads(row_ptrs, is_row, chunk, D: gl.constexpr, WIDTH: gl.constexpr,
                         BLOCK_N: gl.constexpr):  # fmt: skip
        """The words [rows, WIDTH / 8] of codes of columns chunk · WIDTH .. of FP4 rows
        (`_fp4_words_layout`) and the e4m3 scale byte of each word's 16 columns (int32): a
        thread holding both words of a scale loads it once and pairs it with both."""
        layout: gl.constexpr = _fp4_words_layout(BLOCK_N, WIDTH)
        per_thread: gl.constexpr = layout.size_per_thread[1]
        word = chunk * (WIDTH // 8) + gl.arange(0, WIDTH // 8, layout=gl.SliceLayout(0, layout))
        words = gl.load(row_ptrs.to(gl.pointer_type(gl.int32)) + word[None, :], mask=is_row,
                        other=0)  # fmt: skip
        scale_ptrs = row_ptrs + D // 2
        if per_thread == 1:
            scale_bytes = gl.load(scale_ptrs + (word // 2)[None, :], mask=is_row, other=0)
        else:
            pairs: gl.constexpr = gl.BlockedLayout(
                size_per_thread=[1, per_thread // 2],
                threads_per_warp=layout.threads_per_warp, warps_per_cta=[8, 1], order=[1, 0],
            )  # fmt: skip
            group = chunk * (WIDTH // 16) + gl.arange(
                0, WIDTH // 16, layout=gl.SliceLayout(0, pairs)
            )
            rows_ptrs = gl.convert_layout(scale_ptrs, pairs)
            row_mask = gl.convert_layout(is_row, pairs)
            groups = gl.load(rows_ptrs + group[None, :], mask=row_mask, other=0)
            both = gl.reshape(gl.join(groups, groups), [BLOCK_N, WIDTH // 8])  # word w: w // 2
            scale_bytes = gl.convert_layout(both, layout)
        return words, scale_bytes.to(gl.int32)

    @gluon.jit
    def _fp4_chunk_store(rows_smem, words, scale_bytes, chunk, BLOCK_N: gl.constexpr,
                         WIDTH: gl.constexpr):  # fmt: skip
        """A chunk's words and scales (`_fp4_chunk_loads`) as exact bf16 into columns
        chunk · WIDTH .. of `rows_smem`: each word through the expert GEMM's unpack (e2m1 ·
        2^-8), then one bf16x2 multiply by its scale · 2^8 (exact: at most 6 significant bits,
        between 2^-10 and 2^12)."""
        # e4m3 at fp16 bits reads as e4m3 · 2^-8; · 2^16 gives the multiplier e4m3 · 2^8
        bits = ((scale_bytes & 0x80) << 8) | ((scale_bytes & 0x7F) << 7)
        scales = bits.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32) * 65536.0
        scales = scales.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        pairs = scales | (scales << 16)
        args = [words, gl.full(words.shape, _PRESCALE, gl.int32, words.type.layout)]
        out0 = gl.inline_asm_elementwise(UNPACK_0, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out1 = gl.inline_asm_elementwise(UNPACK_1, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out2 = gl.inline_asm_elementwise(UNPACK_2, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        out3 = gl.inline_asm_elementwise(UNPACK_3, "=r,r,r", args, gl.int32, is_pure=True, pack=1)
        # out j holds values 8w + j (low half) and 8w + j + 4 (high half) of word w
        values = gl.join(
            gl.join(_scaled(out0, pairs), _scaled(out1, pairs)),
            gl.join(_scaled(out2, pairs), _scaled(out3, pairs)),
        )  # [N, W, h, j & 1, j >> 1]
        values = gl.permute(values, [0, 1, 2, 4, 3])  # [N, W, h, j >> 1, j & 1]
        values = gl.reshape(values, [BLOCK_N, WIDTH])  # column 8w + 4h + j
        rows_smem.slice(chunk * WIDTH, WIDTH, dim=1).store(values)

    @gluon.jit
    def _store_fp4_rows(rows_smem, pool_ptr, row_offset, valid, D: gl.constexpr,
                        BLOCK_N: gl.constexpr):  # fmt: skip
        """FP4 pool rows (D/2 bytes of e2m1 pairs, then D/16 e4m3 scales) as exact bf16 into
        `rows_smem` [BLOCK_N, D] (`_fp4_chunk_store`), CHUNK columns at a time: both chunks'
        loads issued first (D <= 512: one or two chunks), so their latencies overlap (the
        compiler puts a barrier between the stores of one buffer's slices)."""
        width: gl.constexpr = _chunk_width(D)
        layout: gl.constexpr = _fp4_words_layout(BLOCK_N, width)
        chunks: gl.constexpr = D // width
        gl.static_assert(chunks <= 2, "D <= 2 * CHUNK")
        offsets = gl.convert_layout(row_offset, gl.SliceLayout(1, layout))
        is_row = gl.convert_layout(valid, gl.SliceLayout(1, layout))[:, None]
        row_ptrs = pool_ptr + offsets[:, None]
        words0, scales0 = _fp4_chunk_loads(row_ptrs, is_row, 0, D, width, BLOCK_N)
        if chunks > 1:
            words1, scales1 = _fp4_chunk_loads(row_ptrs, is_row, 1, D, width, BLOCK_N)
        _fp4_chunk_store(rows_smem, words0, scales0, 0, BLOCK_N, width)
        if chunks > 1:
            _fp4_chunk_store(rows_smem, words1, scales1, 1, BLOCK_N, width)

    @gluon.constexpr_function
    def _ring_layout():
        """[rows, groups of 32 columns, 32] MXFP8 codes: 16 of one group per thread."""
        return gl.BlockedLayout(
            size_per_thread=[1, 1, 16], threads_per_warp=[4, 4, 2], warps_per_cta=[8, 1, 1],
            order=[2, 1, 0],
        )  # fmt: skip

    @gluon.jit
    def _store_ring_rows(rows_smem, ring_ptr, row_offset, valid, D: gl.constexpr,
                         BLOCK_N: gl.constexpr):  # fmt: skip
        """MXFP8 ring rows (D e4m3 codes, then D/32 ue8m0 scales) as exact bf16 into
        `rows_smem` [BLOCK_N, D], CHUNK columns at a time, as [rows, groups of 32, 32]
        (`_ring_layout`): each thread holds 16 codes of one group and loads the group's scale
        once. row_offset and valid [BLOCK_N] in that layout's rows."""
        layout: gl.constexpr = _ring_layout()
        groups: gl.constexpr = gl.SliceLayout(2, layout)
        width: gl.constexpr = _chunk_width(D)
        offsets = gl.convert_layout(row_offset, gl.SliceLayout(1, groups))
        is_row = gl.convert_layout(valid, gl.SliceLayout(1, groups))[:, None]
        group = gl.arange(0, width // 32, layout=gl.SliceLayout(0, groups))
        within = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        row_ptrs = ring_ptr + offsets[:, None]
        for chunk in gl.static_range(D // width):
            g = chunk * (width // 32) + group
            exponent = gl.load(row_ptrs + (D + g)[None, :], mask=is_row, other=0)
            multiplier = gl.exp2(exponent.to(gl.float32) - (127.0 - 8.0))
            code_ptrs = row_ptrs[:, :, None] + (32 * g)[None, :, None] + within[None, None, :]
            codes = gl.load(code_ptrs, mask=is_row[:, :, None], other=0).to(gl.int32)
            # e4m3 (s, e, m) at fp16 bits: e4m3 · 2^-8
            bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
            values = bits.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
            values = (values * multiplier[:, :, None]).to(gl.bfloat16)
            rows_smem.slice(chunk * width, width, dim=1).store(gl.reshape(values, [BLOCK_N, width]))

    @gluon.jit
    def _load_tile(tile, rows_smem, token, seq, position, floor, window_index, window_ptr,
                   pool_ptr, selection_ptr, block_table_ptr, num_selected, ring_len,
                   stride_window_seq, stride_window_row, stride_pool_block, stride_pool_row,
                   stride_sel, stride_table, RATIO: gl.constexpr, WINDOW: gl.constexpr,
                   WINDOW_IN_RING: gl.constexpr, D: gl.constexpr,
                   BLOCK_N: gl.constexpr):  # fmt: skip
        """Tile `tile`'s rows (the window's tiles first, then the selected ones) into
        `rows_smem`: bf16 window rows by cp.async (one commit group; rows that are not real
        are zero), the others decoded and stored. The caller waits, fences and syncs."""
        window_tiles: gl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
        if tile < window_tiles:
            if WINDOW_IN_RING:
                _load_ring_tile(tile, rows_smem, position, floor, window_index, window_ptr,
                                ring_len, stride_window_seq, stride_window_row, WINDOW, D,
                                BLOCK_N)  # fmt: skip
            else:
                _copy_window_tile(tile, rows_smem, seq, position, floor, window_index,
                                  window_ptr, stride_window_seq, stride_window_row, WINDOW, D,
                                  BLOCK_N)  # fmt: skip
        elif RATIO > 0:
            _load_selected_tile(tile - window_tiles, rows_smem, token, seq, pool_ptr,
                                selection_ptr, block_table_ptr, num_selected, stride_pool_block,
                                stride_pool_row, stride_sel, stride_table, RATIO, D,
                                BLOCK_N)  # fmt: skip

    @gluon.jit
    def _load_ring_tile(tile, rows_smem, position, floor, window_index, ring_ptr, ring_len,
                        stride_window_seq, stride_window_row, WINDOW: gl.constexpr,
                        D: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Window tile `tile` from the sequence's ring of MXFP8 rows (`_store_ring_rows`): key
        position q at row q % ring_len (ring_len >= WINDOW, 32-bit arithmetic per row)."""
        rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _ring_layout()))
        offset = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)
        valid = _window_valid(offset, position, floor, WINDOW)
        start = (position - (WINDOW - 1)).to(gl.int32)
        base = gl.where(start >= 0, start % ring_len, start)
        slot = base + offset
        slot = gl.where(slot >= ring_len, slot - ring_len, slot)
        row_offset = window_index * stride_window_seq + (
            gl.where(valid, slot, 0) * stride_window_row
        ).to(gl.int64)
        _store_ring_rows(rows_smem, ring_ptr, row_offset, valid, D, BLOCK_N)

    @gluon.jit
    def _copy_window_tile(tile, rows_smem, seq, position, floor, window_index, window_ptr,
                          stride_window_seq, stride_window_row, WINDOW: gl.constexpr,
                          D: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """Window tile `tile` from the token's bf16 rows by cp.async, one commit group (rows
        that are not real are zero-filled)."""
        layout: gl.constexpr = _bf16_rows_layout()
        offset = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        valid = _window_valid(offset, position, floor, WINDOW)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        row = (window_index + gl.where(valid, offset, 0)).to(gl.int64)
        # the strides come in 16-byte units: the copies' alignment is then known
        ptrs = window_ptr + seq * (stride_window_seq * 8) + row[:, None] * (stride_window_row * 8)
        _async_load(rows_smem, ptrs + d[None, :], mask=valid[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _load_selected_tile(tile, rows_smem, token, seq, pool_ptr, selection_ptr,
                            block_table_ptr, num_selected, stride_pool_block, stride_pool_row,
                            stride_sel, stride_table, RATIO: gl.constexpr, D: gl.constexpr,
                            BLOCK_N: gl.constexpr):  # fmt: skip
        """Selected tile `tile` (rows tile · BLOCK_N ..) from the FP4 pool (`_store_fp4_rows`)."""
        width: gl.constexpr = _chunk_width(D)
        layout: gl.constexpr = _fp4_words_layout(BLOCK_N, width)
        k = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        row_offset, valid = _selected_rows(
            selection_ptr, block_table_ptr, token, seq, k, num_selected, stride_sel,
            stride_table, stride_pool_block, stride_pool_row, RATIO,
        )  # fmt: skip
        _store_fp4_rows(rows_smem, pool_ptr, row_offset.to(gl.int64), valid, D, BLOCK_N)

    @gluon.jit
    def _tile_valid(tile, token, position, floor, selection_ptr, num_selected, stride_sel,
                    WINDOW: gl.constexpr, BLOCK_N: gl.constexpr,
                    LAYOUT: gl.constexpr):  # fmt: skip
        """Which of tile `tile`'s rows are real, [BLOCK_N] in LAYOUT."""
        window_tiles: gl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
        offset = gl.arange(0, BLOCK_N, layout=LAYOUT)
        if tile < window_tiles:
            valid = _window_valid(tile * BLOCK_N + offset, position, floor, WINDOW)
        else:
            k = (tile - window_tiles) * BLOCK_N + offset
            j = gl.load(selection_ptr + token * stride_sel + k, mask=k < num_selected, other=-1)
            valid = j >= 0
        return valid

    @gluon.jit
    def _work_item(work, seq_ptr, position_ptr, window_index_ptr, window_floor_ptr, num_heads,
                   HAS_FLOOR: gl.constexpr, WINDOW_IN_RING: gl.constexpr,
                   SPLITS: gl.constexpr):  # fmt: skip
        """(token int64, first head, row split, sequence, position, window floor, window index)
        of work item `work`: token-major, a token's head blocks, each block's row splits
        fastest."""
        head_blocks = gl.cdiv(num_heads, _HEADS)
        if SPLITS == 1:
            split = 0
            block = work
        else:
            split = work % SPLITS
            block = work // SPLITS
        token = (block // head_blocks).to(gl.int64)
        first_head = (block % head_blocks) * _HEADS
        seq = gl.load(seq_ptr + token)
        position = gl.load(position_ptr + token)
        floor = position * 0
        if HAS_FLOOR:
            floor = gl.load(window_floor_ptr + seq)
        if WINDOW_IN_RING:  # the sequence's slot
            window_index = gl.load(window_index_ptr + seq)
        else:  # the token's first row in its sequence's rows
            window_index = gl.load(window_index_ptr + token)
        return token, first_head, split, seq, position, floor, window_index

    @gluon.jit
    def _copy_queries(q_smem, q_ptr, token, first_head, num_heads, stride_qt, stride_qh,
                      D: gl.constexpr):  # fmt: skip
        """q [64 heads, D] of a token into `q_smem` by cp.async (missing heads zero), one
        commit group; q's strides come in 16-byte units (the copies' alignment known)."""
        q_load: gl.constexpr = _bf16_rows_layout()
        heads = first_head + gl.arange(0, _HEADS, layout=gl.SliceLayout(1, q_load))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, q_load))
        q_ptrs = q_ptr + token * (stride_qt * 8) + heads[:, None] * (stride_qh * 8) + d[None, :]
        _async_load(q_smem, q_ptrs, mask=(heads < num_heads)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _fresh_state(D: gl.constexpr, BLOCK_N: gl.constexpr):
        """A token's running max [64], sums [64, SUM_COLUMNS] (every column the sum: P · ones)
        and output accumulator [64, D] before its first tile."""
        m = gl.full([_HEADS], -1.0e30, gl.float32, gl.SliceLayout(1, _product_layout(BLOCK_N)))
        total = gl.zeros([_HEADS, _SUM_COLUMNS], gl.float32, _product_layout(_SUM_COLUMNS))
        return m, total, gl.zeros([_HEADS, D], gl.float32, _product_layout(D))

    @gluon.jit
    def _tile_products(tile, rows, q_smem, p_head_smem, p_rest_smem, max_smem, ones_smem, m,
                       total, o, token, position, floor, selection_ptr, num_selected, stride_sel,
                       softmax_scale, WINDOW: gl.constexpr, D: gl.constexpr,
                       BLOCK_N: gl.constexpr):  # fmt: skip
        """One tile of a token: wait for its rows (and q) in shared memory, S = q · rowsᵀ, the
        online softmax, then O and the sums' products issued (asynchronous: the caller loads
        the next rows, then waits). Returns (max, sums, O) as the products' accumulators."""
        s_layout: gl.constexpr = _product_layout(BLOCK_N)
        t_layout: gl.constexpr = _product_layout(_SUM_COLUMNS)
        # this tile's rows (every thread's copies and stores) and q are in shared memory
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        s_init = gl.zeros([_HEADS, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, rows.permute((1, 0)), s_init, use_acc=False, is_async=True)
        valid = _tile_valid(tile, token, position, floor, selection_ptr, num_selected,
                            stride_sel, WINDOW, BLOCK_N,
                            gl.SliceLayout(0, s_layout))  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s,))
        s = gl.where(valid[None, :], s * softmax_scale, float("-inf"))
        # each warpgroup's maxima over its half of the rows (its own columns of S), then both
        # halves' through shared memory: one barrier
        halves = gl.max(gl.reshape(s, [_HEADS, 2, BLOCK_N // 2]), axis=2)
        max_smem.store(halves)
        _cta_barrier()
        m_new = gl.maximum(m, gl.max(max_smem.load(s_layout), axis=1))
        alpha = gl.exp(m - m_new)
        p = gl.exp(s - m_new[:, None])
        p_head = p.to(gl.bfloat16)
        p_head_smem.store(p_head)
        p_rest_smem.store((p - p_head.to(gl.float32)).to(gl.bfloat16))
        fence_async_shared()
        _cta_barrier()
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, _product_layout(D)))[:, None]
        total = total * gl.convert_layout(alpha, gl.SliceLayout(1, t_layout))[:, None]
        o = warpgroup_mma(p_head_smem, rows, o, is_async=True)
        o = warpgroup_mma(p_rest_smem, rows, o, is_async=True)
        total = warpgroup_mma(p_head_smem, ones_smem, total, is_async=True)
        total = warpgroup_mma(p_rest_smem, ones_smem, total, is_async=True)
        return m_new, total, o

    @gluon.jit
    def _store_output(o, m, total, out_ptr, m_part_ptr, total_part_ptr, sink_ptr, token,
                      first_head, split, num_tokens, num_heads, stride_ot, stride_oh,
                      D: gl.constexpr, SPLITS: gl.constexpr):  # fmt: skip
        """A token's output: the sink folded in, O / sum (rounded to out's dtype); with row
        splits, the partials `sparse_mqa._combine_kernel` folds with the sink."""
        o_layout: gl.constexpr = _product_layout(D)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        out_heads = first_head + gl.arange(0, _HEADS, layout=o_rows)
        is_head = out_heads < num_heads
        m_o = gl.convert_layout(m, o_rows)
        total = gl.convert_layout(gl.max(total, axis=1), o_rows)
        out_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        if SPLITS == 1:
            sink = gl.load(sink_ptr + out_heads, mask=is_head, other=0.0)
            m_final = gl.maximum(m_o, sink)
            rescale = gl.exp(m_o - m_final)
            total = total * rescale + gl.exp(sink - m_final)
            out = o * (rescale / total)[:, None]
            out_ptrs = out_ptr + token * stride_ot + out_heads[:, None] * stride_oh
            gl.store(out_ptrs + out_d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=is_head[:, None])  # fmt: skip
        else:
            part = (split * num_tokens + token) * num_heads + out_heads
            gl.store(m_part_ptr + part, m_o, mask=is_head)
            gl.store(total_part_ptr + part, total, mask=is_head)
            gl.store(out_ptr + part[:, None] * D + out_d[None, :], o, mask=is_head[:, None])

    @gluon.jit(
        do_not_specialize=[
            "num_tokens", "num_selected", "ring_len", "stride_window_seq", "stride_sel",
            "stride_table",
        ]
    )  # fmt: skip
    def _attention_kernel(
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
        RATIO: gl.constexpr,
        WINDOW: gl.constexpr,
        WINDOW_IN_RING: gl.constexpr,
        HAS_FLOOR: gl.constexpr,
        D: gl.constexpr,
        BLOCK_N: gl.constexpr,
        SPLITS: gl.constexpr,
        PERSISTENT: gl.constexpr,
    ):
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, D], gl.bfloat16)
        rows_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
        p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [_HEADS, BLOCK_N], gl.bfloat16
        )

        token, first_head, split, seq, position, floor, window_index = _work_item(
            gl.program_id(0), seq_ptr, position_ptr, window_index_ptr, window_floor_ptr,
            num_heads, HAS_FLOOR, WINDOW_IN_RING, SPLITS,
        )  # fmt: skip

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [_HEADS, D], q_shared)
        rows_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], rows_shared)
        # P's bf16 head and remainder: two allocations, so their stores need no barrier between
        p_head_smem = gl.allocate_shared_memory(gl.bfloat16, [_HEADS, BLOCK_N], p_shared)
        p_rest_smem = gl.allocate_shared_memory(gl.bfloat16, [_HEADS, BLOCK_N], p_shared)
        # each warpgroup's row maxima of a tile, exchanged through shared memory
        max_smem = gl.allocate_shared_memory(
            gl.float32, [_HEADS, 2], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        # P · ones: the probabilities' row sums on the tensor cores, from the same bf16 head
        # and remainder as the values' product (no cross-warpgroup sum per tile)
        ones_layout: gl.constexpr = _bf16_rows_layout()
        ones_smem = gl.allocate_shared_memory(
            gl.bfloat16,
            [BLOCK_N, _SUM_COLUMNS],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, _SUM_COLUMNS], gl.bfloat16),
            gl.full([BLOCK_N, _SUM_COLUMNS], 1.0, gl.bfloat16, ones_layout),
        )

        _copy_queries(q_smem, q_ptr, token, first_head, num_heads, stride_qt, stride_qh, D)

        # (num_selected is 0 without a KV source; a tile count known at compile time, one
        # window tile and no selection, crashed Triton 3.6's lowering of the loop)
        num_tiles = (WINDOW + BLOCK_N - 1) // BLOCK_N + gl.cdiv(num_selected, BLOCK_N)
        # tile i of the token's rows is split i % SPLITS's (the `sparse_mqa` row splits' deal);
        # a split without tiles loads the last one and never reads it
        first_tile = gl.minimum(split, num_tiles - 1)
        _load_tile(first_tile, rows_smem.index(0), token, seq, position, floor, window_index,
                   window_ptr, pool_ptr, selection_ptr, block_table_ptr, num_selected, ring_len,
                   stride_window_seq, stride_window_row, stride_pool_block, stride_pool_row,
                   stride_sel, stride_table, RATIO, WINDOW, WINDOW_IN_RING, D,
                   BLOCK_N)  # fmt: skip

        m, total, o = _fresh_state(D, BLOCK_N)
        if PERSISTENT:  # one program per SM over work items program, program + programs, ..
            programs = gl.num_programs(0)
            num_work = num_tokens * gl.cdiv(num_heads, _HEADS)
            steps = gl.cdiv(num_work - gl.program_id(0), programs) * num_tiles
            work = gl.program_id(0)
            for step in range(steps):
                tile = step % num_tiles
                rows = rows_smem.index(step % 2)
                # the next work item's token (the last one's again past the end)
                next_token, next_head, _, next_seq, next_position, next_floor, next_index = (
                    _work_item(gl.minimum(work + programs, num_work - 1), seq_ptr, position_ptr,
                               window_index_ptr, window_floor_ptr, num_heads, HAS_FLOOR,
                               WINDOW_IN_RING, SPLITS)
                )  # fmt: skip
                m, total, o = _tile_products(
                    tile, rows, q_smem, p_head_smem, p_rest_smem, max_smem, ones_smem, m, total,
                    o, token, position, floor, selection_ptr, num_selected, stride_sel,
                    softmax_scale, WINDOW, D, BLOCK_N,
                )  # fmt: skip
                if tile + 1 < num_tiles:  # the next tile's rows while the tensor cores run
                    _load_tile(tile + 1, rows_smem.index(1 - step % 2), token, seq, position,
                               floor, window_index, window_ptr, pool_ptr, selection_ptr,
                               block_table_ptr, num_selected, ring_len, stride_window_seq,
                               stride_window_row, stride_pool_block, stride_pool_row, stride_sel,
                               stride_table, RATIO, WINDOW, WINDOW_IN_RING, D,
                               BLOCK_N)  # fmt: skip
                elif step + 1 < steps:  # the next item's q (every S of this item is done) and tile
                    _copy_queries(q_smem, q_ptr, next_token, next_head, num_heads, stride_qt,
                                  stride_qh, D)  # fmt: skip
                    _load_tile(0, rows_smem.index(1 - step % 2), next_token, next_seq,
                               next_position, next_floor, next_index, window_ptr, pool_ptr,
                               selection_ptr, block_table_ptr, num_selected, ring_len,
                               stride_window_seq, stride_window_row, stride_pool_block,
                               stride_pool_row, stride_sel, stride_table, RATIO, WINDOW,
                               WINDOW_IN_RING, D, BLOCK_N)  # fmt: skip
                o, total = warpgroup_mma_wait(0, deps=(o, total))
                if tile == num_tiles - 1:
                    _store_output(o, m, total, out_ptr, m_part_ptr, total_part_ptr, sink_ptr,
                                  token, first_head, split, num_tokens, num_heads, stride_ot,
                                  stride_oh, D, SPLITS)  # fmt: skip
                    m, total, o = _fresh_state(D, BLOCK_N)
                    work += programs
                    token, first_head, seq = next_token, next_head, next_seq
                    position, floor, window_index = next_position, next_floor, next_index
        else:
            for tile in range(split, num_tiles, SPLITS):
                slot = (tile // SPLITS) % 2
                m, total, o = _tile_products(
                    tile, rows_smem.index(slot), q_smem, p_head_smem, p_rest_smem, max_smem,
                    ones_smem, m, total, o, token, position, floor, selection_ptr, num_selected,
                    stride_sel, softmax_scale, WINDOW, D, BLOCK_N,
                )  # fmt: skip
                if tile + SPLITS < num_tiles:  # the next tile's rows while the tensor cores run
                    _load_tile(tile + SPLITS, rows_smem.index(1 - slot), token, seq, position,
                               floor, window_index, window_ptr, pool_ptr, selection_ptr,
                               block_table_ptr, num_selected, ring_len, stride_window_seq,
                               stride_window_row, stride_pool_block, stride_pool_row, stride_sel,
                               stride_table, RATIO, WINDOW, WINDOW_IN_RING, D,
                               BLOCK_N)  # fmt: skip
                o, total = warpgroup_mma_wait(0, deps=(o, total))
            async_copy.wait_group(0)  # a split without tiles: its copies never waited for
            _store_output(o, m, total, out_ptr, m_part_ptr, total_part_ptr, sink_ptr, token,
                          first_head, split, num_tokens, num_heads, stride_ot, stride_oh, D,
                          SPLITS)  # fmt: skip


def runs_here(q: Tensor) -> bool:
    """Whether this kernel can run on q's device: Gluon present and a Hopper GPU (sm90)."""
    return AVAILABLE and on_sm90(q.device)


def takes(q: Tensor, pool: Tensor | None, window_rows: Tensor | None = None) -> bool:
    """Whether `launch` takes this launch's queries, pool and bf16 window rows (the module
    docstring's contract: q and the window rows are copied in 16-byte pieces, the pool's rows
    read as 32-bit words)."""
    dim = q.shape[-1]
    if q.dtype != torch.bfloat16 or dim & (dim - 1) or not 64 <= dim <= 512:
        return False
    for rows in (q, window_rows):
        if rows is None:
            continue
        if rows.stride(-1) != 1 or rows.data_ptr() % 16 or any(s % 8 for s in rows.stride()[:2]):
            return False
    return pool is None or reads_as_words(pool)


def launch(
    q: Tensor,
    seq_of_token: Tensor,
    positions: Tensor,
    sources: tuple[Tensor, ...],
    sink: Tensor,
    out: Tensor,
    softmax_scale: float,
    *,
    ratio: int,
    window: int,
    window_in_ring: bool,
    has_floor: bool,
    block_n: int = 64,
    partials: tuple[Tensor, Tensor] | None = None,
    persistent: bool = False,
) -> None:
    """`_attention_kernel` over the tokens of q, one program per token and 64 heads (and row
    split). sources: (window rows, window index, floor, pool, selection, block tables) as
    `sparse_mqa` builds them for its Triton kernels (without a KV source, ratio 0 and the
    last three unread). out: [T, H, D] fp32 or q's dtype (rounded once). partials: row splits
    (flash-decoding): (m, sum) fp32 [splits, T, H], and out is then the accumulators fp32
    [splits, T, H, D] that `sparse_mqa._combine_kernel` folds with the sink; tile i of a
    token goes to split i % splits. persistent (without row splits): one program per SM,
    each over every SM-count-th token, the next token's q and first rows loaded under the
    current one's last products.

    Raises:
        ValueError: what `takes` refuses, block_n not in BLOCK_NS, partials of other shapes
            than out's, or persistent with them.
    """
    rows, _, _, pool, selection, tables = sources
    if not takes(q, pool if ratio else None, None if window_in_ring else rows):
        raise ValueError(
            "the Gluon attention takes bf16 q [T, H, 64..512] and bf16 window rows on 16-byte "
            "boundaries, pool rows on 4-byte ones"
        )
    if block_n not in BLOCK_NS:
        raise ValueError(f"block_n = {block_n}: the Gluon attention takes {BLOCK_NS}")
    num_tokens, num_heads, dim = q.shape
    splits = 1
    m_part = total_part = out
    if partials is not None:
        m_part, total_part = partials
        splits = m_part.shape[0]
        shape = (splits, num_tokens, num_heads)
        if m_part.shape != shape or total_part.shape != shape or out.shape != (*shape, dim):
            raise ValueError(f"partials of {shape} and accumulators of {(*shape, dim)}")
        if not all(t.is_contiguous() and t.dtype == torch.float32 for t in (*partials, out)):
            raise ValueError("the partials and accumulators must be contiguous fp32")
    if persistent and splits > 1:
        raise ValueError("the persistent Gluon attention takes no row splits")
    if not num_tokens:
        return
    # bf16 rows' and q's strides in 16-byte units (`_copy_window_tile`); ring rows' in bytes
    unit = 1 if window_in_ring else 8
    grid = (num_tokens * -(-num_heads // HEADS) * splits,)
    if persistent:
        grid = (min(grid[0], multiprocessors(q.device)),)
    _attention_kernel[grid](
        q, seq_of_token, positions, *sources, sink, out, m_part, total_part, num_tokens,
        num_heads, selection.shape[1] if ratio else 0, rows.shape[1], softmax_scale,
        q.stride(0) // 8, q.stride(1) // 8, rows.stride(0) // unit, rows.stride(1) // unit,
        pool.stride(0), pool.stride(1), selection.stride(0), tables.stride(0),
        out.stride(-3), out.stride(-2), RATIO=ratio, WINDOW=window,
        WINDOW_IN_RING=window_in_ring, HAS_FLOOR=has_floor, D=dim, BLOCK_N=block_n,
        SPLITS=splits, PERSISTENT=persistent, num_warps=NUM_WARPS,
    )  # fmt: skip
